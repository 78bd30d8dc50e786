"""Many retained messages to one wildcard subscriber, fed as the client takes them.

A real gateway (one process, and the core with a proxy process, where retained pages cross the
core link) holds a few thousand retained topics. A v5 subscriber announcing Receive Maximum 20
must never have more than 20 unacknowledged QoS 1 PUBLISHes (MQTT 5 §4.9) and must still get
every retained message once it acks; a QoS 0 subscriber gets them all at once; the queue's new
messages come after the retained ones.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import V311, Client, raw, split_packets
from mqtt_raw import connect_packet, packet, s16

N = 3000
WINDOW = 20


@pytest.fixture(params=["one-process", "proxy-process"])
def gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[GatewayProcess]:
    args = ["--set", "mqtt_processes=1"] if request.param == "proxy-process" else []
    gw = GatewayProcess(tmp_path / "data", args).start()
    try:
        yield gw
    finally:
        gw.stop()


def _retain_many(port: int, n: int) -> None:
    """`n` retained QoS 1 messages on their own topics, pipelined; returns once all are acked."""
    s = raw(port)
    s.sendall(connect_packet(b"feeder"))
    out = []
    for i in range(n):
        pid = i % 65535 + 1
        body = s16(f"fleet/d{i:05d}/state".encode()) + pid.to_bytes(2, "big") + f"v{i}".encode()
        out.append(packet(0x33, body))  # PUBLISH, QoS 1, retain
    out.append(packet(0x33, s16(b"fleet/last") + b"\xff\xff" + b"x"))
    s.sendall(b"".join(out))
    acks, buf = 0, b""
    deadline = time.monotonic() + 60
    while acks < n + 1:
        pkts, buf = _read_for(s, max(0.1, deadline - time.monotonic()), buf, until=n + 2 - acks)
        assert pkts, f"{acks} of {n + 1} PUBACKs"
        acks += sum(1 for p in pkts if p[0] >> 4 == 4)
    s.close()


def _v5_subscriber(port: int, filt: str, receive_maximum: int) -> socket.socket:
    s = raw(port)
    props = b"\x21" + receive_maximum.to_bytes(2, "big")  # Receive Maximum
    body = s16(b"MQTT") + bytes([5, 0x02]) + (60).to_bytes(2, "big")
    body += bytes([len(props)]) + props + s16(b"feed-reader")
    s.sendall(packet(0x10, body))
    sub = (1).to_bytes(2, "big") + b"\x00" + s16(filt.encode()) + b"\x01"
    s.sendall(packet(0x82, sub))
    return s


def _parse_publish(p: bytes) -> tuple[str, int, bool]:
    """(topic, packet id, retain) of a v5 QoS 1 PUBLISH."""
    i = 1
    while p[i] & 0x80:
        i += 1
    i += 1
    tl = int.from_bytes(p[i : i + 2], "big")
    topic = p[i + 2 : i + 2 + tl].decode()
    pid = int.from_bytes(p[i + 2 + tl : i + 4 + tl], "big")
    return topic, pid, bool(p[0] & 0x01)


def _read_for(
    s: socket.socket, seconds: float, buf: bytes, until: int = 0
) -> tuple[list[bytes], bytes]:
    """Packets read for `seconds` (or until `until` packets came)."""
    out: list[bytes] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0 and not (until and len(out) >= until):
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        assert chunk, "the gateway closed the connection"
        pkts, buf = split_packets(buf + chunk)
        out += pkts
    return out, buf


def test_retained_feed_keeps_receive_maximum_and_sends_all(gateway: GatewayProcess) -> None:
    port = gateway.port("mqtt")
    _retain_many(port, N)
    s = _v5_subscriber(port, "fleet/#", WINDOW)
    got: dict[str, int] = {}
    unacked: set[int] = set()
    buf = b""
    # Acking nothing: the gateway sends exactly a window's worth and waits.
    pkts, buf = _read_for(s, 1.5, buf)
    publishes = [p for p in pkts if p[0] >> 4 == 3]
    assert [p[0] >> 4 for p in pkts if p[0] >> 4 != 3] == [2, 9]  # CONNACK, SUBACK
    assert len(publishes) == WINDOW, len(publishes)
    deadline = time.monotonic() + 60
    while len(got) < N + 1:
        assert time.monotonic() < deadline, f"{len(got)} of {N + 1} retained messages"
        for p in publishes:
            topic, pid, retain = _parse_publish(p)
            assert retain and pid not in unacked
            unacked.add(pid)
            got[topic] = got.get(topic, 0) + 1
        assert len(unacked) <= WINDOW, len(unacked)
        s.sendall(b"".join(packet(0x40, pid.to_bytes(2, "big")) for pid in unacked))
        unacked.clear()
        pkts, buf = _read_for(s, 2.0, buf, until=min(WINDOW, N + 1 - len(got)))
        publishes = [p for p in pkts if p[0] >> 4 == 3]
    assert len(got) == N + 1 and set(got.values()) == {1}
    # The queue is released after the feed: a new message on a retained topic arrives, once.
    pub = Client(port, "late", V311)
    pub.connect()
    pub.publish("fleet/d00007/state", b"new", 1)
    pkts, buf = _read_for(s, 1.0, buf)
    news = [_parse_publish(p) for p in pkts if p[0] >> 4 == 3]
    assert [(t, r) for t, _, r in news] == [("fleet/d00007/state", False)]
    pub.disconnect()
    s.close()


def test_retained_feed_qos0_gets_everything(gateway: GatewayProcess) -> None:
    port = gateway.port("mqtt")
    _retain_many(port, N)
    sub = Client(port, "feed-q0", V311)
    sub.connect()
    sub.subscribe("fleet/+/state", 0)
    got = {m.topic for m in sub.expect(N, timeout=60)}
    assert len(got) == N
    sub.expect_none(0.3)
    sub.disconnect()
