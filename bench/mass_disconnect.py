"""What it costs the gateway when many subscribers of one topic leave at once (a network blip,
a fleet's rolling restart): N clients subscribe to one topic, then all close their sockets.

    .venv/bin/python bench/mass_disconnect.py [--clients 15000] [--tree LABEL=PATH ...]

They close in shuffled order (in connection order each leaver would be the list's first).
Reports the gateway's CPU seconds for the disconnects (from /proc) and the wall time until a
probe client's PINGREQ is answered after the last socket closed. Each `--tree` (a checkout) is
started as bench/lone_message.py starts one (bench/mqtt_serve.sh, PYTHONPATH=TREE).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import struct
import time

from lone_message import ROOT, _cpu_s, _start  # this folder's broker start and /proc CPU reader
from topic_alias_bench import _packet, _str, connect_v4  # this folder's raw MQTT encoders

SUBSCRIBE = _packet(0x82, struct.pack(">H", 1) + _str("mass/t") + b"\x00")


async def _client(port: int, i: int) -> asyncio.StreamWriter:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(connect_v4(f"m{i}") + SUBSCRIBE)
    await r.readexactly(4 + 5)  # CONNACK, SUBACK
    return w


async def _ping(port: int) -> float:
    t0 = time.monotonic()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(connect_v4("probe") + b"\xc0\x00")
    await r.readexactly(4 + 2)  # CONNACK, PINGRESP
    w.close()
    return time.monotonic() - t0


async def _run(port: int, pid: int, n: int) -> tuple[float, float]:
    writers = []
    for k in range(0, n, 500):  # 500 at a time: the accept backlog
        writers += await asyncio.gather(*(_client(port, i) for i in range(k, min(n, k + 500))))
    await asyncio.sleep(1.0)
    cpu0 = _cpu_s(pid)
    random.Random(1).shuffle(writers)  # devices leave in no particular order (churn, keepalives)
    for w in writers:
        w.transport.abort()  # a reset, as when a network drops
    wall = await _ping(port)
    while True:  # until the gateway has done with them
        c = _cpu_s(pid)
        await asyncio.sleep(0.5)
        if _cpu_s(pid) - c < 0.02:
            break
    return _cpu_s(pid) - cpu0, wall


def measure(label: str, tree: str, n: int) -> tuple[float, float]:
    proc, port = _start(label, tree)
    try:
        return asyncio.run(_run(port, proc.pid, n))
    finally:
        proc.terminate()  # ours, by PID
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=15000)
    ap.add_argument("--tree", action="append", default=None, help="LABEL=PATH (default this one)")
    a = ap.parse_args()
    for spec in a.tree or [f"this={ROOT}"]:
        label, _, path = spec.partition("=")
        cpu, wall = measure(label, path, a.clients)
        print(f"{label}: {a.clients} subscribers of one topic leave: gateway CPU {cpu:.2f} s, "
              f"probe answered {wall:.2f} s after they closed", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
