"""aiokafka clients against a running KafkaServer over the real Store (127.0.0.1, port 0)."""

from __future__ import annotations

import asyncio
import struct
import time
from pathlib import Path

import cramjam
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.protocol.produce import ProduceRequest_v7
from kafka_helpers import RawClient, running_gateway

from store.record_batch import HEADER_SIZE, batch_crc, build_batch, iter_batch_headers, iter_records

pytestmark = pytest.mark.timeout(120)


async def consume(consumer: AIOKafkaConsumer, n: int, timeout: float = 20.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        batches = await consumer.getmany(timeout_ms=200)
        for msgs in batches.values():
            out.extend(msgs)
    return out


@pytest.mark.parametrize("acks", [1, "all"])
async def test_produce_acks_then_consume_with_assign_and_seek(tmp_path: Path, acks) -> None:
    async with running_gateway(tmp_path / "data", partitions=2) as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap, acks=acks)
        await producer.start()
        try:
            metas = [
                await producer.send_and_wait("orders", f"v{i}".encode(), key=b"k", partition=i % 2)
                for i in range(20)
            ]
        finally:
            await producer.stop()
        assert [m.offset for m in metas if m.partition == 0] == list(range(10))
        assert gw.store.high_watermark("orders", 1) == 10

        consumer = AIOKafkaConsumer(bootstrap_servers=gw.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            tp = TopicPartition("orders", 0)
            consumer.assign([tp])
            consumer.seek(tp, 4)
            got = await consume(consumer, 6)
            assert [(m.offset, m.value) for m in got] == [
                (i, f"v{2 * i}".encode()) for i in range(4, 10)
            ]
            assert got[0].key == b"k"
            await consumer.seek_to_beginning(tp)
            assert (await consume(consumer, 10))[0].offset == 0
            assert await consumer.end_offsets([tp]) == {tp: 10}
            assert await consumer.beginning_offsets([tp]) == {tp: 0}
        finally:
            await consumer.stop()


async def test_idempotent_producer_and_state_survives_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running_gateway(data) as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap, enable_idempotence=True)
        await producer.start()
        try:
            futs = [await producer.send("idem", f"m{i}".encode()) for i in range(200)]
            offsets = [(await f).offset for f in futs]
        finally:
            await producer.stop()
        assert offsets == list(range(200))
        pid_before = gw.server.broker.producers.new_producer_id()
    async with running_gateway(data) as gw:
        # ids are never re-issued, and the sequences of the first producer are known again
        assert gw.server.broker.producers.new_producer_id() > pid_before
        assert gw.server.broker.producers._partitions[("idem", 0)]
        assert gw.store.high_watermark("idem", 0) == 200


async def test_live_fetch_is_woken_by_append(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        consumer = AIOKafkaConsumer(
            "live",
            bootstrap_servers=gw.bootstrap,
            fetch_max_wait_ms=5000,
            auto_offset_reset="latest",
        )
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap)
        await producer.start()
        await producer.send_and_wait("live", b"before")
        await consumer.start()
        try:
            await consumer.getmany(timeout_ms=300)  # position at the end, a long-poll in flight
            t0 = time.monotonic()
            await producer.send_and_wait("live", b"now")
            got = await consume(consumer, 1, timeout=4.5)
            assert [m.value for m in got] == [b"now"]
            assert time.monotonic() - t0 < 2.0  # woken by the append, not the 5 s max_wait
        finally:
            await consumer.stop()
            await producer.stop()


