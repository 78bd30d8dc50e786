"""kafka-python 3.x (blocking client, run in a thread) against a running KafkaServer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import kafka
import pytest
from kafka.admin import KafkaAdminClient
from kafka_helpers import running_gateway

pytestmark = pytest.mark.timeout(120)


def _produce_default(bootstrap: str, n: int) -> tuple[dict, list[int]]:
    producer = kafka.KafkaProducer(bootstrap_servers=bootstrap)
    try:
        futures = [producer.send("kp", f"m{i}".encode(), key=b"key") for i in range(n)]
        producer.flush()
        return dict(producer.config), [f.get(10).offset for f in futures]
    finally:
        producer.close()


def _consume_group(bootstrap: str, group: str, n: int) -> list[bytes]:
    consumer = kafka.KafkaConsumer(
        "kp", bootstrap_servers=bootstrap, group_id=group, auto_offset_reset="earliest",
        enable_auto_commit=False, consumer_timeout_ms=10_000,
    )  # fmt: skip
    out: list[bytes] = []
    try:
        for msg in consumer:
            out.append(msg.value)
            if len(out) == n:
                break
        consumer.commit()
    finally:
        consumer.close()
    return out


async def test_default_producer_is_idempotent_acks_all_and_group_consumer(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data", partitions=3) as gw:
        run = asyncio.get_running_loop().run_in_executor
        config, offsets = await run(None, _produce_default, gw.bootstrap, 60)
        assert config["enable_idempotence"] is True and config["acks"] in (-1, "all")
        assert sum(gw.store.high_watermark("kp", p) for p in range(3)) == 60
        assert len(offsets) == 60 and min(offsets) >= 0  # every send acknowledged with an offset
        assert gw.server.broker.producers._partitions  # the batches carried a producer id

        got = await run(None, _consume_group, gw.bootstrap, "kgroup", 60)
        assert sorted(got) == sorted(f"m{i}".encode() for i in range(60))
        committed = {(t, p): c.offset for (t, p), c in
                     gw.server.broker.offsets.partitions("kgroup").items()}  # fmt: skip
        assert committed == {("kp", p): gw.store.high_watermark("kp", p) for p in range(3)}

        # a second run of the group starts where the first committed: nothing left to read
        await run(None, _produce_default, gw.bootstrap, 3)
        again = await run(None, _consume_group, gw.bootstrap, "kgroup", 3)
        assert sorted(again) == [b"m0", b"m1", b"m2"]


def _admin_roundtrip(bootstrap: str) -> tuple[list, dict]:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        return admin.list_groups(), admin.describe_groups(["kgroup"])
    finally:
        admin.close()


async def test_admin_lists_and_describes_groups(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        run = asyncio.get_running_loop().run_in_executor
        await run(None, _produce_default, gw.bootstrap, 2)
        await run(None, _consume_group, gw.bootstrap, "kgroup", 2)
        t0 = time.monotonic()
        groups, described = await run(None, _admin_roundtrip, gw.bootstrap)
        assert time.monotonic() - t0 < 20
        assert {"group_id": "kgroup", "protocol_type": "consumer", "group_state": "Empty"} in groups
        assert described["kgroup"]["group_state"] == "Empty"
        assert described["kgroup"]["protocol_type"] == "consumer"
