"""Kafka admin APIs with stock admin clients: kafka-python's KafkaAdminClient, confluent-kafka's
AdminClient (librdkafka), aiokafka's AIOKafkaAdminClient and kcat, against a running gateway."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kafka
import pytest
from kafka.admin import (
    ConfigResource,
    ConfigResourceType,
    KafkaAdminClient,
    NewPartitions,
    NewTopic,
    OffsetSpec,
)
from kafka.structs import TopicPartition
from kafka_helpers import make_batch, running_gateway

pytestmark = pytest.mark.timeout(120)


def _produce(bootstrap: str, topic: str, n: int, timestamps: list[int] | None = None) -> None:
    p = kafka.KafkaProducer(bootstrap_servers=bootstrap)
    for i in range(n):
        ts = timestamps[i] if timestamps else None
        p.send(topic, f"m{i}".encode(), partition=0, timestamp_ms=ts)
    p.flush()
    p.close()


def _kafka_python_admin(bootstrap: str) -> dict[str, Any]:
    """Every admin call kafka-python makes, in one client session (run in a thread)."""
    out: dict[str, Any] = {}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    try:
        admin.create_topics([NewTopic("kp-admin", 1, 1), NewTopic("kp-gone", 2, 1)])
        _produce(bootstrap, "kp-admin", 30, [1000 + (i * 7) % 30 for i in range(30)])
        admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, "kp-admin", {"retention.ms": "3600000"})]
        )
        out["configs"] = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, "kp-admin")], config_filter="all"
        )
        out["modified"] = admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, "kp-admin")]
        )
        admin.create_partitions({"kp-admin": NewPartitions(3)})
        out["deleted_records"] = admin.delete_records({TopicPartition("kp-admin", 0): 10})
        out["offsets"] = admin.list_partition_offsets(
            {TopicPartition("kp-admin", 0): OffsetSpec.MAX_TIMESTAMP}
        )
        out["earliest"] = admin.list_partition_offsets(
            {TopicPartition("kp-admin", 0): OffsetSpec.EARLIEST}
        )
        out["cluster"] = admin.describe_cluster()
        out["log_dirs"] = admin.describe_log_dirs()
        admin.delete_topics(["kp-gone"])
        out["topics"] = admin.list_topics()
    finally:
        admin.close()
    return out


async def test_kafka_python_admin_client(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        out = await asyncio.get_running_loop().run_in_executor(
            None, _kafka_python_admin, gw.bootstrap
        )
        topic_cfg = out["configs"]["topic"]["kp-admin"]
        assert topic_cfg["retention.ms"]["value"] == "3600000"
        assert topic_cfg["segment.bytes"]["value"] == str(gw.store.config.segment_bytes)
        assert list(out["modified"]["topic"]["kp-admin"]) == ["retention.ms"]  # the dynamic one
        assert gw.store.topic_overrides("kp-admin") == {"retention_ms": 3_600_000}
        assert gw.store.partitions("kp-admin") == 3
        assert gw.store.log_start_offset("kp-admin", 0) == 10
        (lw,) = out["deleted_records"].values()
        assert lw["low_watermark"] == 10
        (max_ts,) = out["offsets"].values()
        assert (max_ts.offset, max_ts.timestamp) == (17, 1029)  # 17 * 7 % 30 == 29
        (earliest,) = out["earliest"].values()
        assert earliest.offset == 10
        assert out["cluster"]["cluster_id"] == gw.server.broker.config.cluster_id
        assert "kp-gone" not in out["topics"] and "kp-admin" in out["topics"]
        assert "kp-gone" not in gw.store.topics()
        assert out["log_dirs"]


def _confluent_admin(bootstrap: str) -> dict[str, Any]:
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka import TopicPartition as CTP
    from confluent_kafka.admin import (
        AdminClient,
        AlterConfigOpType,
        ConfigEntry,
        ResourceType,
    )
    from confluent_kafka.admin import (
        ConfigResource as CR,
    )
    from confluent_kafka.admin import (
        NewPartitions as CNP,
    )
    from confluent_kafka.admin import (
        NewTopic as CNT,
    )

    out: dict[str, Any] = {}
    a = AdminClient({"bootstrap.servers": bootstrap})
    for f in a.create_topics([CNT("ck", 2, 1), CNT("ck-del", 1, 1)]).values():
        f.result(10)
    res = CR(ResourceType.TOPIC, "ck", incremental_configs=[
        ConfigEntry("retention.bytes", "1048576", incremental_operation=AlterConfigOpType.SET),
        ConfigEntry("lightgate.fsync.policy", "interval_ms",
                    incremental_operation=AlterConfigOpType.SET),
    ])  # fmt: skip
    for f in a.incremental_alter_configs([res]).values():
        f.result(10)
    bad = CR(ResourceType.TOPIC, "ck", incremental_configs=[
        ConfigEntry("no.such.config", "1", incremental_operation=AlterConfigOpType.SET)])  # fmt: skip
    try:
        for f in a.incremental_alter_configs([bad]).values():
            f.result(10)
        out["bad"] = None
    except Exception as exc:  # KafkaException(INVALID_CONFIG)
        out["bad"] = str(exc)
    (f,) = a.describe_configs([CR(ResourceType.TOPIC, "ck")]).values()
    out["described"] = {k: (v.value, v.source) for k, v in f.result(10).items()}
    for f in a.create_partitions([CNP("ck", 4)]).values():
        f.result(10)
    out["cluster"] = a.describe_cluster().result(10)
    for f in a.delete_topics(["ck-del"]).values():
        f.result(10)
    out["topics"] = set(a.list_topics(timeout=10).topics)
    # A group that committed offsets, then OffsetDelete and DeleteGroups.
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "cg", "enable.auto.commit": False})
    c.commit(offsets=[CTP("ck", 0, 1), CTP("ck", 1, 1)], asynchronous=False)
    c.close()
    fut = a.delete_consumer_groups(["cg"])["cg"]
    fut.result(10)
    try:
        a.delete_consumer_groups(["cg"])["cg"].result(10)
        out["again"] = None
    except Exception as exc:  # GROUP_ID_NOT_FOUND
        out["again"] = str(exc)
    del ConsumerGroupTopicPartitions
    return out


async def test_confluent_kafka_admin_client(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        out = await asyncio.get_running_loop().run_in_executor(None, _confluent_admin, gw.bootstrap)
        from confluent_kafka.admin import ConfigSource

        d = out["described"]
        assert d["retention.bytes"] == ("1048576", ConfigSource.DYNAMIC_TOPIC_CONFIG.value)
        assert d["lightgate.fsync.policy"] == (
            "interval_ms",
            ConfigSource.DYNAMIC_TOPIC_CONFIG.value,
        )
        assert d["retention.ms"][1] == ConfigSource.DEFAULT_CONFIG.value
        assert gw.store.topic_config("ck").fsync == "interval_ms"
        assert out["bad"] is not None and "INVALID_CONFIG" in out["bad"].upper().replace(" ", "_")
        assert gw.store.partitions("ck") == 4
        assert "ck-del" not in out["topics"] and "ck" in out["topics"]
        assert "cg" not in gw.server.broker.offsets.groups()
        assert out["again"] is not None and "GROUP_ID_NOT_FOUND" in out["again"].upper()
        assert len(out["cluster"].nodes) == 1


async def test_aiokafka_admin_client(tmp_path: Path) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
    from aiokafka.admin import NewPartitions as ANP
    from aiokafka.admin import NewTopic as ANT
    from aiokafka.admin.config_resource import ConfigResource as AR
    from aiokafka.admin.config_resource import ConfigResourceType as ART
    from aiokafka.structs import TopicPartition as ATP

    async with running_gateway(tmp_path / "data") as gw:
        a = AIOKafkaAdminClient(bootstrap_servers=gw.bootstrap)
        await a.start()
        try:
            await a.create_topics([ANT("ak", 1, 1), ANT("ak-del", 1, 1)])
            await a.alter_configs([AR(ART.TOPIC, "ak", {"segment.bytes": "1048576"})])
            (desc,) = await a.describe_configs([AR(ART.TOPIC, "ak")])
            await a.create_partitions({"ak": ANP(2)})
            await gw.store.append_batch("ak", 0, make_batch([b"x"] * 5)).durable
            low = await a.delete_records({ATP("ak", 0): RecordsToDelete(3)})
            await a.delete_topics(["ak-del"])
        finally:
            await a.close()
        assert gw.store.topic_config("ak").segment_bytes == 1 << 20
        entries = {c[0]: c[1] for c in desc.resources[0][4]}
        assert entries["segment.bytes"] == "1048576"
        assert gw.store.partitions("ak") == 2 and "ak-del" not in gw.store.topics()
        assert low == {ATP("ak", 0): 3} and gw.store.log_start_offset("ak", 0) == 3


@pytest.mark.skipif(not shutil.which("kcat"), reason="kcat not installed")
async def test_deleted_topic_is_recreated_empty_for_kcat(tmp_path: Path) -> None:
    """After DeleteTopics a producer re-creates the topic on first use (auto-create), from
    offset 0 and without the old records."""
    async with running_gateway(tmp_path / "data") as gw:
        gw.store.create_topic("kc", 1)
        await gw.store.append_batch("kc", 0, make_batch([b"old1", b"old2"])).durable
        old_id = gw.server.broker.topic_id("kc")
        await gw.store.delete_topic("kc")

        def kcat(*args: str, stdin: str | None = None) -> str:
            return subprocess.run(
                ["kcat", "-b", gw.bootstrap, *args],
                input=stdin, capture_output=True, text=True, timeout=30, check=True,
            ).stdout  # fmt: skip

        run = asyncio.get_running_loop().run_in_executor
        await run(None, lambda: kcat("-P", "-t", "kc", stdin="new\n"))
        got = await run(
            None, lambda: kcat("-C", "-t", "kc", "-o", "beginning", "-e", "-q", "-f", "%o %s\n")
        )
        assert got.split("\n")[:1] == ["0 new"] and "old" not in got
        assert gw.server.broker.topic_id("kc") != old_id  # a new topic, a new id


def test_mqtt_subscribers_across_a_topic_delete(broker):
    """docs/kafka.md "Deleting a topic": MQTT subscribers keep their subscriptions; the old
    messages and the retained ones that lived in the topic are gone; the next publish re-creates
    the log topic and reaches them (both shapes: the proxy process learns of the delete)."""
    from mqtt_helpers import Client

    pub = Client(broker.port, "pub").connect()
    sub = Client(broker.port, "sub").connect(clean=False)
    sub.subscribe("dt/#", 1)
    pub.publish("dt/a", b"before", 1, retain=True)
    assert [m.payload for m in sub.expect(1)] == [b"before"]
    kafka_port = broker.gw.port("kafka")
    admin = KafkaAdminClient(bootstrap_servers=f"127.0.0.1:{kafka_port}")
    try:
        admin.delete_topics(["dt"])
    finally:
        admin.close()
    pub.publish("dt/b", b"after", 1)
    assert [m.payload for m in sub.expect(1, timeout=15)] == [b"after"]
    late = Client(broker.port, "late").connect()
    late.subscribe("dt/#", 1)
    late.expect_none(0.5)  # the retained message lived in the deleted topic
    replay = Client(broker.port, "replay").connect()
    replay.subscribe("$replay/-1h/dt/#", 1)
    assert [m.payload for m in replay.expect(1)] == [b"after"]
    replay.expect_none(0.5)
