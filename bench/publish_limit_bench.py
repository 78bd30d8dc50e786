"""What the per-client publish limits cost: gateway CPU per PUBLISH with `max_publish_rate` and
`max_publish_bytes_rate` off, and on at rates no client reaches (so nothing is slowed and only
the bookkeeping is measured).

Two loads, each on a fresh `lightgate serve` (bench/mqtt_serve.sh), the settings alternating
within each round (each round starts with the next setting): `off`, `on`, and with `--base
PATH` also `before`, the limits off on another checkout (the tree before the limits existed,
with this checkout's compiled modules copied in), to see that "off" costs what it did:
- lone: lone_message.py's one publisher and one subscriber, one QoS 0 message at a time;
- burst: one 3.1.1 publisher writing QoS 0 PUBLISH 64 to a write (a fan-in client's chunks),
  no subscriber, then a PINGREQ: when its PINGRESP is back every PUBLISH has been handled.
CPU is the gateway's user + system time from /proc, per message.

Usage (from the repository root):
    .venv/bin/python bench/publish_limit_bench.py [--rounds 3] [--seconds 4] [--burst 200000]
        [--base PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from typing import Any

from lone_message import ROOT, _connect, _cpu_s, _wait_port, measure
from topic_alias_bench import _packet, _str

PORT = 18851
SETTINGS = {
    "off": [],
    "on": ["--set", "max_publish_rate=1000000000", "--set", "max_publish_bytes_rate=1000000000000"],
}


def burst(port: int, pid: int, n: int) -> dict[str, float]:
    pub = _connect(port, "burst-pub")
    try:
        chunk = b"".join(_packet(0x30, _str("burst/t") + b"x" * 32) for _ in range(64))
        for _ in range(2000 // 64):  # warm-up
            pub.sendall(chunk)
        time.sleep(0.5)
        c0, t0 = _cpu_s(pid), time.perf_counter()
        for _ in range(n // 64):
            pub.sendall(chunk)
        pub.sendall(b"\xc0\x00")  # PINGREQ: answered after every PUBLISH before it
        got = b""
        while b"\xd0\x00" not in got:
            got += pub.recv(65536)
        wall = time.perf_counter() - t0
        time.sleep(0.3)  # the last append's fsync and dispatch
        cpu = _cpu_s(pid) - c0
        m = (n // 64) * 64
        return {"msgs": m, "cpu_us_per_msg": round(1e6 * cpu / m, 2),
                "msgs_per_s": round(m / wall)}  # fmt: skip
    finally:
        pub.close()


def _start(setting: str, base: str) -> subprocess.Popen[bytes]:
    cmd = ["bash", str(ROOT / "bench/mqtt_serve.sh"), str(PORT),
           f"/tmp/lightgate-limit-bench-{setting}", *SETTINGS.get(setting, [])]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": base} if setting == "before" else None
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(PORT, proc)
    time.sleep(1)
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="lone: per setting and round")
    ap.add_argument("--burst", type=int, default=200_000, help="burst: messages per run")
    ap.add_argument("--base", default="", help="another checkout, run as setting `before`")
    args = ap.parse_args()
    rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    order = list(SETTINGS) + (["before"] if args.base else [])
    for rnd in range(args.rounds):
        k = rnd % len(order)
        for setting in order[k:] + order[:k]:
            proc = _start(setting, args.base)
            try:
                for load in ("lone", "burst"):
                    if load == "lone":
                        r = measure(PORT, proc.pid, args.seconds, 0.0)
                    else:
                        r = burst(PORT, proc.pid, args.burst)
                    print(json.dumps({"round": rnd, "limits": setting, "load": load, **r}),
                          flush=True)  # fmt: skip
                    rows.setdefault((load, setting), []).append(r)
            finally:
                proc.terminate()  # the gateway this run started, by PID
                proc.wait(30)
    print("\n| load | limits | CPU µs/msg (median) | all rounds |")
    print("|---|---|---:|---|")
    for (load, setting), rs in sorted(rows.items()):
        cpus = [r["cpu_us_per_msg"] for r in rs]
        print(
            f"| {load} | {setting} | {statistics.median(cpus):.2f} | {', '.join(map(str, cpus))} |"
        )


if __name__ == "__main__":
    main()
