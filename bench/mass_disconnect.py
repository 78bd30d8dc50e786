"""What it costs the gateway when many subscribers of one topic leave at once (a network blip,
a fleet's rolling restart): N clients subscribe to one topic, then all close their sockets.

    .venv/bin/python bench/mass_disconnect.py [--clients 15000] [--tree PATH ...]

They close in shuffled order (in connection order each leaver would be the list's first).
Reports the gateway's CPU seconds for the disconnects (from /proc) and the wall time until a
probe client's PINGREQ is answered after the last socket closed. Each `--tree` (a checkout) is
started with `lightgate serve` on its code, this repo's venv (PYTHONPATH=TREE).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def _cpu(pid: int) -> float:
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return (int(f[11]) + int(f[12])) / TICK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _connect(cid: bytes) -> bytes:
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


SUBSCRIBE = bytes([0x82, 11]) + b"\x00\x01\x00\x06mass/t\x00"


async def _client(port: int, i: int) -> asyncio.StreamWriter:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(_connect(b"m%d" % i) + SUBSCRIBE)
    await r.readexactly(4 + 5)  # CONNACK, SUBACK
    return w


async def _ping(port: int) -> float:
    t0 = time.monotonic()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(_connect(b"probe") + b"\xc0\x00")
    await r.readexactly(4 + 2)  # CONNACK, PINGRESP
    w.close()
    return time.monotonic() - t0


async def _run(port: int, pid: int, n: int) -> tuple[float, float]:
    writers = []
    for k in range(0, n, 500):  # 500 at a time: the accept backlog
        writers += await asyncio.gather(*(_client(port, i) for i in range(k, min(n, k + 500))))
    await asyncio.sleep(1.0)
    cpu0 = _cpu(pid)
    random.Random(1).shuffle(writers)  # devices leave in no particular order (churn, keepalives)
    for w in writers:
        w.transport.abort()  # a reset, as when a network drops
    wall = await _ping(port)
    while True:  # until the gateway has done with them
        c = _cpu(pid)
        await asyncio.sleep(0.5)
        if _cpu(pid) - c < 0.02:
            break
    return _cpu(pid) - cpu0, wall


def measure(tree: Path, n: int) -> tuple[float, float]:
    port = _free_port()
    with tempfile.TemporaryDirectory() as data:
        cmd = [str(ROOT / ".venv/bin/lightgate"), "serve", "--data-dir", data, "--mqtt-port",
               str(port), "--mqtts-port", "-1", "--ws-port", "-1", "--kafka-port", "-1",
               "--http-port", "-1", "--set", "log_level=warning"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(tree)}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 0.2).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "gateway did not start"
                    time.sleep(0.1)
            return asyncio.run(_run(port, proc.pid, n))
        finally:
            proc.terminate()  # ours, by PID
            proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=15000)
    ap.add_argument("--tree", action="append", default=None, help="LABEL=PATH (default this one)")
    a = ap.parse_args()
    trees = a.tree or [f"this={ROOT}"]
    for spec in trees:
        label, _, path = spec.partition("=")
        cpu, wall = measure(Path(path).resolve(), a.clients)
        print(f"{label}: {a.clients} subscribers of one topic leave: gateway CPU {cpu:.2f} s, "
              f"probe answered {wall:.2f} s after they closed", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
