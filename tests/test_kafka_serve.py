"""Kafka clients against a real `lightgate serve` process: graceful restart and kill -9."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from gateway_process import GatewayProcess

pytestmark = pytest.mark.timeout(180)


async def produce(bootstrap: str, topic: str, values: list[bytes]) -> list[int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        futs = [await producer.send(topic, v, partition=0) for v in values]
        return [(await f).offset for f in futs]
    finally:
        await producer.stop()


async def consume_group(bootstrap: str, topic: str, n: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id="svc", auto_offset_reset="earliest",
        enable_auto_commit=False,
    )  # fmt: skip
    await consumer.start()
    out: list[bytes] = []
    try:
        deadline = time.monotonic() + 30
        while len(out) < n and time.monotonic() < deadline:
            for msgs in (await consumer.getmany(timeout_ms=200)).values():
                out += [m.value for m in msgs]
        await consumer.commit()
    finally:
        await consumer.stop()
    return out


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_serve_restart_keeps_acked_data_offsets_and_producer_ids(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path, stop: str
) -> None:
    data = tmp_path / "data"
    gw = gateway_factory(data)
    bootstrap = f"127.0.0.1:{gw.port('kafka')}"
    offsets = await produce(bootstrap, "cmds", [f"c{i}".encode() for i in range(50)])
    assert offsets == list(range(50))
    assert len(await consume_group(bootstrap, "cmds", 50)) == 50
    if stop == "sigterm":
        assert gw.stop() == 0
    else:
        gw.kill()  # acks=all under fsync "always": everything acknowledged is on disk

    gw2 = gateway_factory(data)
    bootstrap = f"127.0.0.1:{gw2.port('kafka')}"
    assert await produce(bootstrap, "cmds", [b"after"]) == [50]
    assert await consume_group(bootstrap, "cmds", 1) == [b"after"]  # resumed at the commit
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        tp = TopicPartition("cmds", 0)
        assert await consumer.end_offsets([tp]) == {tp: 51}
    finally:
        await consumer.stop()
    assert (data / "kafka" / "producers.json").exists()
