"""A million retained messages: memory, a `#` subscriber receiving them all, restart.

For each broker (fresh, alternating by round): publish `--count` retained messages (QoS 1,
each its own topic `fleet/dev<i>/state`, `--publishers` connections pipelining up to `--window`
unacknowledged each), then measure
- the broker's RSS growth per retained message, and its bytes on disk (Lightgate's data dir;
  Mosquitto's `mosquitto.db` after a save),
- the time for one `#` subscriber to receive every one, at QoS 0 and at QoS 1 (acking each),
  and the broker's RSS peak while it sends them,
- a restart: SIGTERM, start again on the same data, time until a new `#` subscriber has its
  first retained message and until it has them all, and RSS afterwards.

Mosquitto runs with `persistence true` (its retained messages survive a restart only so); it
keeps every retained message in memory, Lightgate keeps them in LevelDB.

    .venv/bin/python bench/retained_million.py --count 1000000 --rounds 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fleet_mqtt import (  # noqa: E402
    ROOT,
    STAMP,
    Counters,
    connect_packet,
    free_port,
    mqtt_str,
    open_client,
    packet,
    process_tree,
    rss_kb,
    stop_broker,
    subscribe_packet,
)


def start(kind: str, port: int, work: Path) -> subprocess.Popen[bytes]:
    if kind == "mosquitto":
        conf = work / "mosquitto.conf"
        conf.write_text(
            f"per_listener_settings false\nlistener {port} 127.0.0.1\nallow_anonymous true\n"
            f"max_connections -1\npersistence true\npersistence_location {work}/\n"
            "autosave_interval 0\nmax_queued_messages 0\nlog_dest stderr\nlog_type error\n"
        )
        cmd = ["mosquitto", "-c", str(conf)]
    else:
        cmd = [str(ROOT / ".venv/bin/lightgate"), "serve", "--data-dir", str(work / "data"),
               "--mqtt-port", str(port), "--mqtts-port", "-1", "--ws-port", "-1",
               "--kafka-port", "-1", "--http-port", "-1", "--set", "log_level=warning"]  # fmt: skip
    log = open(work / f"{kind}.log", "ab")  # noqa: SIM115 (lives as long as the broker)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {(work / f'{kind}.log').read_text()[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{kind} did not listen within 600 s")


class Peak:
    """Samples a process tree's RSS every 50 ms in a thread; `peak` in KiB."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_kb(process_tree(self.pid)))

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


async def load(port: int, count: int, publishers: int, window: int, size: int) -> float:
    t0 = time.monotonic()

    async def one(k: int) -> None:
        c = Counters()
        cl = await open_client(port, "127.0.0.1", c, connect_packet(f"loader{k}"), 1, 30)
        assert cl.transport is not None
        mine = range(k, count, publishers)
        pad = b"x" * max(0, size - STAMP.size)
        sent = 0
        for start_i in range(0, len(mine), 256):
            while sent - c.acked > window:
                await asyncio.sleep(0.001)
            out = []
            for i in mine[start_i : start_i + 256]:
                pid = (sent % 65535) + 1
                body = mqtt_str(f"fleet/dev{i}/state") + pid.to_bytes(2, "big")
                out.append(packet(0x33, body + STAMP.pack(0, i) + pad))  # QoS 1, retain
                sent += 1
            cl.transport.write(b"".join(out))
        while c.acked < sent:
            await asyncio.sleep(0.005)
        cl.transport.close()

    await asyncio.gather(*(one(k) for k in range(publishers)))
    return time.monotonic() - t0


async def receive_all(port: int, count: int, qos: int, name: str) -> tuple[float, float]:
    """Seconds to the first and to the last of `count` retained messages for a `#` reader."""
    c = Counters()
    t0 = time.monotonic()
    hello = connect_packet(name) + subscribe_packet("#", qos)
    cl = await open_client(port, "127.0.0.1", c, hello, 2, 600)
    first = 0.0
    last_n, last_t = 0, time.monotonic()
    while c.delivered < count:
        await asyncio.sleep(0.002)
        if c.delivered and not first:
            first = time.monotonic() - t0
        if c.delivered != last_n:
            last_n, last_t = c.delivered, time.monotonic()
        elif time.monotonic() - last_t > 30:
            raise RuntimeError(f"{name}: stalled at {c.delivered} of {count}")
    took = time.monotonic() - t0
    assert cl.transport is not None
    cl.transport.close()
    return first, took


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"retained-{kind}-") as tmp:
        work = Path(tmp)
        work.chmod(0o777)  # Mosquitto started as root drops to its own user, and saves here
        port = free_port()
        proc = start(kind, port, work)
        row: dict[str, Any] = {"broker": kind, "count": args.count}
        try:
            time.sleep(1)
            rss0 = rss_kb(process_tree(proc.pid))
            row["load_s"] = asyncio.run(
                load(port, args.count, args.publishers, args.window, args.size)
            )
            time.sleep(2)
            rss1 = rss_kb(process_tree(proc.pid))
            row["rss_mb"] = rss1 / 1024
            row["bytes_per_retained_rss"] = (rss1 - rss0) * 1024 / args.count
            for qos in (0, 1):
                peak = Peak(proc.pid)
                first, took = asyncio.run(receive_all(port, args.count, qos, f"all-q{qos}"))
                row[f"q{qos}_first_s"], row[f"q{qos}_all_s"] = first, took
                row[f"q{qos}_peak_mb"] = peak.stop() / 1024
        finally:
            t = time.monotonic()
            stop_broker(proc)
            row["stop_s"] = time.monotonic() - t
        row["disk_mb"] = disk_bytes(work) / 1e6
        t = time.monotonic()
        proc = start(kind, port, work)
        try:
            row["listen_s"] = time.monotonic() - t
            first, took = asyncio.run(receive_all(port, args.count, 0, "after-restart"))
            row["restart_first_s"] = row["listen_s"] + first
            row["restart_all_s"] = row["listen_s"] + took
            row["restart_rss_mb"] = rss_kb(process_tree(proc.pid)) / 1024
        finally:
            stop_broker(proc)
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=1_000_000)
    ap.add_argument("--brokers", default="lightgate,mosquitto")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--publishers", type=int, default=4)
    ap.add_argument("--window", type=int, default=2000, help="unacked publishes per publisher")
    ap.add_argument("--size", type=int, default=32, help="payload bytes")
    ap.add_argument("--out", type=Path, default=None, help="append JSON rows here")
    args = ap.parse_args()
    rows = []
    for rnd in range(args.rounds):
        kinds = args.brokers.split(",")
        for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
            try:
                row = run(kind, args)
            except Exception as e:  # a broker that cannot hold them is a result too
                row = {"broker": kind, "count": args.count, "error": repr(e)[:300]}
            row["round"] = rnd
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
