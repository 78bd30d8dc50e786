"""Kafka transactions with stock clients: confluent-kafka (librdkafka) transactional producers and
read_committed consumers, aiokafka's and kafka-python's transactional producers, kcat with
isolation.level, against a real Store + KafkaServer."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from pathlib import Path

import confluent_kafka as ck
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import TopicPartition
from kafka_helpers import consume_values, running_gateway

pytestmark = pytest.mark.timeout(120)


def _producer(bootstrap: str, tid: str, **extra: object) -> ck.Producer:
    p = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, **extra})
    p.init_transactions(10)
    return p


def _commit_and_abort(bootstrap: str) -> dict[str, list[str]]:
    p = _producer(bootstrap, "t-basic")
    p.begin_transaction()
    for i in range(5):
        p.produce("tx", f"c{i}".encode(), partition=0)
    p.commit_transaction(10)
    p.begin_transaction()
    for i in range(3):
        p.produce("tx", f"a{i}".encode(), partition=0)
    p.flush()
    p.abort_transaction(10)
    p.begin_transaction()
    p.produce("tx", b"d0", partition=0)
    p.commit_transaction(10)
    plain = ck.Producer({"bootstrap.servers": bootstrap})
    plain.produce("tx", b"plain", partition=0)
    plain.flush()
    return {
        "committed": consume_values(bootstrap, "tx", "read_committed", 7),
        "uncommitted": consume_values(bootstrap, "tx", "read_uncommitted", 10),
    }


async def test_commit_visible_abort_invisible_confluent(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        out = await asyncio.to_thread(_commit_and_abort, gw.bootstrap)
        assert out["committed"] == ["c0", "c1", "c2", "c3", "c4", "d0", "plain"]
        # read_uncommitted sees aborted records too (Kafka's semantics); markers never
        assert out["uncommitted"] == ["c0", "c1", "c2", "c3", "c4", "a0", "a1", "a2", "d0", "plain"]
        # 10 records + 3 markers
        assert gw.store.high_watermark("tx", 0) == 13
        assert gw.store.aborted_transactions("tx", 0, 0, 13) != []
        if shutil.which("kcat"):
            for iso, n in (("read_committed", 7), ("read_uncommitted", 10)):
                r = await asyncio.to_thread(
                    subprocess.run,
                    ["kcat", "-b", gw.bootstrap, "-C", "-t", "tx", "-o", "beginning", "-e",
                     "-q", "-X", f"isolation.level={iso}", "-f", "%s\\n"],
                    capture_output=True, text=True, timeout=30,
                )  # fmt: skip
                lines = r.stdout.split()
                assert len(lines) == n, (iso, r.stdout, r.stderr)
                assert ("a0" in lines) is (iso == "read_uncommitted")


def _open_txn_blocks(bootstrap: str) -> dict[str, object]:
    p = _producer(bootstrap, "t-open")
    plain = ck.Producer({"bootstrap.servers": bootstrap})
    plain.produce("lso", b"before", partition=0)
    plain.flush()
    p.begin_transaction()
    future = int(time.time() * 1000) + 3_600_000
    p.produce("lso", b"in-txn", partition=0, timestamp=future)
    p.flush()
    plain.produce("lso", b"after", partition=0)
    plain.flush()
    out: dict[str, object] = {
        "committed_open": consume_values(bootstrap, "lso", "read_committed", 3, wait=2),
        "uncommitted_open": consume_values(bootstrap, "lso", "read_uncommitted", 3),
    }
    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "wm",
                     "isolation.level": "read_committed"})  # fmt: skip
    tp = ck.TopicPartition("lso", 0)
    out["watermarks"] = c.get_watermark_offsets(tp, timeout=10, cached=False)
    by_time = ck.TopicPartition("lso", 0, future)
    out["by_time_open"] = c.offsets_for_times([by_time], timeout=10)[0].offset
    p.commit_transaction(10)
    out["by_time_done"] = c.offsets_for_times([by_time], timeout=10)[0].offset
    c.close()
    out["committed_done"] = consume_values(bootstrap, "lso", "read_committed", 3)
    return out


async def test_open_transaction_holds_the_last_stable_offset(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        out = await asyncio.to_thread(_open_txn_blocks, gw.bootstrap)
        assert out["committed_open"] == ["before"]  # stops at the LSO (offset 1)
        assert out["uncommitted_open"] == ["before", "in-txn", "after"]
        assert out["committed_done"] == ["before", "in-txn", "after"]
        assert out["watermarks"] == (0, 1)  # read_committed: the high end is the LSO
        assert out["by_time_open"] == -1  # a time lookup finds nothing past the LSO
        assert out["by_time_done"] == 1
        assert gw.store.last_stable_offset("lso", 0) == gw.store.high_watermark("lso", 0) == 4


def _zombie(bootstrap: str) -> dict[str, object]:
    old = _producer(bootstrap, "t-zombie")
    old.begin_transaction()
    old.produce("zb", b"zombie", partition=0)
    old.flush()
    new = _producer(bootstrap, "t-zombie")  # bumps the epoch, aborts the open transaction
    out: dict[str, object] = {}
    try:
        old.produce("zb", b"zombie2", partition=0)
        old.commit_transaction(10)
        out["zombie"] = "committed"
    except ck.KafkaException as e:
        err = e.args[0]
        out["zombie"] = err.code()
        out["fatal"] = err.fatal()
    new.begin_transaction()
    new.produce("zb", b"fresh", partition=0)
    new.commit_transaction(10)
    out["committed"] = consume_values(bootstrap, "zb", "read_committed", 1)
    out["uncommitted"] = consume_values(bootstrap, "zb", "read_uncommitted", 2)
    return out


async def test_zombie_producer_is_fenced(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        out = await asyncio.to_thread(_zombie, gw.bootstrap)
        assert out["zombie"] in (ck.KafkaError._FENCED, ck.KafkaError.PRODUCER_FENCED,
                                 ck.KafkaError.INVALID_PRODUCER_EPOCH), out  # fmt: skip
        assert out["committed"] == ["fresh"]
        assert out["uncommitted"] == ["zombie", "fresh"]  # zombie2 refused, never stored
        m = gw.server.broker.txns.txns["t-zombie"]
        assert m.epoch >= 1


async def test_aiokafka_transactional_producer(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        p = AIOKafkaProducer(bootstrap_servers=gw.bootstrap, transactional_id="t-aio")
        await p.start()
        try:
            async with p.transaction():
                for i in range(3):
                    await p.send_and_wait("aio", f"ok{i}".encode(), partition=0)
            await p.begin_transaction()
            await p.send_and_wait("aio", b"bad", partition=0)
            await p.abort_transaction()
            async with p.transaction():
                await p.send_and_wait("aio", b"last", partition=0)
        finally:
            await p.stop()
        for iso, want in (("read_committed", ["ok0", "ok1", "ok2", "last"]),
                          ("read_uncommitted", ["ok0", "ok1", "ok2", "bad", "last"])):  # fmt: skip
            c = AIOKafkaConsumer(bootstrap_servers=gw.bootstrap, isolation_level=iso,
                                 auto_offset_reset="earliest", enable_auto_commit=False)  # fmt: skip
            await c.start()
            try:
                tp = TopicPartition("aio", 0)
                c.assign([tp])
                await c.seek_to_beginning(tp)
                got: list[str] = []
                deadline = time.time() + 8
                while len(got) < len(want) and time.time() < deadline:
                    batch = await c.getmany(tp, timeout_ms=500)
                    got += [m.value.decode() for m in batch.get(tp, [])]
                assert got == want, iso
                if iso == "read_committed":
                    assert (await c.end_offsets([tp]))[tp] == 8  # 5 records + 3 markers
            finally:
                await c.stop()


def _consume_transform_produce(bootstrap: str) -> dict[str, object]:
    plain = ck.Producer({"bootstrap.servers": bootstrap})
    for i in range(10):
        plain.produce("ctp-in", f"v{i}".encode(), partition=0)
    plain.flush()
    consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "ctp",
                            "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                            "enable.auto.commit": False})  # fmt: skip
    consumer.subscribe(["ctp-in"])
    producer = _producer(bootstrap, "t-ctp")
    tp = ck.TopicPartition("ctp-in", 0)
    out: dict[str, object] = {"committed_after": [], "aborted_n": 0}
    done, rounds, chunks = 0, 0, 0
    while done < 10 and rounds < 40:
        rounds += 1
        msgs = consumer.consume(5, 1.0)
        msgs = [m for m in msgs if not m.error()]
        if not msgs:
            continue
        chunks += 1
        abort = chunks == 2  # the second chunk: aborted once, then redone
        producer.begin_transaction()
        for m in msgs:
            producer.produce("ctp-out", m.value().upper(), partition=0)
        producer.send_offsets_to_transaction(
            consumer.position(consumer.assignment()), consumer.consumer_group_metadata(), 10
        )
        if abort:
            producer.flush()  # else librdkafka purges them unsent
            producer.abort_transaction(10)
            out["aborted"] = (done, consumer.committed([tp], 10)[0].offset)
            out["aborted_n"] = len(msgs)
            consumer.seek(ck.TopicPartition("ctp-in", 0, done))  # rewind, as a real app would
            continue
        producer.commit_transaction(10)
        done += len(msgs)
        committed = out["committed_after"]
        assert isinstance(committed, list)
        committed.append(consumer.committed([tp], 10)[0].offset)
    consumer.close()
    out["out"] = consume_values(bootstrap, "ctp-out", "read_committed", 10)
    n = 10 + int(out["aborted_n"])  # type: ignore[call-overload]
    out["out_all"] = consume_values(bootstrap, "ctp-out", "read_uncommitted", n, wait=4)
    return out


async def test_consume_transform_produce_send_offsets(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        out = await asyncio.to_thread(_consume_transform_produce, gw.bootstrap)
        assert out["out"] == [f"V{i}" for i in range(10)]
        # the aborted chunk stays in the log, invisible to read_committed
        assert out["aborted_n"] and len(out["out_all"]) == 10 + out["aborted_n"]
        committed = out["committed_after"]
        assert committed == sorted(committed) and committed[-1] == 10
        done, seen = out["aborted"]
        assert seen == (done or -1001)  # an aborted transaction's offsets never reach the group
        assert gw.server.broker.offsets.get("ctp", "ctp-in", 0).offset == 10


def _times_out(bootstrap: str) -> dict[str, object]:
    p = _producer(bootstrap, "t-slow", **{"transaction.timeout.ms": 1500})
    p.begin_transaction()
    p.produce("slow", b"late", partition=0)
    p.flush()
    time.sleep(3.5)  # the coordinator aborts it (checked every second) and bumps the epoch
    out: dict[str, object] = {
        "committed": consume_values(bootstrap, "slow", "read_committed", 1, 2)
    }
    try:
        p.commit_transaction(10)
        out["commit"] = "ok"
    except ck.KafkaException as e:
        out["commit"] = e.args[0].code()
    return out


async def test_transaction_past_its_timeout_is_aborted(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        out = await asyncio.to_thread(_times_out, gw.bootstrap)
        assert out["committed"] == []
        assert out["commit"] != "ok"
        assert gw.store.last_stable_offset("slow", 0) == gw.store.high_watermark("slow", 0) == 2
        assert gw.store.aborted_transactions("slow", 0, 0, 2) != []


def _kafka_python(bootstrap: str) -> dict[str, list[bytes]]:
    import kafka

    p = kafka.KafkaProducer(bootstrap_servers=bootstrap, transactional_id="t-kp")
    p.init_transactions()
    p.begin_transaction()
    p.send("kp", b"ok", partition=0)
    p.commit_transaction()
    p.begin_transaction()
    p.send("kp", b"bad", partition=0)
    p.flush()
    p.abort_transaction()
    p.begin_transaction()
    p.send("kp", b"ok2", partition=0)
    p.commit_transaction()
    p.close()
    out = {}
    for iso in ("read_committed", "read_uncommitted"):
        c = kafka.KafkaConsumer("kp", bootstrap_servers=bootstrap, isolation_level=iso,
                                auto_offset_reset="earliest", consumer_timeout_ms=2000)  # fmt: skip
        out[iso] = [m.value for m in c]
        c.close()
    return out


async def test_kafka_python_transactional_producer(tmp_path: Path) -> None:
    async with running_gateway(tmp_path) as gw:
        out = await asyncio.to_thread(_kafka_python, gw.bootstrap)
        assert out["read_committed"] == [b"ok", b"ok2"]
        assert out["read_uncommitted"] == [b"ok", b"bad", b"ok2"]
