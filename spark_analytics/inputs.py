"""What a job will read, checked and counted on the driver before Spark starts.

Everything here is plain Python (no pyspark import), so `lightgate analytics` rejects bad options
and empty selections in well under a second instead of after the JVM has started. Counts come from
batch headers (`logdir.walk_headers`) plus one decoded batch per partition for `--since`/`--until`
(Kafka's offsetsForTimes rule), so they match what the jobs read except where a filter is applied
while reading (then they are an upper bound and say so).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from spark_analytics.logdir import (
    LogDirError,
    list_segments,
    list_topics,
    log_dir,
    offset_for_timestamp,
    walk_headers,
)
from spark_analytics.mqtt import topics_for_filter, validate_filter
from store.mapping import DEVICE_EVENTS_TOPIC as DEVICE_EVENTS_TOPIC  # jobs, cli read it here
from store.record_batch import BH_BASE_OFFSET, BH_LAST_OFFSET_DELTA, BH_MAX_TIMESTAMP

INTERNAL_PREFIX = "__"


class AnalyticsError(Exception):
    """A job cannot run (missing data dir, bad argument); the message says what to do."""


class NoRecords(AnalyticsError):
    """The selection holds no records; the message says why (exit code 3 in the CLI)."""


_DURATION = re.compile(r"^-(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}


def parse_since(text: str, now_ms: int | None = None) -> int:
    """Unix ms, ISO-8601 (`2026-11-22T10:00:00Z`) or `-15m`/`-2h`/`-7d` (as `$replay` accepts)."""
    t = text.strip()
    if t.isdigit():
        return int(t)
    m = _DURATION.match(t)
    if m:
        now = int(time.time() * 1000) if now_ms is None else now_ms
        return now - int(float(m.group(1)) * _UNIT_MS[m.group(2)])
    try:
        dt = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise AnalyticsError(
            f"time {text!r}: expected Unix ms, ISO-8601 with zone or -15m/-2h/-7d"
        ) from None
    if dt.tzinfo is None:
        raise AnalyticsError(f"time {text!r}: give a time zone, e.g. {t}Z")
    return int(dt.timestamp() * 1000)


_WINDOW = re.compile(r"^\s*(\d+)\s*(second|minute|hour|day|week)s?\s*$", re.IGNORECASE)
_UNIT_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}


def window_seconds(window: str) -> int:
    """Seconds in a Spark window duration such as '30 seconds' or '1 hour'."""
    m = _WINDOW.match(window)
    if not m or int(m.group(1)) <= 0:
        raise AnalyticsError(f"window {window!r}: expected e.g. '30 seconds', '1 minute', '1 hour'")
    return int(m.group(1)) * _UNIT_S[m.group(2).lower()]


def check_device_from(device_from: str) -> int | None:
    """None for `client_id`, N for `topic:N`; AnalyticsError otherwise."""
    if device_from == "client_id":
        return None
    m = re.fullmatch(r"topic:(\d+)", device_from)
    if not m:
        raise AnalyticsError(f"device_from {device_from!r}: use client_id or topic:N (N >= 0)")
    return int(m.group(1))


def topics_option(options: dict[str, str] | None) -> list[str] | None:
    raw = (options or {}).get("topics")
    return [t.strip() for t in raw.split(",") if t.strip()] if raw else None


def iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@dataclass
class Selection:
    """Records a job will read per log topic, and why there are none when there are none."""

    data_dir: str
    counts: dict[str, int]
    mqtt_filter: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    newest_ms: int | None = None  # newest record time in the selected topics (from headers)
    end_offsets: dict[str, dict[str, int]] = field(default_factory=dict)
    start_offsets: dict[str, dict[str, int]] = field(default_factory=dict)
    reason: str | None = None  # set when nothing is selected before any filter

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def exact(self) -> bool:
        """False when the filter is applied while reading: `total` is then an upper bound.

        `#` and `level/#` select whole log topics (every record of log topic `sensors` has MQTT
        first level `sensors`), so topic pruning alone makes their counts exact.
        """
        if self.mqtt_filter is None:
            return True
        levels = validate_filter(self.mqtt_filter)
        return levels == ["#"] or (len(levels) == 2 and levels[1] == "#" and levels[0] != "+")

    def describe(self, records: int | None = None) -> str:
        n = self.total if records is None else records
        what = f"{n:,} records" if self.exact else f"up to {n:,} records"
        text = f"{what} from {len(self.counts)} topic(s)"
        if self.mqtt_filter:
            text += f", filter {self.mqtt_filter!r}"
        if self.since_ms is not None:
            text += f", since {iso(self.since_ms)}"
        if self.until_ms is not None:
            text += f", until {iso(self.until_ms)}"
        return text

    def new_since(self, committed: dict[str, dict[str, int]] | None) -> int:
        """Records after a streaming checkpoint's committed offsets (all of them if none)."""
        if not committed:
            return self.total
        n = 0
        for topic, parts in self.end_offsets.items():
            for p, end in parts.items():
                start = self.start_offsets.get(topic, {}).get(p, 0)
                done = committed.get(topic, {}).get(p)
                n += max(0, end - max(start, done if done is not None else start))
        return n

    def empty_after_read(self) -> str:
        """Why a job that read this selection got no rows (the filter matched nothing)."""
        if self.reason:
            return self.reason
        return (
            f"no records match: filter {self.mqtt_filter!r} matched none of the "
            f"{self.describe()} in {self.data_dir}"
            if self.mqtt_filter
            else f"no records match ({self.describe()})"
        )


