"""What one message costs a broker when it arrives alone: one publisher, one subscriber, one QoS 0
PUBLISH at a time, the next sent only after the subscriber has it (what sets the p99 at 1k msg/s);
`--qos 1`: the whole QoS 1 exchange (the subscriber's PUBACK and the publisher's) each time.

At 1k msg/s nearly every message is alone in its pass of the event loop, so the broker's fixed
cost per pass, not its cost per message in a batch, sets its CPU and (on a machine with slow
windows) its p99. This measures that cost directly, without the pacing and the second process of
mqttbench's latency scenario: with no gap (back to back, the path hot in the caches) and with a
gap after each message (the path cold again, as at 1k msg/s), side by side with Mosquitto.

Each round starts every broker afresh (Lightgate by `bench/mqtt_serve.sh`, Mosquitto with
`bench/mqttbench/brokers/mosquitto.conf`), alternating; the table is the median over the rounds.
CPU is the broker's user + system time from /proc per message; RTT is publish -> received, seen
by this (blocking, single-threaded) client.

Usage (from the repository root):
    .venv/bin/python bench/lone_message.py [--rounds 3] [--seconds 4] [--gaps 0,1] [--qos 0|1]
        [--tree LABEL=PATH ...]   (Lightgate at other checkouts: PYTHONPATH=PATH, this venv, or
                                   PATH's own .venv where it has one: another interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import time
from pathlib import Path
from typing import Any

from topic_alias_bench import _packet, _str, connect_v4  # this folder's raw MQTT encoders

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
TOPIC = "lone/t"


def _connect(port: int, cid: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(connect_v4(cid))
    if s.recv(4)[:1] != b"\x20":
        raise RuntimeError("no CONNACK")
    return s


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def measure(port: int, pid: int, seconds: float, gap_ms: float, qos: int = 0) -> dict[str, float]:
    """One publisher and one subscriber; each message waits for the previous delivery. QoS 1:
    the subscriber PUBACKs what it gets and the publisher waits for its own PUBACK too (which
    the broker sends after the fsync), so each message is the whole QoS 1 exchange."""
    sub, pub = _connect(port, "lone-sub"), _connect(port, "lone-pub")
    try:
        sub.sendall(_packet(0x82, struct.pack(">H", 1) + _str(TOPIC) + bytes([qos])))
        sub.recv(5)  # SUBACK
        body = b"x" * 32
        msg = _packet(0x30, _str(TOPIC) + body)
        need, gap = len(msg) + 2 * qos, gap_ms / 1000
        at = 2 + 2 + len(TOPIC)  # a delivered QoS 1 PUBLISH's packet id
        k = 0

        def one() -> int:
            nonlocal k
            t = time.perf_counter_ns()
            if qos:
                k = k % 65535 + 1
                pub.sendall(_packet(0x32, _str(TOPIC) + struct.pack(">H", k) + body))
            else:
                pub.sendall(msg)
            got = b""
            while len(got) < need:
                got += sub.recv(65536)
            if qos:
                sub.sendall(b"\x40\x02" + got[at : at + 2])
                ack = b""
                while len(ack) < 4:
                    ack += pub.recv(4 - len(ack))
            return time.perf_counter_ns() - t

        for _ in range(200):  # warm-up
            one()
        c0, t0 = _cpu_s(pid), time.perf_counter()
        rtt: list[int] = []
        while time.perf_counter() - t0 < seconds:
            rtt.append(one())
            if gap:
                time.sleep(gap)
        cpu = _cpu_s(pid) - c0
        rtt.sort()
        n = len(rtt)
        return {
            "msgs": n,
            "cpu_us_per_msg": round(1e6 * cpu / n, 1),
            "rtt_p50_us": round(rtt[n // 2] / 1e3),
            "rtt_p99_us": round(rtt[int(n * 0.99)] / 1e3),
        }
    finally:
        pub.close()
        sub.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"broker exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port}")


def _start(label: str, tree: str | None) -> tuple[subprocess.Popen[bytes], int]:
    if tree is None:  # Mosquitto
        cmd = ["mosquitto", "-c", str(ROOT / "bench/mqttbench/brokers/mosquitto.conf")]
        port, env = 18830, None
    else:
        port = 18841
        own = (Path(tree) / ".venv/bin/lightgate").exists()
        serve = Path(tree) / "bench/mqtt_serve.sh" if own else ROOT / "bench/mqtt_serve.sh"
        cmd = ["bash", str(serve), str(port), f"/tmp/lightgate-lone-{label}"]
        env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port, proc)
    time.sleep(1)  # the gateway's start-up work (recovery, first checkpoint) out of the way
    return proc, port


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0, help="per broker, gap and round")
    ap.add_argument("--gaps", default="0,1", help="ms after each delivery, comma-separated")
    ap.add_argument("--qos", type=int, choices=(0, 1), default=0)
    ap.add_argument("--tree", action="append", default=[], help="LABEL=PATH (default this one)")
    ap.add_argument("--out", default="", help="append the JSON lines here too")
    args = ap.parse_args()
    trees: list[tuple[str, str | None]] = [
        (t.split("=", 1)[0], t.split("=", 1)[1]) for t in args.tree
    ] or [("lightgate", str(ROOT))]
    trees.append(("mosquitto", None))
    gaps = [float(g) for g in args.gaps.split(",")]
    rows: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for rnd in range(args.rounds):
        # Each round starts with the next broker: whoever runs first in a round did ~10 % better
        # on this machine (docs/performance-history.md), so a fixed order biases a compare.
        for label, tree in trees[rnd % len(trees) :] + trees[: rnd % len(trees)]:
            proc, port = _start(label, tree)
            try:
                for gap in gaps:
                    r = measure(port, proc.pid, args.seconds, gap, args.qos)
                    line = {"round": rnd, "broker": label, "qos": args.qos, "gap_ms": gap, **r}
                    print(json.dumps(line), flush=True)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(line) + "\n")
                    rows.setdefault((label, gap), []).append(r)
            finally:
                proc.terminate()  # the broker this run started, by PID
                proc.wait(30)
    print("\n| broker | gap ms | CPU µs/msg | RTT p50 µs | RTT p99 µs | msgs |")
    print("|---|---:|---:|---:|---:|---:|")
    for (label, gap), rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"| {label} | {gap:g} | {med['cpu_us_per_msg']:.0f} | {med['rtt_p50_us']:.0f} | "
            f"{med['rtt_p99_us']:.0f} | {med['msgs']:.0f} |"
        )


if __name__ == "__main__":
    main()
