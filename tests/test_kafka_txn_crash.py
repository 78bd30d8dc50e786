"""Transactions across a crash: `kill -9` of a real `lightgate serve` with a transaction open, and
the coordinator's crash points (store/kafka/txn.py, recovery cases 1-3) with an in-process
gateway. A transaction open at the crash ends up aborted or committed, never half visible."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from pathlib import Path

import confluent_kafka as ck
import pytest
from gateway_process import GatewayProcess
from kafka_helpers import consume_values, running_gateway

pytestmark = pytest.mark.timeout(150)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_transaction(bootstrap: str, tid: str, topic: str) -> ck.Producer:
    p = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": tid})
    p.init_transactions(10)
    p.begin_transaction()
    for i in range(3):
        p.produce(topic, f"c{i}".encode(), partition=0)
    p.commit_transaction(10)
    p.begin_transaction()
    for i in range(3):
        p.produce(topic, f"open{i}".encode(), partition=0)
    p.flush()  # acked (fsync "always"): on disk, without a marker
    return p


def test_kill_9_mid_transaction_aborts_it(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    port = _free_port()
    gw = gateway_factory(data, "--kafka-port", str(port))
    bootstrap = f"127.0.0.1:{port}"
    zombie = _open_transaction(bootstrap, "t-crash", "crash")
    gw.kill()

    gateway_factory(data, "--kafka-port", str(port))
    assert consume_values(bootstrap, "crash", "read_committed", 3) == ["c0", "c1", "c2"]
    uncommitted = consume_values(bootstrap, "crash", "read_uncommitted", 6)
    assert uncommitted == ["c0", "c1", "c2", "open0", "open1", "open2"]  # aborted, still stored
    # the producer outlived the gateway: its epoch was bumped, so it cannot commit the remains
    with pytest.raises(ck.KafkaException):
        zombie.produce("crash", b"late", partition=0)
        zombie.commit_transaction(15)
    fresh = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": "t-crash"})
    fresh.init_transactions(10)
    fresh.begin_transaction()
    fresh.produce("crash", b"after", partition=0)
    fresh.commit_transaction(10)
    assert consume_values(bootstrap, "crash", "read_committed", 4) == ["c0", "c1", "c2", "after"]
    c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "wm",
                     "isolation.level": "read_committed"})  # fmt: skip
    low, high = c.get_watermark_offsets(ck.TopicPartition("crash", 0), timeout=10, cached=False)
    c.close()
    assert high == 3 + 1 + 3 + 1 + 1 + 1  # records + markers: the LSO is not stuck


async def test_crash_after_prepare_commit_completes_the_commit(tmp_path: Path) -> None:
    """Crash point: PrepareCommit is on disk, the markers are not. Restart writes them (and the
    transaction's offsets reach the group)."""
    async with running_gateway(tmp_path) as gw:
        p = await asyncio.to_thread(_open_transaction, gw.bootstrap, "t-prep", "prep")
        await asyncio.to_thread(p.purge)
    # edit the state file to what a crash right after the PrepareCommit write leaves
    path = tmp_path / "kafka" / "transactions.json"
    doc = json.loads(path.read_text())
    entry = next(e for e in doc["txns"] if e["tid"] == "t-prep")
    entry["state"] = "PrepareCommit"
    entry["pending"] = {"grp": [["prep", 0, 42, -1, None]]}
    path.write_text(json.dumps(doc))
    async with running_gateway(tmp_path) as gw:
        got = await asyncio.to_thread(consume_values, gw.bootstrap, "prep", "read_committed", 6)
        assert got == ["c0", "c1", "c2", "open0", "open1", "open2"]
        assert gw.server.broker.offsets.get("grp", "prep", 0).offset == 42
        assert gw.store.last_stable_offset("prep", 0) == gw.store.high_watermark("prep", 0)


async def test_end_txn_answers_once_the_completed_state_is_on_disk(tmp_path: Path) -> None:
    """Recovery of a PrepareCommit on disk commits every open batch of the producer id (case 1),
    so PrepareCommit must never be on disk once the producer may start its next transaction:
    EndTxn answers only after CompleteCommit is. (A `make test` run caught the old order: the
    complete state written in the background, kill -9, and recovery committed the data of the
    transaction opened after it.)"""
    async with running_gateway(tmp_path) as gw:
        p = await asyncio.to_thread(_open_transaction, gw.bootstrap, "t-done", "done")
        txns = gw.server.broker.txns
        m = txns.txns["t-done"]
        assert await txns.end_txn("t-done", m.pid, m.epoch, True, 0) == 0
        # read with no await in between: what a kill -9 right after the answer would leave
        doc = json.loads((tmp_path / "kafka" / "transactions.json").read_text())
        entry = next(e for e in doc["txns"] if e["tid"] == "t-done")
        assert entry["state"] == "CompleteCommit", entry
        await asyncio.to_thread(p.purge)


async def test_lost_state_file_aborts_open_data(tmp_path: Path) -> None:
    """Crash point: the log has a transaction's data but the coordinator knows nothing of it."""
    async with running_gateway(tmp_path) as gw:
        p = await asyncio.to_thread(_open_transaction, gw.bootstrap, "t-lost", "lost")
        await asyncio.to_thread(p.purge)
    (tmp_path / "kafka" / "transactions.json").unlink()
    (tmp_path / "log" / "txn-index.json").unlink()  # and the index is rebuilt from the log
    async with running_gateway(tmp_path) as gw:
        assert gw.store.last_stable_offset("lost", 0) == gw.store.high_watermark("lost", 0)
        got = await asyncio.to_thread(consume_values, gw.bootstrap, "lost", "read_committed", 3)
        assert got == ["c0", "c1", "c2"]


async def test_store_transaction_index_survives_restarts_and_a_stale_snapshot(
    tmp_path: Path,
) -> None:
    """The store's index alone (no Kafka listener): LSO and aborted lists after a clean restart,
    and after a snapshot that claims more of the log than is there (an OS crash lost a tail)."""
    from store import Store, StoreConfig
    from store.kafka.txn import control_batch
    from store.record_batch import TRANSACTIONAL_MASK, build_batch
    from store.txn_index import ABORT, COMMIT

    def data(pid: int, value: bytes) -> bytes:
        return bytes(build_batch([(0, None, value, [])], producer_id=pid, producer_epoch=0,
                                 base_sequence=0, attributes=TRANSACTIONAL_MASK))  # fmt: skip

    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    store.create_topic("ix", 1)
    for batch in (data(1, b"a"), data(2, b"b"), control_batch(1, 0, ABORT, 0), data(3, b"c"),
                  control_batch(2, 0, COMMIT, 0)):  # fmt: skip
        await store.append_batch("ix", 0, batch).durable
    # offsets: 0 a(1) 1 b(2) 2 abort(1) 3 c(3, open) 4 commit(2)
    assert store.last_stable_offset("ix", 0) == 3
    assert store.aborted_transactions("ix", 0, 0, 5) == [(1, 0)]
    await store.close()
    snapshot = tmp_path / "log" / "txn-index.json"
    doc = json.loads(snapshot.read_text())
    assert doc["partitions"][0]["covered"] == 5
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    assert store.last_stable_offset("ix", 0) == 3
    assert store.aborted_transactions("ix", 0, 2, 3) == [(1, 0)]
    assert store.aborted_transactions("ix", 0, 3, 5) == []
    await store.close()
    doc["partitions"][0].update(covered=99, open=[], aborted=[])  # claims a lost tail
    snapshot.write_text(json.dumps(doc))
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    try:
        assert store.last_stable_offset("ix", 0) == 3  # rebuilt from the log, not trusted
        assert store.aborted_transactions("ix", 0, 0, 5) == [(1, 0)]
    finally:
        await store.close()
