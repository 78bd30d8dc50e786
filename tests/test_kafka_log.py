"""`log = "kafka"`: the log on a real Kafka-compatible cluster (Tansu, tests/tansu.py).

MQTT through Lightgate lands on the cluster's topics as the local log lays it out; records other
Kafka clients produce reach MQTT subscribers; offline sessions drain from the cluster; a
kill -9 loses nothing acknowledged and a lost data dir is rebuilt from the cluster.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from gateway_process import ROOT, GatewayProcess
from kafka_log_checks import consume_all, replay_from_time
from mqtt_helpers import V5, Client
from tansu import Tansu, free_port, kafka_args

pytestmark = pytest.mark.timeout(120)


def start(tmp: Path, t: Tansu, name: str = "data", *more: str) -> GatewayProcess:
    return GatewayProcess(tmp / name, kafka_args(t, *more)).start()


def test_mqtt_end_to_end_on_the_cluster(tmp_path: Path, tansu: Tansu) -> None:
    gw = start(tmp_path, tansu)
    try:
        assert "kafka=" not in gw.ready_line
        port = gw.port("mqtt")
        sub = Client(port, "sub", version=V5).connect()
        sub.subscribe("plant/#", qos=2)
        pub = Client(port, "pub").connect()
        for q in (0, 1, 2):
            pub.publish(f"plant/line{q}", f"m{q}".encode(), qos=q)  # waits for PUBACK / PUBCOMP
        got = sorted((m.topic, m.payload, m.qos) for m in sub.expect(3))
        assert got == [
            ("plant/line0", b"m0", 0),
            ("plant/line1", b"m1", 1),
            ("plant/line2", b"m2", 2),
        ]
        # The records are on the cluster, laid out as the local log lays them out.
        recs = asyncio.run(consume_all(tansu.bootstrap, "plant", 3))
        assert sorted(r.value for r in recs) == [b"m0", b"m1", b"m2"]
        r = next(r for r in recs if r.value == b"m1")
        assert r.key == b"plant/line1"
        assert dict(r.headers) == {"mqtt.qos": b"1", "mqtt.client_id": b"pub"}
        assert r.timestamp_type == 0 and abs(r.timestamp - time.time() * 1000) < 60_000
        pub.disconnect()
        sub.disconnect()
    finally:
        gw.stop()


def test_records_from_other_kafka_clients_reach_mqtt(tmp_path: Path, tansu: Tansu) -> None:
    gw = start(tmp_path, tansu)
    try:
        sub = Client(gw.port("mqtt"), "sub2").connect()
        sub.subscribe("sensors/#", qos=1)

        async def produce() -> None:
            p = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap, acks="all")
            await p.start()
            try:
                await p.send_and_wait("sensors", b"21.5", key=b"sensors/t1")
            finally:
                await p.stop()

        asyncio.run(produce())
        (m,) = sub.expect(1, timeout=15)
        assert (m.topic, m.payload) == ("sensors/t1", b"21.5")
        sub.disconnect()
    finally:
        gw.stop()


def test_offline_session_drains_from_the_cluster(tmp_path: Path, tansu: Tansu) -> None:
    gw = start(tmp_path, tansu)
    try:
        port = gw.port("mqtt")
        sub = Client(port, "offline").connect(clean=False)
        sub.subscribe("fleet/+/pos", qos=1)
        sub.disconnect()
        pub = Client(port, "truck").connect()
        n = 2000
        for i in range(n):
            pub.publish(f"fleet/t{i % 7}/pos", str(i).encode(), qos=1, wait=(i == n - 1))
        pub.disconnect()
        # A restart between: nothing is in the node's memory, the records come from the cluster
        # (and its high watermarks are learned right: Tansu's ListOffsets(latest) is not).
        gw.stop()
        gw = start(tmp_path, tansu)
        sub = Client(gw.port("mqtt"), "offline").connect(clean=False)
        assert sub.session_present
        got = sub.expect(n, timeout=60)
        assert sorted(int(m.payload) for m in got) == list(range(n))
        sub.expect_none(0.5)
        assert "commitlog shorter" not in gw.log_text()
        sub.disconnect()
    finally:
        gw.stop()


def test_kill9_loses_nothing_acknowledged_and_data_dir_rebuilds(
    tmp_path: Path, tansu: Tansu
) -> None:
    gw = start(tmp_path, tansu)
    port = gw.port("mqtt")
    sub = Client(port, "keeper").connect(clean=False)
    sub.subscribe("acked/#", qos=1)
    sub.disconnect()
    pub = Client(port, "writer").connect()
    n = 300
    for i in range(n):
        pub.publish(f"acked/{i % 3}", str(i).encode(), qos=1)  # each waits for its PUBACK
    gw.kill()
    pub.kill()
    # Every acknowledged message is on the cluster.
    recs = asyncio.run(consume_all(tansu.bootstrap, "acked", n))
    assert sorted(int(r.value) for r in recs) == list(range(n))
    # The light queues are derived: without them, `lightgate rebuild-queues` rebuilds them from
    # the cluster, and `serve` on an empty data dir indexes the cluster before it is ready.
    env = {"LIGHTGATE_LOG": "kafka", "LIGHTGATE_KAFKA_BOOTSTRAP": tansu.bootstrap,
           "LIGHTGATE_KAFKA_CLIENT_ENABLE_IDEMPOTENCE": "false"}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "lightgate", "rebuild-queues", "--data-dir", str(tmp_path / "data")],
        cwd=ROOT, env={**__import__("os").environ, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"{n} records" in out.stderr
    shutil.rmtree(tmp_path / "data")
    gw2 = start(tmp_path, tansu)
    try:
        assert "indexed" in gw2.log_text() and "from the cluster" in gw2.log_text()
        sub = Client(gw2.port("mqtt"), "late").connect()
        sub.subscribe("acked/#", qos=1)
        pub = Client(gw2.port("mqtt"), "writer2").connect()
        pub.publish("acked/x", b"after", qos=1)
        assert sub.expect(1)[0].payload == b"after"
        pub.disconnect()
        sub.disconnect()
    finally:
        gw2.stop()


def test_unreachable_cluster_exits_nonzero_without_ready_line(tmp_path: Path) -> None:
    dead = free_port()
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--mqtt-port", "0", "--http-port", "-1", "--set", "log=kafka",
         "--set", f"kafka_bootstrap=127.0.0.1:{dead}", "--set", "kafka_connect_timeout_s=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode != 0
    assert "ready" not in out.stdout
    assert "retrying" in out.stderr and "cannot reach the Kafka cluster" in out.stderr
    assert time.monotonic() - t0 < 30


async def test_reads_for_delivery_batch_by_partition(tmp_path: Path, tansu: Tansu) -> None:
    """10k records behind a light queue resolve with a handful of fetches, not one each; and
    the light queues, the dispatcher and the resolver are the local log's, unchanged."""
    from lightqueue import LightQueues
    from store import MqttMessage
    from store.cluster.kafka_log import KafkaLog, KafkaLogConfig

    cfg = KafkaLogConfig(tansu.bootstrap, topic_partitions=2, client={"enable_idempotence": False},
                         connect_timeout_s=10)  # fmt: skip
    kl = await KafkaLog.open(tmp_path / "d", cfg)
    lq = LightQueues.open(tmp_path / "d", kl)
    await lq.start()
    try:
        q = lq.acquire_filter("drain/#").queue
        n = 10_000
        res = [kl.append_mqtt([MqttMessage(f"drain/{i % 5}", b"x" * 100, 1, "c")
                               for i in range(j, j + 1000)]) for j in range(0, n, 1000)]  # fmt: skip
        await asyncio.gather(*(r.durable for r in res))
        deadline = time.monotonic() + 20
        while (lq.last_seq(q) or -1) < n - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert lq.last_seq(q) == n - 1
        kl.cache.__init__(kl.cache.max_bytes)  # as after a restart: nothing in memory
        fetches0 = kl.fetches
        got = 0
        seq = 0
        while seq < n:
            r = lq.read(q, seq, 500)
            await lq.prefetch(r.entries)
            msgs = lq.resolve(r.entries)
            assert all(m is not None for m in msgs)
            got += len(msgs)
            seq = r.first_seq + len(r.entries)
        assert got == n
        assert kl.fetches - fetches0 <= 20, kl.fetches - fetches0
    finally:
        await lq.close()
        await kl.close()


