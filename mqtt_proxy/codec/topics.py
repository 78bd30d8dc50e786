"""Topic name and topic filter syntax (MQTT 5 §4.7, 3.1.1 §4.7; shared subscriptions §4.8.2).

Validators return None when valid, else a short reason, so the caller raises the right error
class (LocalProtocolError in constructors, RemoteProtocolError in the parser) with its own code.
"""

from __future__ import annotations

__all__ = ["topic_name_error", "topic_filter_error", "split_shared"]

_SHARE = "$share/"


def topic_name_error(topic: str) -> str | None:
    """Why `topic` is not a valid PUBLISH topic name, or None. Empty names are the caller's call
    (legal in v5 with a Topic Alias)."""
    if "+" in topic or "#" in topic:
        return f"wildcard in topic name {topic!r}"
    if len(topic) > 0x3FFF and len(topic.encode()) > 0xFFFF:  # 4 bytes/char at most
        return "topic name longer than 65535 bytes"
    return None


def topic_filter_error(flt: str) -> str | None:
    """Why `flt` is not a valid topic filter, or None.

    `#` must be the last character and alone in its level; `+` alone in its level;
    `$share/{group}/{filter}`: a non-empty group without `/`, `+`, `#`, then a valid filter.
    """
    if not flt:
        return "empty topic filter"
    if flt.startswith(_SHARE):
        rest = flt[len(_SHARE) :]
        group, sep, flt = rest.partition("/")
        if not group or not sep:
            return f"shared subscription {rest!r} needs $share/<group>/<filter>"
        if "+" in group or "#" in group:
            return f"wildcard in share name {group!r}"
        if not flt:
            return "empty filter in shared subscription"
    elif flt == "$share":
        return "shared subscription without group"
    if "+" not in flt and "#" not in flt:  # fast path: no wildcards at all
        return None
    levels = flt.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            return f"'#' not alone in the last level of {flt!r}"
        if "+" in level and level != "+":
            return f"'+' not alone in its level in {flt!r}"
    return None


def split_shared(flt: str) -> tuple[str | None, str]:
    """`$share/g/a/b` -> ("g", "a/b"); anything else -> (None, flt). Assumes a valid filter."""
    if flt.startswith(_SHARE):
        group, _, rest = flt[len(_SHARE) :].partition("/")
        return group, rest
    return None, flt
