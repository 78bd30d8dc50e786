"""/metrics on prometheus_client: the figures move as real clients (paho, aiokafka) connect,
publish, subscribe and consume, histogram counts equal the messages sent, and the split shape
(MQTT proxy in its own process) exports the same names. Probes are off here (their messages
would count too); tests/test_ops_probe.py covers them."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from gateway_process import GatewayProcess
from mqtt_helpers import V5, V311, Client
from ops_helpers import get, sample, scrape, stats, total, wait_for

N_MQTT = 40
N_KAFKA = 15


def _raw(port: int, request: bytes) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        return int(s.recv(64).split(b" ")[1])


async def _kafka_roundtrip(bootstrap: str) -> int:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks=1)
    await producer.start()
    try:
        for i in range(N_KAFKA):
            await producer.send_and_wait("kt", f"k{i}".encode(), key=b"x")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        "kt", bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id="ops"
    )
    await consumer.start()
    got = 0
    try:
        while got < N_KAFKA:
            batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 20)
            got += sum(len(v) for v in batch.values())
    finally:
        await consumer.stop()
    return got


def test_metrics_move_with_real_clients(gateway_factory: Callable[..., GatewayProcess]) -> None:
    gw = gateway_factory(None, "--set", "probe_interval_ms=0")
    http = gw.port("http")
    before = scrape(http)
    assert total(before, "lightgate_puback_latency_seconds_count") == 0
    sub = Client(gw.port("mqtt"), "ops-sub", version=V5).connect()
    sub.subscribe("plant/#", qos=1)
    pub = Client(gw.port("mqtt"), "ops-pub", version=V311).connect()
    for i in range(N_MQTT):
        pub.publish(f"plant/m{i % 4}", f"v{i}", qos=1)
    assert len(sub.expect(N_MQTT)) == N_MQTT
    assert asyncio.run(_kafka_roundtrip(f"127.0.0.1:{gw.port('kafka')}")) == N_KAFKA

    def delivered() -> bool:
        m = scrape(http)
        return total(m, "lightgate_publish_deliver_latency_seconds_count") >= N_MQTT

    wait_for(delivered, what="delivery histogram")
    m = scrape(http)
    # Histogram counts equal the messages sent.
    assert total(m, "lightgate_puback_latency_seconds_count") == N_MQTT
    assert total(m, "lightgate_publish_deliver_latency_seconds_count") == N_MQTT
    assert sample(m, "lightgate_kafka_produce_latency_seconds_count") == N_KAFKA
    assert total(m, "lightgate_puback_latency_seconds_bucket", le="+Inf") == N_MQTT
    assert sample(m, "lightgate_fsync_latency_seconds_count") > 0
    assert sample(m, "lightgate_dispatch_batch_latency_seconds_count") > 0
    # The gateway's own garbage collections are timed (it collected while starting at least).
    assert sample(m, "lightgate_gc_pause_seconds_count") > 0
    # Counters by protocol, connections by protocol and version, sessions, subscriptions.
    assert total(m, "lightgate_messages_total", protocol="mqtt", direction="in") == N_MQTT
    assert total(m, "lightgate_messages_total", protocol="mqtt", direction="out") == N_MQTT
    assert total(m, "lightgate_messages_total", protocol="kafka", direction="in") == N_KAFKA
    assert total(m, "lightgate_messages_total", protocol="kafka", direction="out") >= N_KAFKA
    assert total(m, "lightgate_bytes_total", protocol="kafka", direction="in") > 0
    assert total(m, "lightgate_connections", protocol="mqtt", version="5") == 1
    assert total(m, "lightgate_connections", protocol="mqtt", version="3.1.1") == 1
    assert total(m, "lightgate_sessions", state="live") == 2
    assert total(m, "lightgate_subscriptions") == 1
    assert sample(m, "lightgate_wildcard_queues") == 1
    assert sample(m, "lightgate_kafka_responses_total", api="Produce", error_code="0") == N_KAFKA
    assert sample(m, "lightgate_kafka_consumer_groups") == 1
    assert sample(m, "lightgate_topic_disk_bytes", topic="plant") > 0
    assert sample(m, "lightgate_topic_records", topic="kt") == N_KAFKA
    assert sample(m, "lightgate_dispatch_lag_records", topic="plant") == 0
    assert sample(m, "lightgate_notify_events_total") > 0
    assert total(m, "lightgate_mqtt_cache_lookups_total", result="hit") > 0
    assert sample(m, "lightgate_up") == 1
    assert total(m, "lightgate_mqtt_connects_total") == 2
    # /api/stats reads the same snapshot as JSON.
    s = stats(http)
    assert s["messages_in"] == {"mqtt": N_MQTT, "kafka": N_KAFKA}
    assert s["latency"]["puback"]["count"] == N_MQTT
    assert s["latency"]["puback"]["p99"] is not None
    assert s["connections"]["mqtt"] == {"5": 1, "3.1.1": 1}
    # Unknown paths, other methods and oversized or too many headers are refused.
    assert get(http, "/nope")[0] == 404
    assert _raw(http, b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n") == 405
    assert _raw(http, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n") == 400
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(40))
    assert _raw(http, b"GET /health HTTP/1.1\r\n" + many + b"\r\n") == 400
    assert _raw(http, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") == 200
    sub.disconnect()
    pub.disconnect()
    wait_for(
        lambda: total(scrape(http), "lightgate_connections", protocol="mqtt", version="5") == 0
    )


def test_split_shape_exports_the_same_names(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gw = gateway_factory(
        tmp_path / "split", "--set", "mqtt_processes=1", "--set", "probe_interval_ms=0"
    )
    http = gw.port("http")
    sub = Client(gw.port("mqtt"), "s-sub").connect()
    sub.subscribe("line/+", qos=1)
    pub = Client(gw.port("mqtt"), "s-pub", version=V5).connect()
    for i in range(N_MQTT):
        pub.publish("line/a", f"{i}", qos=1)
    assert len(sub.expect(N_MQTT)) == N_MQTT
    wait_for(
        lambda: total(scrape(http), "lightgate_publish_deliver_latency_seconds_count") >= N_MQTT,
        what="delivery histogram over the core link",
    )
    m = scrape(http)
    assert total(m, "lightgate_puback_latency_seconds_count") == N_MQTT
    assert total(m, "lightgate_publish_deliver_latency_seconds_count") == N_MQTT
    assert total(m, "lightgate_messages_total", protocol="mqtt", direction="in") == N_MQTT
    assert total(m, "lightgate_connections", protocol="mqtt", version="5") == 1
    assert total(m, "lightgate_connections", protocol="mqtt", version="3.1.1") == 1
    assert total(m, "lightgate_subscriptions") == 1
    assert sample(m, "lightgate_wildcard_queues") == 1
    assert sample(m, "lightgate_fsync_latency_seconds_count") > 0
    assert sample(m, "lightgate_topic_disk_bytes", topic="line") > 0
    sub.disconnect()
    pub.disconnect()