def test_two_nodes_on_one_cluster_share_messages_and_retained(tmp_path: Path, tansu: Tansu) -> None:
    """Each node builds its light queues from the same topics: a message published on node A
    reaches a subscriber on node B, and B serves the retained message A received."""
    a = start(tmp_path, tansu, "a")
    b = start(tmp_path, tansu, "b")
    try:
        watch = Client(b.port("mqtt"), "watch").connect()
        watch.subscribe("hall/#", qos=1)
        pub = Client(a.port("mqtt"), "pa").connect()
        pub.publish("hall/door", b"open", qos=1, retain=True)
        assert watch.expect(1, timeout=15)[0].payload == b"open"  # B has indexed it
        sub = Client(b.port("mqtt"), "sb").connect()
        sub.subscribe("hall/#", qos=1)
        pub.publish("hall/light", b"on", qos=1)
        got = [(m.topic, m.payload, m.retain) for m in sub.expect(2, timeout=15)]
        assert got == [("hall/door", b"open", True), ("hall/light", b"on", False)]
        sub.expect_none(0.5)
        pub.disconnect()
        sub.disconnect()
        watch.disconnect()
    finally:
        a.stop()
        b.stop()


def test_replay_from_a_time_on_the_cluster(tmp_path: Path, tansu: Tansu) -> None:
    gw = start(tmp_path, tansu)
    try:
        replay_from_time(gw.port("mqtt"))
    finally:
        gw.stop()


