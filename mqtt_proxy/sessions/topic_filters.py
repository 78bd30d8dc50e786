"""Topic filters as the proxy sees them: validation, matching, `$share/...` and `$replay/...`.

A SUBSCRIBE filter names one light queue: the exact topic for a filter without wildcards, the
filter itself otherwise. Two prefixes are peeled off first:
- `$share/<group>/<filter>` (MQTT 5 §4.8.2, accepted from 3.1.1 clients too, as Mosquitto does):
  the members of a group share one position; each message goes to one member.
- `$replay/<since>/<filter>` (docs/replay.md): the subscription starts at
  `<since>` instead of the live end. `<since>` is Unix ms, ISO-8601 UTC or `-<n>{s,m,h,d}`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from lightqueue.topic_trie import FilterError, topic_matches, validate_filter

__all__ = ["FilterError", "FilterSpec", "parse_filter", "parse_since", "topic_matches"]


@dataclass(frozen=True, slots=True)
class FilterSpec:
    """A parsed SUBSCRIBE filter. `raw` is what the client sent (the key for UNSUBSCRIBE)."""

    raw: str
    filter: str
    share_group: str | None = None
    replay_since_ms: int | None = None


_DURATION = re.compile(r"^-(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_since(text: str, now_ms: int | None = None) -> int:
    """`<since>` → Unix ms. Accepts `1764000000000`, `2026-11-22T10:00:00Z`, `-15m`."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    text = text.strip()
    if text.isdigit():
        return int(text)
    m = _DURATION.match(text)
    if m:
        return now_ms - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith("Z") else text)
    except ValueError:
        raise FilterError(f"bad replay time {text!r}") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return int(dt.timestamp() * 1000)


def parse_filter(
    raw: str, replay_since: str | None = None, now_ms: int | None = None
) -> FilterSpec:
    """Peel `$share/` and `$replay/`, validate the rest. Raises FilterError."""
    filt = raw
    group: str | None = None
    since: int | None = None
    if filt.startswith("$share/"):
        parts = filt.split("/", 2)
        if len(parts) < 3 or not parts[1] or "+" in parts[1] or "#" in parts[1] or not parts[2]:
            raise FilterError(f"bad shared subscription {raw!r}")
        group, filt = parts[1], parts[2]
    if filt.startswith("$replay/"):
        parts = filt.split("/", 2)
        if len(parts) < 3 or not parts[2]:
            raise FilterError(f"bad replay subscription {raw!r}")
        since, filt = parse_since(parts[1], now_ms), parts[2]
    elif replay_since is not None:
        since = parse_since(replay_since, now_ms)
    validate_filter(filt)
    return FilterSpec(raw=raw, filter=filt, share_group=group, replay_since_ms=since)
