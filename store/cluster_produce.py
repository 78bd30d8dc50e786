"""Producing to a Kafka cluster the bytes the local log would have written.

`PrebuiltBatch` hands aiokafka's producer a RecordBatch v2 built by `store.mqtt_batches` (the
same builder `Store.append_mqtt` uses), so a record produced for an MQTT PUBLISH is the one
the local log lays out: key = MQTT topic, `mqtt.*` headers, CreateTime = receive time. The
producer keeps what makes it a good Kafka producer: acks=all, idempotence (it stamps producer
id, epoch and sequence into the header through `_set_producer_state`, and the CRC is computed
again over the stamped bytes), retries, one request per broker for many partitions.

`aiokafka.producer.message_accumulator.BatchBuilder` is the interface relied on (`append`,
`close`, `_set_producer_state`, `_build`, `size`, `record_count`, `closed`); aiokafka 0.14.
"""

from __future__ import annotations

import struct

from aiokafka.producer.message_accumulator import BatchBuilder

from store.record_batch import _OFFSETS, ATTRIBUTES_OFFSET, CRC_OFFSET, batch_crc

_PRODUCER = struct.Struct(">qhi")  # producer id, producer epoch, base sequence
_PRODUCER_OFFSET = _OFFSETS["producer_id"]
_CRC = struct.Struct(">I")
assert _PRODUCER_OFFSET > ATTRIBUTES_OFFSET  # inside the CRC's span: stamp, then checksum


class PrebuiltBatch(BatchBuilder):  # type: ignore[misc]
    """A closed BatchBuilder over finished bytes (base offset 0; the broker assigns offsets)."""

    def __init__(self, data: bytes | bytearray, records: int) -> None:  # no super(): no builder
        self._buffer: bytes | None = None
        self._data = bytearray(data)
        self._records = records
        self._closed = True

    def append(self, *, timestamp: int | None, key: bytes | None, value: bytes | None,
               headers: object = ()) -> None:  # fmt: skip
        return None  # closed: every record is already in the bytes

    def close(self) -> None:
        self._closed = True

    def _set_producer_state(
        self, producer_id: int, producer_epoch: int, base_sequence: int
    ) -> None:
        _PRODUCER.pack_into(
            self._data, _PRODUCER_OFFSET, producer_id, producer_epoch, base_sequence
        )
        _CRC.pack_into(self._data, CRC_OFFSET, batch_crc(self._data, 0, len(self._data)))

    def _build(self) -> bytes:
        if self._buffer is None:
            self._buffer = bytes(self._data)
        return self._buffer

    def size(self) -> int:
        return len(self._data)

    def record_count(self) -> int:
        return self._records

    def closed(self) -> bool:
        return True