def test_aborted_transactions_of_other_producers_do_not_reach_mqtt(
    tmp_path: Path, tansu: Tansu
) -> None:
    """A transactional Kafka producer (confluent-kafka) on the cluster: committed records reach
    MQTT subscribers, aborted ones never do, and records after an open transaction wait for
    its marker (read_committed, as the local log's transaction index does)."""
    from confluent_kafka import Producer

    gw = start(tmp_path, tansu)
    try:
        boot = {"bootstrap.servers": tansu.bootstrap, "log_level": 3}
        keeper = Client(gw.port("mqtt"), "txnkeeper").connect(clean=False)
        keeper.subscribe("txn/#", qos=1)
        keeper.disconnect()
        sub = Client(gw.port("mqtt"), "txnsub").connect()
        sub.subscribe("txn/#", qos=1)
        plain = Producer(boot)
        plain.produce("txn", b"p0", key=b"txn/a", partition=0)
        plain.flush(10)
        assert sub.expect(1, timeout=15)[0].payload == b"p0"  # the node has found the topic
        tx = Producer({**boot, "transactional.id": "lightgate-test-tx"})
        tx.init_transactions(10)

        def in_txn(values: list[bytes], commit: bool) -> None:
            tx.begin_transaction()
            for v in values:
                tx.produce("txn", v, key=b"txn/a", partition=0)
            tx.flush(10)
            (tx.commit_transaction if commit else tx.abort_transaction)(10)

        in_txn([b"c1"], True)
        in_txn([b"a1", b"a2"], False)
        plain.produce("txn", b"p1", key=b"txn/a", partition=0)
        plain.flush(10)
        in_txn([b"c2"], True)
        got = sorted(m.payload for m in sub.expect(3, timeout=15))
        assert got == [b"c1", b"c2", b"p1"]
        sub.expect_none(1.0)
        # An open transaction holds back what follows it until its marker.
        tx.begin_transaction()
        tx.produce("txn", b"o1", key=b"txn/a", partition=0)
        tx.flush(10)
        plain.produce("txn", b"p2", key=b"txn/a", partition=0)
        plain.flush(10)
        sub.expect_none(1.0)
        tx.commit_transaction(10)
        assert sorted(m.payload for m in sub.expect(2, timeout=15)) == [b"o1", b"p2"]
        in_txn([b"a3"], False)
        plain.produce("txn", b"p3", key=b"txn/a", partition=0)
        plain.flush(10)
        assert [m.payload for m in sub.expect(1, timeout=15)] == [b"p3"]
        sub.expect_none(0.5)
        sub.disconnect()
        tx = plain = None  # librdkafka closes its connections (else the broker's stop waits 5 s)
        # `rebuild-queues` (its reads run in a thread) and a replay from the log start skip
        # the aborted records too.
        gw.stop()
        env = {"LIGHTGATE_LOG": "kafka", "LIGHTGATE_KAFKA_BOOTSTRAP": tansu.bootstrap,
               "LIGHTGATE_KAFKA_CLIENT_ENABLE_IDEMPOTENCE": "false"}  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "lightgate", "rebuild-queues", "--data-dir",
             str(tmp_path / "data")],
            cwd=ROOT, env={**__import__("os").environ, **env}, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        gw = start(tmp_path, tansu)
        committed = sorted([b"p0", b"c1", b"p1", b"c2", b"o1", b"p2", b"p3"])
        keeper = Client(gw.port("mqtt"), "txnkeeper").connect(clean=False)
        assert sorted(m.payload for m in keeper.expect(7, timeout=15)) == committed
        keeper.expect_none(0.5)
        replay = Client(gw.port("mqtt"), "txnreplay").connect()
        replay.subscribe("$replay/0/txn/#", qos=1)
        assert sorted(m.payload for m in replay.expect(7, timeout=15)) == committed
        replay.expect_none(0.5)
    finally:
        gw.stop()


