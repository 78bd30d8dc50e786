"""Values the light queues hand out: entries, read results, resolved messages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias

from store.mapping import MqttProperties

# Where one queued message lives in the commitlog: (log topic, partition, offset), a plain tuple
# wherever it comes from (a queue read, the dispatcher's push, the core link).
Position: TypeAlias = tuple[str, int, int]


class ReadResult(NamedTuple):
    """`entries[i]` has sequence `first_seq + i` (None: a void entry, its record was lost).

    `start_seq` is the first valid sequence of the queue (> from_seq when retention trimmed what
    was asked for); `next_seq` is the sequence the next entry will get.
    """

    entries: Sequence[Position | None]
    start_seq: int
    next_seq: int
    first_seq: int


# Not frozen: a frozen dataclass sets each field through object.__setattr__ (2.3 us against
# 0.6 us for ten fields), once per message read from the store. Treat it as immutable anyway
# (unsafe_hash keeps the value hash the frozen version had), as store.mapping.MqttMessage.
@dataclass(slots=True, unsafe_hash=True)
class StoredMessage:
    """A message as an MQTT subscriber sees it, with its log position (retained: topic "" / -1)."""

    topic: str
    payload: bytes
    qos: int
    client_id: str
    retain: bool
    properties: MqttProperties | None
    timestamp_ms: int
    log_topic: str
    partition: int
    offset: int

    def expired(self, now_ms: int) -> bool:
        """MQTT 5 message expiry, counted from the broker receive time."""
        p = self.properties
        exp = p.message_expiry if p is not None else None
        return exp is not None and now_ms >= self.timestamp_ms + exp * 1000


def props_to_obj(p: MqttProperties | None) -> Any:
    if p is None:
        return None
    return [
        p.payload_format,
        p.message_expiry,
        p.content_type,
        p.response_topic,
        p.correlation_data,
        [list(u) for u in p.user_properties],
    ]


def props_from_obj(o: Any) -> MqttProperties | None:
    if o is None:
        return None
    pf, exp, ct, rt, cd, users = o
    return MqttProperties(pf, exp, ct, rt, cd, tuple((k, v) for k, v in users))
