"""Checks shared by the `log = "kafka"` tests, one process (test_kafka_log.py) and the MQTT proxy
in its own process (test_kafka_log_proxies.py), against a real Tansu cluster (tansu.py)."""

from __future__ import annotations

import time
from typing import Any

from aiokafka import AIOKafkaConsumer
from mqtt_helpers import Client


async def consume_all(bootstrap: str, topic: str, n: int) -> list[Any]:
    """Read `n` records of `topic` from the cluster (all partitions, from the start)."""
    c = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                         group_id=None)  # fmt: skip
    await c.start()
    try:
        out: list[Any] = []
        deadline = time.monotonic() + 20
        while len(out) < n and time.monotonic() < deadline:
            for recs in (await c.getmany(timeout_ms=200)).values():
                out.extend(recs)
        return out
    finally:
        await c.stop()


def replay_from_time(port: int) -> None:
    """Records before and after a time T on the cluster: `$replay/T/...` gets only the later
    ones; a replay from after every record gets none of them (then live)."""
    pub = Client(port, "histpub").connect()
    for i in range(6):
        pub.publish(f"hist/{'ab'[i % 2]}", f"old{i}".encode(), qos=1)
    time.sleep(0.3)
    t = int(time.time() * 1000)
    time.sleep(0.3)
    for i in range(6):
        pub.publish(f"hist/{'ab'[i % 2]}", f"new{i}".encode(), qos=1)
    time.sleep(0.3)
    t_end = int(time.time() * 1000)
    time.sleep(0.3)
    sub = Client(port, "replayer").connect()
    sub.subscribe(f"$replay/{t}/hist/#", qos=1)
    got = sorted(m.payload for m in sub.expect(6, timeout=15))
    assert got == [f"new{i}".encode() for i in range(6)]
    sub.expect_none(0.5)
    late = Client(port, "late-replayer").connect()
    late.subscribe(f"$replay/{t_end}/hist/#", qos=1)
    late.expect_none(0.5)
    pub.publish("hist/a", b"live", qos=1)
    assert late.expect(1)[0].payload == b"live"
    for c in (pub, sub, late):
        c.disconnect()
