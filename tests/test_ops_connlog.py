"""Connection lifecycle log: one line per event naming the connection id, and under a connect
storm at most `conn_log_per_s` lines a second plus summaries that count the rest exactly."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Callable

from aiokafka import AIOKafkaProducer
from gateway_process import GatewayProcess
from mqtt_helpers import Client
from ops_helpers import wait_for

STORM = 150


def _connect_close(port: int, cid: str) -> None:
    body = b"\x00\x04MQTT" + bytes([4, 2, 0, 60]) + len(cid).to_bytes(2, "big") + cid.encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(bytes([0x10, len(body)]) + body)
        assert s.recv(4)[:1] == b"\x20"  # CONNACK
        s.sendall(b"\xe0\x00")  # DISCONNECT


async def _kafka_client(bootstrap: str) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    await producer.stop()


def test_kafka_connections_logged_with_an_id(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    gw = gateway_factory()
    asyncio.run(_kafka_client(f"127.0.0.1:{gw.port('kafka')}"))
    wait_for(lambda: "lightgate.kafka.conn: closed" in gw.log_text(), what="kafka closed line")
    text = gw.log_text()
    ids = re.findall(r"lightgate\.kafka\.conn: connected (k\d+) from 127\.0\.0\.1:\d+", text)
    assert ids, text
    for cid in ids:
        assert re.search(rf"lightgate\.kafka\.conn: closed {cid} ", text), (cid, text)


def test_lifecycle_lines_then_summaries_under_a_storm(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    gw = gateway_factory(None, "--set", "conn_log_per_s=5")
    port = gw.port("mqtt")
    Client(port, "lifecycle-1").connect().disconnect()
    wait_for(lambda: "closed" in gw.log_text(), what="closed line")
    text = gw.log_text()
    m = re.search(r"connected (c\d+) client 'lifecycle-1' from 127\.0\.0\.1:\d+ MQTT 3\.1\.1", text)
    assert m, text
    assert re.search(rf"closed {m.group(1)} client 'lifecycle-1': ", text), text

    time.sleep(1.1)  # a fresh window
    t0 = time.monotonic()
    for i in range(STORM):
        _connect_close(port, f"storm-{i:04d}")
    elapsed = time.monotonic() - t0

    def summarized() -> int:
        lines = gw.log_text().splitlines()
        one_by_one = sum(
            1 for ln in lines if re.search(r" (connected|closed) c\d+ client 'storm-", ln)
        )
        counted = sum(
            int(x) for x in re.findall(r"connection log: (\d+) more events", "\n".join(lines))
        )
        return one_by_one + counted == 2 * STORM and one_by_one

    one_by_one = wait_for(summarized, timeout=10, what="every storm event logged or counted")
    windows = int(elapsed) + 2
    assert one_by_one <= 5 * windows, (one_by_one, elapsed)
    assert "connection log:" in gw.log_text()
