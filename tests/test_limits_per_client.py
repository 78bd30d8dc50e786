"""Publish limits per client hold, and the other clients do not pay for them.

`max_publish_rate` (messages/s) and `max_publish_bytes_rate` (payload bytes/s) against a real
`lightgate serve`: a raw-socket flooder writes as fast as TCP lets it while a well-behaved paho
client publishes QoS 1 at a steady pace; the flooder's delivered rate is measured at a
subscriber, and the well-behaved client's PUBACK latency (p99) must stay sane. A v5 client that
floods QoS 0 past what can wait is told with DISCONNECT 0x96 Message rate too high.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

from gateway_process import GatewayProcess
from mqtt_helpers import V5, V311, Client
from mqtt_raw import connect_packet, packet, read_until_packet, s16

Factory = Callable[..., GatewayProcess]
FLOOD_S = 4.0


def _qos0(topic: bytes, payload: bytes, v5: bool = False) -> bytes:
    return packet(0x30, s16(topic) + (b"\x00" if v5 else b"") + payload)


def _flood(port: int, payload_size: int, stop: threading.Event) -> None:
    """A 3.1.1 client writing QoS 0 PUBLISH as fast as its socket takes them."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(connect_packet(b"flooder", level=4))
        assert s.recv(4)[:2] == b"\x20\x02"
        chunk = b"".join(_qos0(b"flood/x", b"f" * payload_size) for _ in range(50))
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                s.send(chunk)  # blocks (times out) while the gateway is not reading us
            except TimeoutError:
                continue


def _measure(gw: GatewayProcess, payload_size: int) -> tuple[float, list[float]]:
    """(the flooder's delivered messages a second, the calm client's PUBACK latencies)."""
    port = gw.port("mqtt")
    sub = Client(port, "watcher", V311).connect()
    sub.subscribe("flood/#", 0)
    calm = Client(port, "calm", V5).connect()
    calm.publish("calm/x", b"warm", 1)
    stop = threading.Event()
    flooder = threading.Thread(target=_flood, args=(port, payload_size, stop), daemon=True)
    flooder.start()
    time.sleep(1.0)  # past the flooder's burst
    while not sub.messages.empty():
        sub.messages.get()
    t0 = time.monotonic()
    latencies: list[float] = []
    while time.monotonic() - t0 < FLOOD_S:
        t = time.monotonic()
        calm.publish("calm/x", b"c", 1)  # waits for the PUBACK
        latencies.append(time.monotonic() - t)
        time.sleep(0.01)
    received = sub.messages.qsize()
    elapsed = time.monotonic() - t0
    stop.set()
    flooder.join(5)
    calm.kill()
    sub.kill()
    return received / elapsed, sorted(latencies)


def _p99(xs: list[float]) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * 0.99))]


def test_message_rate_holds_and_others_keep_their_latency(gateway_factory: Factory) -> None:
    gw = gateway_factory(None, "--set", "max_publish_rate=200")
    rate, lat = _measure(gw, 16)
    p99 = _p99(lat)
    print(
        f"flooder {rate:.0f} msg/s (limit 200), calm p99 PUBACK {p99 * 1000:.1f} ms, n={len(lat)}"
    )
    assert 120 <= rate <= 260, rate  # the limit, not the flooder's pace (tens of thousands)
    assert p99 < 0.25, f"p99 {p99 * 1000:.0f} ms"
    assert len(lat) > 50


def test_byte_rate_holds_and_others_keep_their_latency(gateway_factory: Factory) -> None:
    gw = gateway_factory(None, "--set", "max_publish_bytes_rate=40000")
    rate, lat = _measure(gw, 1000)  # 1000-byte payloads: 40 messages a second
    p99 = _p99(lat)
    print(f"flooder {rate:.1f} msg/s of 1000 B (limit 40 000 B/s), calm p99 {p99 * 1000:.1f} ms")
    assert 25 <= rate <= 55, rate
    assert p99 < 0.25, f"p99 {p99 * 1000:.0f} ms"


def test_v5_qos0_flood_gets_disconnect_0x96(gateway_factory: Factory) -> None:
    """MQTT 5 allows 0x96 only in DISCONNECT (not in PUBACK/PUBREC): a v5 client whose QoS 0
    PUBLISH overflow what may wait (one second's worth) is disconnected with it."""
    gw = gateway_factory(None, "--set", "max_publish_rate=5")
    with socket.create_connection(("127.0.0.1", gw.port("mqtt"))) as s:
        s.sendall(connect_packet(b"v5flood", level=5))
        assert read_until_packet(s, 0x20)[0][3] == 0
        s.sendall(b"".join(_qos0(b"f/x", b"%d" % i, v5=True) for i in range(2000)))
        got = read_until_packet(s, 0xE0)
        assert [p[2] for p in got if p[0] == 0xE0] == [0x96], got
    deadline = time.monotonic() + 5
    while "message rate too high" not in gw.log_text():  # the gateway writes it meanwhile
        assert time.monotonic() < deadline, gw.log_text()
        time.sleep(0.05)
