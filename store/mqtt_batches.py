"""MQTT messages → RecordBatch v2 bytes, one batch per partition, for the store or a remote proxy.

The same code builds the batches whether the store is in this process (`Store.append_mqtt`
stages them on its `Log`s) or behind the core link (`mqtt_proxy.backends.remote_store.RemoteStore` ships them to
the core, which appends them as it appends a Kafka producer's). So a record written for an MQTT
PUBLISH is byte-identical either way (docs/topic-mapping.md: key = MQTT topic, headers `mqtt.*`).

Hot path: batches are built by aiokafka's Cython builder (0.26-0.44 us/record, see
`record_batch.build_uncompressed`); the two headers of a plain PUBLISH are built inline with the
client id's bytes cached per call.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

from store.mapping import MqttMessage, headers_for
from store.record_batch import _CBuilder, build_batch
from store.twins import twin

# An MQTT append is cut into batches of about this many bytes. A reader far behind its light
# queue reads the batch holding its next entry whole, for each window of entries: with 1 MiB
# batches (~8,000 fan-in records) that pread and walk cost a cold read 1.8 us per message, with
# 64 KiB 0.6-1.1, and building and indexing them costs no more (docs/performance-history.md).
MQTT_BATCH_BYTES = 64 << 10

_QOS_B = (b"0", b"1", b"2")

# route(mqtt topic) -> (slot, key bytes): the slot names the partition (a `Log`, or (topic, p)).
Route = Callable[[str], tuple[Hashable, bytes]]


def build_mqtt_batches(
    messages: Sequence[MqttMessage], route: Route, now_ms: int
) -> list[tuple[Any, bytes | bytearray, int, int, list[int]]]:
    """Group `messages` by partition (input order kept within one) and build their batches.

    Returns `(slot, batch, record count, max timestamp, indexes into messages)` per batch, base
    offset 0. A message with `timestamp_ms == 0` gets `now_ms`. `route` may raise (invalid
    topic, unknown log topic) before anything is built: then nothing is returned.
    """
    groups, keys = _group_by_slot(messages, route)
    out: list[tuple[Any, bytes | bytearray, int, int, list[int]]] = []
    cids: dict[str, bytes] = {}
    build = _build_records
    for slot, idxs in groups.items():
        j0, total = 0, len(idxs)
        while j0 < total:
            buf, j, max_ts = build(messages, idxs, j0, keys, now_ms, cids, MQTT_BATCH_BYTES)
            out.append((slot, buf, j - j0, max_ts, idxs[j0:j]))
            j0 = j
    return out


def group_by_slot_py(
    messages: Sequence[MqttMessage], route: Route
) -> tuple[dict[Any, list[int]], list[bytes]]:
    """The partition groups of an append (slot -> indexes into `messages`, in order) and each
    message's key; routes once per topic. The pure twin of `store._cmqtt_batches.group_by_slot` (a
    Python loop per message here was ~5 % of fan-in)."""
    groups: dict[Any, list[int]] = {}
    keys: list[bytes] = []
    seen: dict[str, tuple[bytes, list[int]]] = {}  # topic -> (key, its partition's indexes)
    for i, m in enumerate(messages):
        e = seen.get(m.topic)
        if e is None:  # route once per topic and call (devices repeat their topics)
            slot, key = route(m.topic)
            g = groups.get(slot)
            if g is None:
                g = groups[slot] = []
            e = seen[m.topic] = (key, g)
        keys.append(e[0])
        e[1].append(i)
    return groups, keys


def _build_records_py(
    messages: Sequence[MqttMessage],
    idxs: list[int],
    j0: int,
    keys: list[bytes],
    now_ms: int,
    cids: dict[str, bytes],
    max_bytes: int,
) -> tuple[bytes | bytearray, int, int]:
    """One batch of `messages[idxs[j]]` from j0 while under `max_bytes`: (batch, next j, max
    timestamp). The reference of `store._cmqtt_batches.build_records` (same bytes)."""
    b = _CBuilder(2, 0, 0, -1, -1, -1, 1 << 62) if _CBuilder is not None else None
    recs = []
    total = len(idxs)
    max_ts, nbytes, j = 0, 0, j0
    while j < total and nbytes < max_bytes:
        i = idxs[j]
        m = messages[i]
        ts = m.timestamp_ms or now_ms
        if ts > max_ts:
            max_ts = ts
        if m.properties is None and not m.retain:
            cid = cids.get(m.client_id)
            if cid is None:
                cid = cids[m.client_id] = m.client_id.encode()
            hs: list[tuple[str, bytes | None]] = [
                ("mqtt.qos", _QOS_B[m.qos]),
                ("mqtt.client_id", cid),
            ]
        else:
            hs = headers_for(m)
        key = keys[i]
        if b is not None:
            b.append(j - j0, ts, key, m.payload, hs)
        else:
            recs.append((ts, key, m.payload, hs))
        nbytes += len(m.payload) + len(key) + 40
        j += 1
    return (b.build() if b is not None else build_batch(recs)), j, max_ts


# The compiled loops (store/_cmqtt_batches.pyx) unless absent or disabled: the same bytes.
_group_by_slot = twin(
    group_by_slot_py,
    "store._cmqtt_batches",
    "group_by_slot",
    what="an append's messages grouped by partition, each message's key",
)
_build_records = twin(
    _build_records_py,
    "store._cmqtt_batches",
    "build_records",
    what="one RecordBatch v2 of MQTT messages (a message's fields read from its slots)",
)