def _partition_range(log: Path, topic: str, p: int) -> tuple[int, int, int | None]:
    """(first offset, end offset, newest max timestamp) from segment listings and batch headers."""
    segs = list_segments(log, topic, p)
    if not segs:
        return 0, 0, None
    end = segs[-1][0]
    newest = None
    for _, h in walk_headers(segs[-1][1]):
        end = h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA] + 1
        newest = h[BH_MAX_TIMESTAMP] if newest is None else max(newest, h[BH_MAX_TIMESTAMP])
    return segs[0][0], end, newest


def select(
    data_dir: str | Path,
    options: dict[str, str] | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> Selection:
    """Count what `_read(..., since_ms, until_ms, options)` will see; AnalyticsError on bad input.

    `reason` is set (and `total` is 0) when nothing can match, saying why: a named topic that
    does not exist, an empty log, a time range past the newest record, a filter whose first
    level maps to no topic with records.
    """
    try:
        log = log_dir(data_dir)
    except LogDirError as exc:
        raise AnalyticsError(f"{exc}. Point --data-dir at the gateway's data dir.") from None
    known = list_topics(log)
    named = topics_option(options)
    flt = (options or {}).get("mqttTopicFilter")
    if flt:
        validate_filter(flt)
    sel = Selection(str(data_dir), {}, flt or None, since_ms, until_ms)
    if named is not None:
        missing = [t for t in named if t not in known]
        names = [t for t in named if t in known]
        if missing and not names:
            sel.reason = f"topic(s) {missing} not found in {data_dir}; known: {sorted(known)}"
            return sel
    else:
        names = sorted(t for t in known if not t.startswith(INTERNAL_PREFIX))
    if flt:
        pruned = topics_for_filter(flt, names)
        if not pruned:
            sel.reason = (
                f"filter {flt!r}: its first level maps to no topic here "
                f"(topics: {', '.join(names) or 'none'})"
            )
            return sel
        names = pruned
    all_records = 0
    for t in names:
        sel.counts[t] = 0
        for p in range(known.get(t, 0)):
            first, end, newest = _partition_range(log, t, p)
            all_records += end - first
            if newest is not None:
                sel.newest_ms = newest if sel.newest_ms is None else max(sel.newest_ms, newest)
            start = first
            if since_ms is not None and end > first:
                found = offset_for_timestamp(log, t, p, since_ms)
                start = end if found is None else max(first, found)
            stop = end
            if until_ms is not None and end > first:
                found = offset_for_timestamp(log, t, p, until_ms)
                stop = end if found is None else found
            sel.start_offsets.setdefault(t, {})[str(p)] = start
            sel.end_offsets.setdefault(t, {})[str(p)] = end
            sel.counts[t] += max(0, stop - start)
    if sel.total:
        return sel
    where = ", ".join(names) if names else "no topics yet"
    if not all_records:
        sel.reason = f"no records in {data_dir} ({where}); send traffic through the gateway first"
    elif since_ms is not None and sel.newest_ms is not None and sel.newest_ms < since_ms:
        sel.reason = (
            f"no records at or after --since {iso(since_ms)}: the newest of the {all_records:,} "
            f"records in {where} is from {iso(sel.newest_ms)}"
        )
    else:
        sel.reason = f"none of the {all_records:,} records in {where} is in the time range"
    return sel


def checkpoint_offsets(ckpt: Path) -> dict[str, dict[str, int]] | None:
    """Source offsets of the last committed micro-batch of a Structured Streaming checkpoint.

    Layout (Spark): `offsets/<id>` = version line, metadata JSON, then one offset JSON per source;
    `commits/<id>` exists once batch <id> finished. Our offsets are `{"topic": {"p": next}}`.
    """
    commits = [int(f.name) for f in (ckpt / "commits").glob("[0-9]*")] if ckpt.is_dir() else []
    if not commits:
        return None
    try:
        lines = (ckpt / "offsets" / str(max(commits))).read_text().splitlines()
        raw = json.loads(lines[2])
        return {t: {str(p): int(o) for p, o in parts.items()} for t, parts in raw.items()}
    except (OSError, IndexError, ValueError, AttributeError):
        return None
