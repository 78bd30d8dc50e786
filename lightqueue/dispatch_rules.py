"""Which log records the dispatcher indexes, and under which MQTT topic (shared with the replay
backfill and the resolver, which must agree with it record for record)."""

from __future__ import annotations

from collections.abc import Callable

from store.mapping import PROBE_TOPIC, SYSTEM_TOPIC_PREFIX, mqtt_view


def is_system_topic(topic: str) -> bool:
    """Not dispatched: `__lightgate*` log topics, except the probes' own."""
    return topic.startswith(SYSTEM_TOPIC_PREFIX) and topic != PROBE_TOPIC


def mqtt_topic_of(log_topic: str, key: bytes | None) -> str:
    """The MQTT topic subscribers see for a record (docs/topic-mapping.md)."""
    return mqtt_view(log_topic, key, []).topic


def _never(topic: str, partition: int, producer_id: int, offset: int) -> bool:
    return False


def aborted_check(store: object) -> Callable[[str, int, int, int], bool]:
    """`(topic, partition, producer id, offset) -> bool`: is that transactional batch aborted?"""
    index = getattr(store, "txn_index", None)
    return _never if index is None else index.is_aborted  # type: ignore[no-any-return]
