"""Bridges: forward throughput into a Mosquitto, and the catch-up rate after an outage.

Two brokers on loopback: the edge (`lightgate serve` with a `[[bridge]]`, or, as the peer, a
Mosquitto with a `connection` section) and the centre (Mosquitto), with a far-side subscriber on
the centre (paho, persistent session, QoS 1). Each case, for each edge:

- live: N messages published at QoS 1 (1000 in flight) on the edge while the bridge is up;
  the rate is N over first-to-last arrival at the far side; the publisher's own rate is shown.
- catch-up: the centre is down while N messages are published on the edge (the Lightgate
  bridge keeps them in the log, Mosquitto in memory); then the centre starts and the rate is N
  over the time from its start to the last arrival at the far side (Lightgate also: until its
  /api/stats says lag 0, i.e. the centre acknowledged every one).

Usage (from the repository root):
    .venv/bin/python bench/bridge_bench.py [--messages 100000] [--only lightgate|mosquitto]
Prints a markdown table; the machine is shared, so compare only figures of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mqtt_proxy.codec import CLIENT, Connect, Connection, Puback, encode_publish  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def mosquitto(dir: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    dir.mkdir(parents=True, exist_ok=True)
    user = [f"user {pwd.getpwuid(os.getuid()).pw_name}"] if os.getuid() == 0 else []
    conf = [f"listener {port} 127.0.0.1", "allow_anonymous true", "persistence true",
            f"persistence_location {dir}/", "max_queued_messages 0", "max_inflight_messages 1000",
            *user, *extra]  # fmt: skip
    (dir / "mosquitto.conf").write_text("\n".join(conf) + "\n")
    log = open(dir / "mosquitto.log", "ab")  # noqa: SIM115 - the child owns it
    p = subprocess.Popen([MOSQUITTO, "-c", str(dir / "mosquitto.conf")], stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    wait_port(port)
    return p


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGTERM)
        p.wait(30)


class Far:
    """Counts distinct arrivals on the centre; a persistent QoS 1 session that reconnects."""

    def __init__(self, port: int, client_id: str) -> None:
        self.seen: set[bytes] = set()
        self.first = self.last = 0.0
        c = self.c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                 clean_session=False)  # fmt: skip
        c.max_inflight_messages_set(1000)
        c.reconnect_delay_set(0.05, 0.2)
        ready = threading.Event()
        c.on_connect = lambda cl, *a: cl.subscribe("bench/#", 1)
        c.on_subscribe = lambda *a: ready.set()
        c.on_message = self._on_message
        c.connect("127.0.0.1", port)
        c.loop_start()
        ready.wait(10)

    def _on_message(self, cl: object, ud: object, msg: mqtt.MQTTMessage) -> None:
        now = time.monotonic()
        if not self.first:
            self.first = now
        if msg.payload not in self.seen:
            self.seen.add(msg.payload)
            self.last = now

    def wait(self, n: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"far side: {len(self.seen)} of {n}")
            time.sleep(0.02)

    def reset(self) -> None:
        self.seen.clear()
        self.first = self.last = 0.0

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def publish(port: int, n: int, tag: str) -> float:
    """n QoS 1 messages of 64 bytes, 1000 in flight; returns the rate once all are PUBACKed.
    Our codec over a raw socket: paho stalls with 100,000 queued publishes."""
    return asyncio.run(_publish(port, n, tag))


async def _publish(port: int, n: int, tag: str) -> float:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    conn = Connection(CLIENT)
    writer.write(conn.send(Connect(f"pub-{tag}", keep_alive=60)))
    window = asyncio.Semaphore(1000)
    acked = 0
    all_acked = asyncio.Event()

    async def read() -> None:
        nonlocal acked
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return
            for p in conn.receive_data(data):
                if isinstance(p, Puback):
                    acked += 1
                    window.release()
                    if acked == n:
                        all_acked.set()

    rt = asyncio.get_running_loop().create_task(read())
    t0 = time.monotonic()
    for i in range(n):
        await window.acquire()
        pid = i % 65535 + 1
        payload = f"{tag}-{i:09d}".ljust(64).encode()
        writer.write(encode_publish(f"bench/{i % 8}", payload, 1, False, False, pid))
        if i % 256 == 0:
            await writer.drain()
    await writer.drain()
    await all_acked.wait()
    dt = time.monotonic() - t0
    rt.cancel()
    writer.close()
    return n / dt


def lightgate_edge(tmp: Path, centre: int) -> tuple[subprocess.Popen[bytes], int, int]:
    conf = tmp / "edge.toml"
    conf.write_text(f'[[bridge]]\nname = "bench"\naddress = "127.0.0.1:{centre}"\n'
                    'reconnect_min_ms = 100\nreconnect_max_ms = 200\n'
                    'topics = ["bench/# out 1"]\n')  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "lightgate", "serve", "--config", str(conf), "--data-dir",
         str(tmp / "edge-data"), "--mqtt-port", "0", "--ws-port", "-1", "--kafka-port", "-1",
         "--http-port", "0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=open(tmp / "edge.log", "ab"),  # noqa: SIM115
        env={**os.environ, "LIGHTGATE_PROBE_INTERVAL_MS": "0"}, start_new_session=True,
    )  # fmt: skip
    assert p.stdout is not None
    line = p.stdout.readline().decode()
    ports = {w.split("=")[0]: int(w.rsplit(":", 1)[1]) for w in line.split()[2:]}
    return p, ports["mqtt"], ports["http"]


def lag(http: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/api/stats", timeout=10) as r:
        return int(json.loads(r.read())["bridges"][0]["lag_messages"])


def run(edge_kind: str, n: int) -> dict[str, float]:
    tmp = Path(tempfile.mkdtemp(prefix=f"bridge-bench-{edge_kind}-"))
    centre_port = free_port()
    centre = mosquitto(tmp / "centre", centre_port)
    far = Far(centre_port, f"far-{edge_kind}")
    http = 0
    if edge_kind == "lightgate":
        edge, edge_port, http = lightgate_edge(tmp, centre_port)
    else:
        edge_port = free_port()
        edge = mosquitto(tmp / "edge", edge_port, "connection centre",
                         f"address 127.0.0.1:{centre_port}", "topic bench/# out 1",
                         "cleansession false", "restart_timeout 1")  # fmt: skip
    out: dict[str, float] = {}
    try:
        time.sleep(1.0)  # the bridge connects
        out["live publish msg/s"] = publish(edge_port, n, "live")
        far.wait(n)
        out["live forward msg/s"] = n / (far.last - far.first)
        far.reset()
        stop(centre)  # the outage: the far side's session is kept in the centre's file
        out["outage publish msg/s"] = publish(edge_port, n, "outage")
        time.sleep(1.0)
        t0 = time.monotonic()
        centre = mosquitto(tmp / "centre", centre_port)
        if http:
            while lag(http) > 0:
                time.sleep(0.05)
            out["catch-up acked msg/s"] = n / (time.monotonic() - t0)
        far.wait(n)
        out["catch-up delivered msg/s"] = n / (far.last - t0)
    finally:
        far.close()
        stop(edge)
        stop(centre)
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--only", choices=["lightgate", "mosquitto"])
    args = ap.parse_args()
    kinds = [args.only] if args.only else ["lightgate", "mosquitto"]
    results = {k: run(k, args.messages) for k in kinds}
    keys = list(next(iter(results.values())).keys())
    keys += [k for r in results.values() for k in r if k not in keys]
    print(f"\n{args.messages} messages of 64 bytes, QoS 1, bridge `bench/# out 1`\n")
    print("| figure | " + " | ".join(f"{k} edge" for k in kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for key in keys:
        cells = [f"{results[k][key]:,.0f}" if key in results[k] else "—" for k in kinds]
        print(f"| {key} | " + " | ".join(cells) + " |")
    print()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
