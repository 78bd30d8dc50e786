"""`kafka_max_connections`: Kafka connections counted by a limit, as Kafka's `max.connections`.

Kafka has no "server busy" answer: a connection over the limit is closed at once, and the
client retries after its reconnect backoff. Real clients (kafka-python, aiokafka) against a
`lightgate serve`: while raw sockets hold every slot, kafka-python cannot bootstrap; once one
slot frees, aiokafka produces and reads back.
"""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Callable

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from gateway_process import GatewayProcess
from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

Factory = Callable[..., GatewayProcess]
LIMIT = 3


def _refused_total(gw: GatewayProcess) -> int:
    url = f"http://127.0.0.1:{gw.port('http')}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("lightgate_kafka_connections_refused_total"):
                return int(float(line.split()[-1]))
    raise AssertionError("no lightgate_kafka_connections_refused_total in /metrics")


def test_connections_over_the_limit_are_closed(gateway_factory: Factory) -> None:
    gw = gateway_factory(None, "--set", f"kafka_max_connections={LIMIT}")
    port = gw.port("kafka")
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMIT)]
    try:
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(5)
        assert extra.recv(1) == b"", "the connection over the limit stays open"
        extra.close()
        with pytest.raises(KafkaTimeoutError, match="Unable to bootstrap"):
            KafkaProducer(bootstrap_servers=f"127.0.0.1:{port}", bootstrap_timeout_ms=3000)
        assert _refused_total(gw) >= 2
        for s in held[1:]:
            s.close()  # room for aiokafka (a bootstrap connection, then one to the node)
        held = held[:1]
        asyncio.run(_produce_and_read(port))
    finally:
        for s in held:
            s.close()
    assert "kafka_max_connections (3)" in gw.log_text()


async def _produce_and_read(port: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=f"127.0.0.1:{port}")
    await producer.start()
    try:
        await producer.send_and_wait("limited", b"v", key=b"k")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        "limited", bootstrap_servers=f"127.0.0.1:{port}", auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 20)
        assert msg.value == b"v"
    finally:
        await consumer.stop()
