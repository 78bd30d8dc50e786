"""The `lightgate` Spark source reading a Kafka cluster (`kafka.bootstrap.servers`): Tansu."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from tansu import Tansu

pytestmark = [pytest.mark.spark, pytest.mark.slow]


async def _write(t: Tansu, data_dir: Path) -> None:
    """MQTT messages through the cluster log, plus a plain Kafka record from another client."""
    from store import MqttMessage
    from store.cluster.kafka_log import KafkaLog, KafkaLogConfig

    cfg = KafkaLogConfig(t.bootstrap, topic_partitions=2, client={"enable_idempotence": False},
                         connect_timeout_s=10)  # fmt: skip
    kl = await KafkaLog.open(data_dir, cfg)
    try:
        res = kl.append_mqtt(
            [MqttMessage(f"sensors/dev{i % 3}/t", str(i).encode(), i % 3, f"dev{i % 3}")
             for i in range(30)]
        )  # fmt: skip
        await res.durable
    finally:
        await kl.close()
    p = AIOKafkaProducer(bootstrap_servers=t.bootstrap)
    await p.start()
    try:
        await p.send_and_wait("sensors", b"raw", key=b"k1", partition=0)
    finally:
        await p.stop()


def test_batch_read_from_the_cluster(spark, tansu: Tansu, tmp_path: Path) -> None:  # noqa: F811
    asyncio.run(_write(tansu, tmp_path / "d"))
    df = (
        spark.read.format("lightgate")
        .option("kafka.bootstrap.servers", tansu.bootstrap)
        .option("topics", "sensors")
        .load()
    )
    rows = df.collect()
    assert len(rows) == 31
    mqtt = sorted(
        (r.mqtt_topic, r.client_id, r.qos, int(r.value)) for r in rows if r.value != b"raw"
    )
    assert mqtt == sorted((f"sensors/dev{i % 3}/t", f"dev{i % 3}", i % 3, i) for i in range(30))
    (raw,) = [r for r in rows if r.value == b"raw"]
    assert (raw.topic, raw.partition, raw.key) == ("sensors", 0, b"k1")
    assert len({(r.partition, r.offset) for r in rows}) == 31
    # Streaming (AvailableNow) from the cluster: everything once, then only what is new.
    ckpt = tmp_path / "ckpt"

    def run() -> list[int]:
        seen: list[int] = []

        def collect(df, batch_id: int) -> None:  # noqa: ANN001
            seen.extend(r.offset for r in df.select("offset").collect())

        q = (
            spark.readStream.format("lightgate")
            .option("kafka.bootstrap.servers", tansu.bootstrap)
            .option("topics", "sensors")
            .option("startingOffsets", "earliest")
            .load()
            .writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(ckpt))
            .trigger(availableNow=True)
            .start()
        )
        q.awaitTermination(120)
        assert q.exception() is None
        return seen

    assert len(run()) == 31

    async def more() -> None:
        p = AIOKafkaProducer(bootstrap_servers=tansu.bootstrap)
        await p.start()
        try:
            for v in (b"n1", b"n2"):
                await p.send_and_wait("sensors", v, partition=1)
        finally:
            await p.stop()

    asyncio.run(more())
    assert len(run()) == 2


def test_committed_records_only_and_starting_timestamp(spark, tansu: Tansu) -> None:  # noqa: F811
    """read_committed: aborted Kafka transactions' records are not rows (as on the local log and
    the MQTT path); `startingTimestamp` starts each partition at its first record at/after it
    (Tansu answers ListOffsets by time with 0, so the source scans batch timestamps)."""
    import time

    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    boot = {"bootstrap.servers": tansu.bootstrap, "log_level": 3}
    admin = AdminClient(boot)
    admin.create_topics([NewTopic("tx", 1, 1)])["tx"].result(10)
    plain = Producer(boot)
    for v in (b"old1", b"old2"):
        plain.produce("tx", v, partition=0)
    plain.flush(10)
    time.sleep(0.05)
    t_ms = int(time.time() * 1000)
    time.sleep(0.05)
    tx = Producer({**boot, "transactional.id": "lightgate-spark-tx"})
    tx.init_transactions(10)

    def in_txn(values: list[bytes], commit: bool) -> None:
        tx.begin_transaction()
        for v in values:
            tx.produce("tx", v, partition=0)
        tx.flush(10)
        (tx.commit_transaction if commit else tx.abort_transaction)(10)

    in_txn([b"c1"], True)
    in_txn([b"a1", b"a2"], False)
    plain.produce("tx", b"p1", partition=0)
    plain.flush(10)
    in_txn([b"c2"], True)
    # An open transaction: a read stops before it (its last stable offset), as on the local log.
    tx.begin_transaction()
    tx.produce("tx", b"o1", partition=0)
    tx.flush(10)
    plain.produce("tx", b"p2", partition=0)
    plain.flush(10)

    def read(**opts: str) -> list[bytes]:
        r = spark.read.format("lightgate").option("kafka.bootstrap.servers", tansu.bootstrap)
        for k, v in {"topics": "tx", **opts}.items():
            r = r.option(k, v)
        return [row.value for row in r.load().orderBy("offset").collect()]

    assert read() == [b"old1", b"old2", b"c1", b"p1", b"c2"]
    assert read(startingTimestamp=str(t_ms)) == [b"c1", b"p1", b"c2"]
    tx.commit_transaction(10)
    tx = plain = admin = None  # librdkafka closes its connections
    assert read(startingTimestamp=str(t_ms)) == [b"c1", b"p1", b"c2", b"o1", b"p2"]
    # Streaming (AvailableNow) from startingTimestamp.
    seen: list[bytes] = []
    q = (
        spark.readStream.format("lightgate")
        .option("kafka.bootstrap.servers", tansu.bootstrap)
        .option("topics", "tx")
        .option("startingTimestamp", str(t_ms))
        .load()
        .writeStream.foreachBatch(lambda df, _i: seen.extend(r.value for r in df.collect()))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(seen) == sorted([b"c1", b"p1", b"c2", b"o1", b"p2"])