async def test_own_appends_reach_readers_without_fetching_them_back(
    tmp_path: Path, tansu: Tansu
) -> None:
    """A node's own acknowledged appends go to its batch cache as the cluster stores them, so
    the dispatcher indexes them with no Fetch: fetching every produce back cost the cluster a
    Fetch per produce and slowed its produce answers (QoS 1 through a node was bound by it)."""
    from lightqueue import LightQueues
    from store import MqttMessage
    from store.cluster.kafka_log import KafkaLog, KafkaLogConfig

    cfg = KafkaLogConfig(tansu.bootstrap, topic_partitions=2, client={"enable_idempotence": False},
                         connect_timeout_s=10)  # fmt: skip
    kl = await KafkaLog.open(tmp_path / "d", cfg)
    lq = LightQueues.open(tmp_path / "d", kl)
    await lq.start()
    try:
        q = lq.acquire_filter("own/#").queue
        n = 3000
        fetches0 = kl.fetches
        for j in range(0, n, 100):  # one produce after another, as QoS 1 ticks come
            res = kl.append_mqtt([MqttMessage(f"own/{i % 5}", f"m{i}".encode(), 1, "c")
                                  for i in range(j, j + 100)])  # fmt: skip
            await res.durable
        deadline = time.monotonic() + 20
        while (lq.last_seq(q) or -1) < n - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert lq.last_seq(q) == n - 1
        assert kl.fetches == fetches0, kl.fetches - fetches0  # was one per produce
        r = lq.read(q, 0, n)
        msgs = lq.resolve(r.entries)
        assert sorted(m.payload for m in msgs) == sorted(f"m{i}".encode() for i in range(n))
        # What the cache holds is what the cluster stores (but the leader epoch it stamps).
        for p in range(2):
            mine = _epochless(kl.cache.read("own", p, 0, 1 << 24) or b"")
            theirs = _epochless(await kl._fetch_one(("own", p), 0, keep=False))
            assert mine and mine == theirs[: len(mine)], p
    finally:
        await lq.close()
        await kl.close()


def _epochless(data: bytes) -> list[bytes]:
    """The batches of `data`, their partition leader epoch zeroed (the cluster sets it)."""
    from store.record_batch import BH_PARTITION_LEADER_EPOCH, HEADER, iter_batches

    out = []
    for pos, size in iter_batches(data):
        b = bytearray(data[pos : pos + size])
        h = list(HEADER.unpack_from(b, 0))
        h[BH_PARTITION_LEADER_EPOCH] = 0
        HEADER.pack_into(b, 0, *h)
        out.append(bytes(b))
    return out