async def test_group_rebalance_commits_and_restart_resumes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    common = dict(group_id="grp", auto_offset_reset="earliest", enable_auto_commit=False,
                  session_timeout_ms=6000, heartbeat_interval_ms=300)  # fmt: skip
    async with running_gateway(data, partitions=4) as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap)
        await producer.start()
        for i in range(40):
            await producer.send("work", f"a{i}".encode(), partition=i % 4)
        await producer.flush()

        c1 = AIOKafkaConsumer("work", bootstrap_servers=gw.bootstrap, **common)
        await c1.start()
        first = await consume(c1, 40)
        assert len(first) == 40 and len(c1.assignment()) == 4
        await c1.commit()

        c2 = AIOKafkaConsumer("work", bootstrap_servers=gw.bootstrap, **common)
        await c2.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # both poll so the rebalance can complete
            await asyncio.gather(c1.getmany(timeout_ms=100), c2.getmany(timeout_ms=100))
            if len(c1.assignment()) == 2 and len(c2.assignment()) == 2:
                break
        assert len(c1.assignment()) == len(c2.assignment()) == 2
        assert not c1.assignment() & c2.assignment()
        group = gw.server.broker.groups.group("grp")
        assert group is not None and len(group.members) == 2 and group.generation >= 2

        for i in range(40, 48):
            await producer.send("work", f"a{i}".encode(), partition=i % 4)
        await producer.flush()
        got: list = []
        deadline = time.monotonic() + 20
        while len(got) < 8 and time.monotonic() < deadline:
            for c in (c1, c2):
                for msgs in (await c.getmany(timeout_ms=100)).values():
                    got.extend(msgs)
        assert sorted(m.value for m in got) == sorted(f"a{i}".encode() for i in range(40, 48))
        await c1.commit()
        await c2.commit()
        await c2.stop()  # LeaveGroup: c1 takes all partitions back
        deadline = time.monotonic() + 20
        while len(c1.assignment()) != 4 and time.monotonic() < deadline:
            await c1.getmany(timeout_ms=100)
        assert len(c1.assignment()) == 4
        await c1.stop()
        await producer.stop()

    async with running_gateway(data, partitions=4) as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap)
        await producer.start()
        await producer.send_and_wait("work", b"after-restart", partition=1)
        await producer.stop()
        c3 = AIOKafkaConsumer("work", bootstrap_servers=gw.bootstrap, **common)
        await c3.start()
        try:
            got = await consume(c3, 1)
            assert [m.value for m in got] == [b"after-restart"]  # resumed from committed offsets
            tp = TopicPartition("work", 1)
            assert await c3.committed(tp) == 12
        finally:
            await c3.stop()


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
async def test_compressed_batches_round_trip_stored_as_produced(tmp_path: Path, codec: str) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap, compression_type=codec,
                                    linger_ms=50)  # fmt: skip
        await producer.start()
        values = [f"{codec}-{i}-".encode() * 20 for i in range(50)]
        try:
            futs = [
                await producer.send("zip", v, key=str(i).encode()) for i, v in enumerate(values)
            ]
            await asyncio.gather(*futs)
        finally:
            await producer.stop()
        raw = gw.store.read("zip", 0, 0, 1 << 20)
        headers = list(iter_batch_headers(raw))
        codec_id = {"gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}[codec]
        assert all(h.attributes & 0x07 == codec_id for h in headers)  # stored as produced
        if codec == "snappy":  # aiokafka frames snappy the xerial way, as the Java client does
            assert raw[61:69] == b"\x82SNAPPY\x00"
        assert len(raw) < sum(len(v) for v in values)
        # the store's own decoder (used for light-queue dispatch) reads what the client framed
        pos, decoded = 0, []
        for h in headers:
            decoded += [r.value for r in iter_records(raw[pos : pos + h.size])]
            pos += h.size
        assert decoded == values
        consumer = AIOKafkaConsumer(
            "zip", bootstrap_servers=gw.bootstrap, auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            got = await consume(consumer, 50)
        finally:
            await consumer.stop()
        assert [m.value for m in got] == values


async def test_raw_snappy_batch_round_trip(tmp_path: Path) -> None:
    """Snappy without xerial framing (librdkafka's default) is stored and served as well."""
    records = [(1_700_000_000_000 + i, None, f"raw-{i}".encode() * 10, []) for i in range(20)]
    plain = bytes(build_batch(records))
    body = bytes(cramjam.snappy.compress_raw(plain[HEADER_SIZE:]))
    batch = bytearray(plain[:HEADER_SIZE] + body)
    struct.pack_into(">i", batch, 8, len(batch) - 12)  # batch length
    struct.pack_into(">h", batch, 21, 2)  # attributes: snappy
    struct.pack_into(">I", batch, 17, batch_crc(batch, 0, len(batch)))
    async with running_gateway(tmp_path / "data") as gw:
        gw.store.ensure_topic("rs")
        client = await RawClient.connect(gw.server.port)
        resp = await client.request(ProduceRequest_v7(None, 1, 5000, [("rs", [(0, bytes(batch))])]))
        assert resp.topics[0][1][0][1:3] == (0, 0)
        await client.close()
        assert gw.store.read("rs", 0, 0, 1 << 20)[HEADER_SIZE:] == body  # unchanged
        consumer = AIOKafkaConsumer(
            "rs", bootstrap_servers=gw.bootstrap, auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            got = await consume(consumer, 20)
        finally:
            await consumer.stop()
        assert [m.value for m in got] == [r[2] for r in records]


async def test_offsets_for_times_and_admin_create_topics(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        admin = AIOKafkaAdminClient(bootstrap_servers=gw.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic("made", num_partitions=3, replication_factor=1)])
            assert gw.store.topics()["made"] == 3
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap)
        await producer.start()
        base = int(time.time() * 1000) - 100_000
        for i in range(10):
            await producer.send_and_wait("made", b"x", partition=0, timestamp_ms=base + i * 1000)
        await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=gw.bootstrap)
        await consumer.start()
        try:
            tp = TopicPartition("made", 0)
            found = await consumer.offsets_for_times({tp: base + 4500})
            assert (found[tp].offset, found[tp].timestamp) == (5, base + 5000)
            assert (await consumer.offsets_for_times({tp: base + 10**9}))[tp] is None
        finally:
            await consumer.stop()


def test_serves_under_uvloop(tmp_path: Path) -> None:
    """`lightgate serve` runs on uvloop, whose transports differ from asyncio's."""
    uvloop = pytest.importorskip("uvloop")

    async def roundtrip() -> None:
        async with running_gateway(tmp_path / "data") as gw:
            producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap, acks="all")
            await producer.start()
            await producer.send_and_wait("uv", b"hello")
            await producer.stop()
            consumer = AIOKafkaConsumer("uv", bootstrap_servers=gw.bootstrap,
                                        auto_offset_reset="earliest")  # fmt: skip
            await consumer.start()
            try:
                assert [m.value for m in await consume(consumer, 1)] == [b"hello"]
            finally:
                await consumer.stop()

    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(roundtrip())
    finally:
        loop.close()


async def test_static_member_restart_keeps_consuming(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data", partitions=2) as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap)
        await producer.start()
        for i in range(10):
            await producer.send("st", f"s{i}".encode(), partition=i % 2)
        await producer.flush()
        opts = dict(group_id="static", group_instance_id="node-1", auto_offset_reset="earliest",
                    enable_auto_commit=False)  # fmt: skip
        c1 = AIOKafkaConsumer("st", bootstrap_servers=gw.bootstrap, **opts)
        await c1.start()
        assert len(await consume(c1, 10)) == 10
        await c1.commit()
        await c1.stop()
        await producer.send_and_wait("st", b"later", partition=0)
        await producer.stop()
        c2 = AIOKafkaConsumer("st", bootstrap_servers=gw.bootstrap, **opts)
        await c2.start()
        try:
            assert [m.value for m in await consume(c2, 1)] == [b"later"]
            group = gw.server.broker.groups.group("static")
            assert group is not None and list(group.instances) == ["node-1"]
        finally:
            await c2.stop()
