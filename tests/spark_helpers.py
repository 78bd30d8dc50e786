"""Spark test support: a segment-file writer (the `spark` session fixture is in conftest.py).

`LogWriter` produces data dirs in the gateway's layout (docs/architecture.md) with standard Kafka
RecordBatch v2 bytes from aiokafka's builder, so the reader is tested against the format itself,
not against our own encoder.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from aiokafka.record.default_records import DefaultRecordBatchBuilder

JAVA_MISSING = "Java 17 is required for the Spark tests: apt-get install openjdk-17-jre-headless"


@dataclass
class Rec:
    key: bytes | None
    value: bytes | None
    timestamp: int
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)


def mqtt_rec(topic: str, payload: bytes, client_id: str, qos: int, ts: int) -> Rec:
    """A record as the gateway writes it for an MQTT PUBLISH (docs/topic-mapping.md)."""
    headers = [("mqtt.qos", str(qos).encode()), ("mqtt.client_id", client_id.encode())]
    return Rec(topic.encode(), payload, ts, headers)


def build_batch(
    base_offset: int, records: Sequence[Rec], compression: int = 0, log_append_time: int = 0
) -> bytes:
    """Standard v2 batch bytes; baseOffset is outside the CRC, so we patch it in."""
    b = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=compression,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 30,
    )
    for i, r in enumerate(records):
        b.append(i, timestamp=r.timestamp, key=r.key, value=r.value, headers=r.headers)
    buf = bytearray(b.build())
    buf[0:8] = struct.pack(">q", base_offset)
    if log_append_time:
        import crc32c

        # attributes bit 3 = LogAppendTime; max timestamp = broker time; CRC covers both.
        attrs = struct.unpack_from(">h", buf, 21)[0] | 0x08
        struct.pack_into(">h", buf, 21, attrs)
        struct.pack_into(">q", buf, 35, log_append_time)
        struct.pack_into(">I", buf, 17, crc32c.crc32c(bytes(buf[21:])))
    return bytes(buf)


class LogWriter:
    """Appends batches to `DATA/log/<topic>-<p>/<base>.log` like the gateway does."""

    def __init__(self, data_dir: Path, topics: dict[str, int]) -> None:
        self.log = Path(data_dir) / "log"
        self.log.mkdir(parents=True, exist_ok=True)
        self.topics: dict[str, int] = {}
        self.next: dict[tuple[str, int], int] = {}
        self.segment: dict[tuple[str, int], Path] = {}
        for t, n in topics.items():
            self.add_topic(t, n)

    def add_topic(self, topic: str, partitions: int) -> None:
        self.topics[topic] = partitions
        for p in range(partitions):
            (self.log / f"{topic}-{p}").mkdir(exist_ok=True)
            self.next.setdefault((topic, p), 0)
            if (topic, p) not in self.segment:
                self.roll(topic, p)
        tmp = self.log / "topics.json.tmp"
        tmp.write_text(
            json.dumps({t: {"partitions": n, "config": {}} for t, n in self.topics.items()})
        )
        tmp.replace(self.log / "topics.json")

    def roll(self, topic: str, partition: int) -> Path:
        path = self.log / f"{topic}-{partition}" / f"{self.next[(topic, partition)]:020d}.log"
        path.touch()
        self.segment[(topic, partition)] = path
        return path

    def batch_bytes(self, topic: str, partition: int, records: Sequence[Rec], **kw: int) -> bytes:
        """Bytes of the next batch, assigning offsets (without writing them)."""
        base = self.next[(topic, partition)]
        self.next[(topic, partition)] = base + len(records)
        return build_batch(base, records, **kw)

    def append(self, topic: str, partition: int, records: Sequence[Rec], **kw: int) -> int:
        """Write one batch; returns its base offset."""
        base = self.next[(topic, partition)]
        data = self.batch_bytes(topic, partition, records, **kw)
        with open(self.segment[(topic, partition)], "ab") as f:
            f.write(data)
        return base
