"""Kafka test helpers: a real Store + KafkaServer on 127.0.0.1:0, and a raw-frame client.

The raw client encodes with aiokafka's protocol structs (an implementation independent of kio)
so tests can send exactly the bytes they mean, including broken ones.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatchBuilder

from store.kafka.config import KafkaConfig
from store.kafka.server import KafkaServer
from store.store import Store, StoreConfig


@dataclass
class Gateway:
    store: Store
    server: KafkaServer

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.server.port}"


@asynccontextmanager
async def running_gateway(
    data_dir: Path,
    *,
    partitions: int = 1,
    fsync: str = "always",
    security: Any = None,
    **kafka: Any,
) -> AsyncIterator[Gateway]:
    store = await Store.open(data_dir, StoreConfig(default_partitions=partitions, fsync=fsync))
    server = KafkaServer(store, "127.0.0.1", 0, KafkaConfig(**kafka), security=security)
    try:
        await server.start()
        yield Gateway(store, server)
    finally:
        await server.close()
        await store.close()


class RawClient:
    """One connection; send aiokafka request structs or raw bytes, read raw response frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._cid = 0

    @classmethod
    async def connect(cls, port: int) -> RawClient:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def request(self, req: Any, timeout: float = 10.0) -> Any:
        """Send an aiokafka RequestStruct and decode its response with aiokafka."""
        self._cid += 1
        body = req.build_request_header(self._cid, "raw").encode() + req.encode()
        await self.send_raw(struct.pack(">i", len(body)) + body)
        frame = await asyncio.wait_for(self.read_frame(), timeout)
        (cid,) = struct.unpack_from(">i", frame)
        assert cid == self._cid
        header_len = 4 + (1 if req.FLEXIBLE_VERSION else 0)  # tagged fields: empty
        return req.RESPONSE_TYPE.decode(frame[header_len:])

    async def read_frame(self) -> bytes:
        (size,) = struct.unpack(">i", await self.reader.readexactly(4))
        return await self.reader.readexactly(size)

    async def closed_by_peer(self, timeout: float = 5.0) -> bool:
        try:
            data = await asyncio.wait_for(self.reader.read(1), timeout)
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        return data == b""

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except ConnectionError:
            pass


def make_batch(
    values: list[bytes],
    *,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    compression: int = 0,
    timestamp: int | None = None,
    key: bytes | None = None,
) -> bytes:
    """A RecordBatch v2 built by aiokafka's builder."""
    builder = DefaultRecordBatchBuilder(2, compression, 0, producer_id, producer_epoch,
                                        base_sequence, 1 << 30)  # fmt: skip
    for i, v in enumerate(values):
        builder.append(i, timestamp, key, v, [])
    return bytes(builder.build())


def garble_records(batch: bytes | bytearray) -> bytes:
    """The batch with its last record bytes overwritten and the CRC recomputed over them: it
    passes every header and CRC check, yet no reader can decode its records."""
    import crc32c

    from store.record_batch import ATTRIBUTES_OFFSET, CRC_OFFSET

    out = bytearray(batch)
    out[-8:] = b"\xff" * 8
    struct.pack_into(">I", out, CRC_OFFSET, crc32c.crc32c(memoryview(out)[ATTRIBUTES_OFFSET:]))
    return bytes(out)


def consume_values(
    bootstrap: str, topic: str, isolation: str, expect: int, wait: float = 8.0
) -> list[str]:
    """Values read from the start of `topic` by a fresh librdkafka consumer with `isolation`
    (read_committed / read_uncommitted); stops after `expect` values or `wait` seconds."""
    import time

    import confluent_kafka as ck

    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{isolation}-{time.time()}",
                     "isolation.level": isolation, "auto.offset.reset": "earliest",
                     "enable.auto.commit": False})  # fmt: skip
    c.subscribe([topic])
    got: list[str] = []
    end = time.time() + wait
    try:
        while time.time() < end and len(got) < expect:
            m = c.poll(0.2)
            if m is not None and not m.error():
                got.append(m.value().decode())
    finally:
        c.close()
    return got
