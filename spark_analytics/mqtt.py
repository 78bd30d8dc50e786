"""MQTT topic filters for the reader, and the first-level <-> log topic mapping it relies on.

Filters are matched inside the reader on the `mqtt_topic` column with Arrow's RE2 kernel, so a
filter costs one vectorised pass per Arrow batch; a literal first level also prunes log topics.
"""

from __future__ import annotations

import re

_KAFKA_NAME = re.compile(r"^[a-zA-Z0-9._-]{1,249}$")
_RE2_SPECIAL = set(r".^$*+?()[]{}|\-")


class FilterError(ValueError):
    """An `mqttTopicFilter` that MQTT would reject."""


def validate_filter(flt: str) -> list[str]:
    """Levels of a valid MQTT filter (MQTT 3.1.1 section 4.7), else FilterError."""
    if not flt or "\x00" in flt or len(flt.encode()) > 65535:
        raise FilterError(f"invalid mqttTopicFilter {flt!r}: empty, NUL or too long")
    levels = flt.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            raise FilterError(f"invalid mqttTopicFilter {flt!r}: '#' must be a whole last level")
        if "+" in level and level != "+":
            raise FilterError(f"invalid mqttTopicFilter {flt!r}: '+' must be a whole level")
    return levels


def _literal(level: str) -> str:
    return "".join("\\" + c if c in _RE2_SPECIAL else c for c in level)


def filter_regex(flt: str) -> str:
    """Anchored RE2 pattern equivalent to the filter ('#' also matches the parent level)."""
    levels = validate_filter(flt)
    if levels == ["#"]:
        return "(?s)^.*$"
    parts: list[str] = []
    for level in levels:
        if level == "#":
            return "(?s)^" + "/".join(parts) + "(/.*)?$"
        parts.append("[^/]*" if level == "+" else _literal(level))
    return "(?s)^" + "/".join(parts) + "$"


def filter_plan(flt: str) -> tuple[str, str]:
    """Cheapest Arrow test: ("all", ""), ("equal", topic), ("prefix", p) for `p/#`, ("regex", re).

    RE2 costs ~75 ns/row; equal/starts_with a few ns.
    """
    levels = validate_filter(flt)
    if levels == ["#"]:
        return ("all", "")
    if "+" not in levels and "#" not in levels:
        return ("equal", flt)
    if "+" not in levels and levels[-1] == "#" and len(levels) > 1:
        return ("prefix", "/".join(levels[:-1]))
    return ("regex", filter_regex(flt))


def wildcard_first(flt: str) -> bool:
    """Filters starting with a wildcard never match `$` topics (MQTT 4.7.2)."""
    return flt[:1] in ("+", "#")


def topic_matches(flt: str, topic: str) -> bool:
    """Plain-Python match, used for pruning and in tests."""
    if wildcard_first(flt) and topic.startswith("$"):
        return False
    return re.fullmatch(filter_regex(flt), topic) is not None


def log_topic_for_level(level: str) -> str | None:
    """The log topic an MQTT first level maps to (docs/interfaces.md, "Topic mapping").

    Valid Kafka names map to themselves; other levels use the store's reversible escaping
    (`store.mapping`, docs/topic-mapping.md).
    """
    try:
        from store.mapping import escape_level
    except ImportError:  # pragma: no cover - store not installed: plain names only
        return level if _KAFKA_NAME.match(level) else None
    return str(escape_level(level))


def level_for_log_topic(topic: str) -> str | None:
    """The MQTT first level that maps to `topic`, None when none does (`$`, hashed names)."""
    try:
        from store.mapping import first_level_for
    except ImportError:  # pragma: no cover
        level: str | None = topic if _KAFKA_NAME.match(topic) else None
    else:
        try:
            level = str(first_level_for(topic))
        except ValueError:
            level = None
    if level is None or level.startswith("$"):
        return None
    return level


def topics_for_filter(flt: str, available: list[str]) -> list[str]:
    """Log topics that can hold records matching `flt`: one when the first level is literal."""
    first = validate_filter(flt)[0]
    if first in ("+", "#"):
        return available
    target = log_topic_for_level(first)
    return [t for t in available if t == target]


__all__ = [
    "FilterError",
    "filter_plan",
    "filter_regex",
    "level_for_log_topic",
    "log_topic_for_level",
    "topic_matches",
    "topics_for_filter",
    "validate_filter",
    "wildcard_first",
]
