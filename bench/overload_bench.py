"""Overload: idle sockets and slowloris clients against one `lightgate serve`, while a normal paho
client measures publish→deliver latency and the gateway's RSS is watched.

Attack, all from this process (127.0.0.1):
  idle        TCP connections that open and never send a byte (no CONNECT)
  slowloris   half dribble a CONNECT one byte a second (never finishing it within the
              CONNECT timeout), half send a whole CONNECT and then dribble a PUBLISH one byte
              a second (a 1 KiB packet that would take 17 minutes)
The gateway runs with `connect_timeout_s` above the measuring window (default 120 s), so every
idle socket is held while latency is measured: the worst case, not the one the timeout sheds.
Latency: a paho 3.1.1 publisher sends QoS 0 messages carrying their send time every `--interval`
seconds to a paho subscriber of the same topic; the figures are per message, before the attack
(baseline) and during it. RSS is the gateway's VmRSS from /proc.

    .venv/bin/python bench/overload_bench.py --idle 10000 --slowloris 100 --seconds 20

The soft RLIMIT_NOFILE is raised to the hard limit here (the gateway inherits it); with a hard
limit too low for `--idle`, as many idle sockets as fit are opened and the output says so.
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from gateway_process import GatewayProcess  # noqa: E402


def connect_packet(client_id: str, keepalive: int = 60) -> bytes:
    cid = client_id.encode()
    body = (
        b"\x00\x04MQTT\x04\x02" + struct.pack(">H", keepalive) + struct.pack(">H", len(cid)) + cid
    )
    return bytes([0x10, len(body)]) + body


def publish_head(topic: str = "loris/t", size: int = 1024) -> bytes:
    """A QoS 0 PUBLISH of `size` payload bytes: the bytes a slowloris dribbles (never all)."""
    t = topic.encode()
    rl = 2 + len(t) + size
    out = bytearray([0x30])
    while True:
        b = rl & 0x7F
        rl >>= 7
        out.append(b | (0x80 if rl else 0))
        if not rl:
            break
    return bytes(out) + struct.pack(">H", len(t)) + t + b"x" * size


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def raise_nofile(want: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class Latency:
    """A paho publisher and subscriber on one topic; `measure` returns per-message latencies (ms).
    Created before the attack so their sockets get low descriptors (paho uses select())."""

    def __init__(self, port: int, topic: str = "bench/latency") -> None:
        self.topic = topic
        self.samples: list[float] = []
        self._lock = threading.Lock()
        ready = threading.Event()
        self.sub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="lat-sub")
        self.sub.on_connect = lambda c, *a: c.subscribe(topic, 0)
        self.sub.on_subscribe = lambda *a: ready.set()
        self.sub.on_message = self._on_message
        self.sub.connect("127.0.0.1", port, 60)
        self.sub.loop_start()
        assert ready.wait(10), "latency subscriber not subscribed"
        self.pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="lat-pub")
        self.pub.connect("127.0.0.1", port, 60)
        self.pub.loop_start()
        time.sleep(0.2)

    def _on_message(self, c: Any, ud: Any, msg: mqtt.MQTTMessage) -> None:
        sent = struct.unpack(">d", msg.payload[:8])[0]
        with self._lock:
            self.samples.append((time.perf_counter() - sent) * 1000)

    def measure(self, seconds: float, interval: float) -> dict[str, float]:
        with self._lock:
            self.samples = []
        n = 0
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            self.pub.publish(self.topic, struct.pack(">d", time.perf_counter()) + b"x" * 56, 0)
            n += 1
            time.sleep(interval)
        time.sleep(0.5)
        with self._lock:
            s = sorted(self.samples)
        if not s:
            return {"sent": n, "received": 0}
        return {
            "sent": n,
            "received": len(s),
            "median_ms": round(statistics.median(s), 3),
            "p99_ms": round(s[min(len(s) - 1, int(len(s) * 0.99))], 3),
            "max_ms": round(s[-1], 3),
        }

    def close(self) -> None:
        for c in (self.pub, self.sub):
            c.disconnect()
            c.loop_stop()


class Attack:
    """Idle sockets plus slowloris dribblers (one thread writes one byte a second to each)."""

    def __init__(self, port: int, keepalive: int = 60) -> None:
        self.port = port
        self.keepalive = keepalive  # of the slowloris clients that finish their CONNECT
        self.idle: list[socket.socket] = []
        self.loris: list[tuple[socket.socket, bytes]] = []
        self.pos: list[int] = []
        self.closed_by_gateway = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def open_idle(self, n: int) -> int:
        for _ in range(n):
            try:
                s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            except OSError as exc:
                print(f"idle socket {len(self.idle)}: {exc}", file=sys.stderr)
                break
            self.idle.append(s)
        return len(self.idle)

    def open_slowloris(self, n: int) -> None:
        for i in range(n):
            s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if i % 2:  # CONNECT first, then a PUBLISH dribbled
                s.sendall(connect_packet(f"loris-{i}", self.keepalive))
                ack = s.recv(4)
                assert ack[:1] == b"\x20", ack
                data = publish_head()
            else:  # the CONNECT itself dribbled
                data = connect_packet(f"loris-{i}")
            self.loris.append((s, data))
            self.pos.append(0)
        self._thread = threading.Thread(target=self._dribble, daemon=True)
        self._thread.start()

    def _dribble(self) -> None:
        while not self._stop.wait(1.0):
            for k, (s, data) in enumerate(self.loris):
                p = self.pos[k]
                if p < 0 or p >= len(data) - 1:  # closed, or keep the last byte back
                    continue
                try:
                    s.send(data[p : p + 1])
                    self.pos[k] = p + 1
                except OSError:
                    self.pos[k] = -1
                    self.closed_by_gateway += 1

    def alive_loris(self) -> int:
        return sum(1 for p in self.pos if p >= 0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for s in self.idle:
            s.close()
        for s, _ in self.loris:
            s.close()


def run(
    idle: int, slowloris: int, seconds: float, interval: float = 0.01, connect_timeout: int = 120
) -> dict[str, Any]:
    """Start a gateway, measure, attack, measure again; the figures as a dict."""
    soft, hard = raise_nofile(idle + slowloris + 512)
    fit = max(0, min(idle, soft - slowloris - 512))
    out: dict[str, Any] = {"nofile": [soft, hard], "idle_requested": idle}
    with tempfile.TemporaryDirectory(prefix="lg-overload-") as tmp:
        args = ["--set", f"connect_timeout_s={connect_timeout}", "--set", "sys_interval_s=0"]
        gw = GatewayProcess(Path(tmp) / "data", args).start()
        try:
            assert gw.proc is not None
            pid = gw.proc.pid
            port = gw.port("mqtt")
            lat = Latency(port)
            out["baseline"] = lat.measure(min(5.0, seconds), interval)
            out["rss_kib_before"] = rss_kib(pid)
            attack = Attack(port)
            t0 = time.perf_counter()
            out["idle_open"] = attack.open_idle(fit)
            attack.open_slowloris(slowloris)
            out["open_s"] = round(time.perf_counter() - t0, 2)
            time.sleep(1.0)
            out["rss_kib_attack"] = rss_kib(pid)
            out["under_attack"] = lat.measure(seconds, interval)
            out["rss_kib_after"] = rss_kib(pid)
            out["slowloris_alive"] = attack.alive_loris()
            out["gateway_alive"] = gw.proc.poll() is None
            attack.close()
            lat.close()
        finally:
            gw.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--idle", type=int, default=10_000)
    ap.add_argument("--slowloris", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=0.01)
    ap.add_argument("--connect-timeout", type=int, default=120)
    a = ap.parse_args()
    res = run(a.idle, a.slowloris, a.seconds, a.interval, a.connect_timeout)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
