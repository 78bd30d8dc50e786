"""Kafka produce quota: over `kafka_produce_byte_rate` a connection's Produce
responses carry throttle_time_ms and the connection is not read for that long, as Kafka does.
librdkafka (confluent-kafka) reports the throttle through `throttle_cb` and slows down; every
record is still stored.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import confluent_kafka as ck
from gateway_process import GatewayProcess


def _produce(port: int, n: int, size: int) -> tuple[float, list[int]]:
    throttles: list[int] = []

    def on_throttle(ev: Any) -> None:
        throttles.append(int(ev.throttle_time * 1000))

    p = ck.Producer({
        "bootstrap.servers": f"127.0.0.1:{port}", "acks": "all", "linger.ms": 5,
        "batch.size": 64 * 1024, "throttle_cb": on_throttle,
    })  # fmt: skip
    value = b"q" * size
    t0 = time.monotonic()
    for _ in range(n):
        p.produce("quota-t", value)
        p.poll(0)
    assert p.flush(60) == 0
    elapsed = time.monotonic() - t0
    p.poll(0.5)  # deliver the last throttle callbacks
    return elapsed, throttles


def _count(port: int) -> int:
    c = ck.Consumer({
        "bootstrap.servers": f"127.0.0.1:{port}", "group.id": "quota-check",
        "auto.offset.reset": "earliest", "enable.auto.commit": False,
    })  # fmt: skip
    c.subscribe(["quota-t"])
    got, deadline = 0, time.monotonic() + 30
    while time.monotonic() < deadline:
        msgs = c.consume(500, 1.0)
        got += sum(1 for m in msgs if m.error() is None)
        if not msgs and got:
            break
    c.close()
    return got


def test_produce_quota_throttles(gateway_factory: Callable[..., GatewayProcess]) -> None:
    gw = gateway_factory(None, "--set", "kafka_produce_byte_rate=200000")
    port = gw.port("kafka")
    # 800 KB at 200 KB/s with a 200 KB burst: 3 s of sending (unthrottled: well under a second).
    # The last response's throttle is not waited for within `elapsed` (the broker mutes after
    # answering), and how much it carries depends on how librdkafka batched the tail; but the
    # bucket's accounting makes (time from the first charge to the last) + the last throttle
    # = (bytes - burst) / rate >= 3 s, and the largest throttle reported is >= the last one.
    elapsed, throttles = _produce(port, 800, 1000)
    assert throttles and max(throttles) > 0, throttles
    assert elapsed >= 1.0, elapsed
    assert elapsed + max(throttles) / 1000 >= 2.9, (elapsed, throttles)
    assert _count(port) == 800
