"""What `cluster_sessions_topic` costs a CONNECT: CONNECT → CONNACK time on one Kafka-backed node
with the cross-node claim on and off, alternating, against the same real Tansu.

    .venv/bin/python bench/cluster_connect_cost.py [--n 300] [--rounds 3] [--idle]

Each round starts one `serve` per setting (fresh data dir), connects `n` 3.1.1 clients one after
another (raw sockets, clean session, a new client id each, then one client id reconnecting
`n` times), and prints the median and p99 in ms. `--idle`: instead, the node's CPU over 10 s
of doing nothing, 2 s after it is ready (/proc/<pid>/stat), in % of a core.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gateway_process import GatewayProcess  # noqa: E402
from tansu import kafka_args, start_tansu  # noqa: E402


def connect_packet(cid: str) -> bytes:
    c = cid.encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x3c" + len(c).to_bytes(2, "big") + c
    return bytes([0x10, len(body)]) + body


def one(port: int, cid: str) -> float:
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.perf_counter()
    s.sendall(connect_packet(cid))
    got = b""
    while len(got) < 4:
        got += s.recv(4)
    took = time.perf_counter() - t0
    s.sendall(b"\xe0\x00")
    s.close()
    return took * 1000


def run(port: int, n: int, tag: str) -> list[float]:
    fresh = [one(port, f"{tag}-{i}") for i in range(n)]
    again = [one(port, f"{tag}-same") for _ in range(n)]
    return fresh + again


def idle_cpu(g: GatewayProcess) -> float:
    def cpu() -> float:
        assert g.proc is not None
        f = Path(f"/proc/{g.proc.pid}/stat").read_text().split(")")[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    time.sleep(2)
    c0, t0 = cpu(), time.monotonic()
    time.sleep(10)
    return 100 * (cpu() - c0) / (time.monotonic() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = start_tansu(Path(tmp))
        try:
            for r in range(a.rounds):
                for label, topic in (("on", "__lightgate_sessions"), ("off", "")):
                    d = Path(tmp) / f"{label}{r}"
                    g = GatewayProcess(d, kafka_args(t, "--set", f"cluster_sessions_topic={topic}"))
                    g.start()
                    try:
                        if a.idle:
                            print(f"round {r} claims {label:3}: idle {idle_cpu(g):.1f} % of a core")
                            continue
                        ms = sorted(run(g.port("mqtt"), a.n, f"{label}{r}"))
                    finally:
                        g.stop()
                    p99 = ms[int(len(ms) * 0.99) - 1]
                    print(
                        f"round {r} claims {label:3}: CONNECT->CONNACK median "
                        f"{statistics.median(ms):.2f} ms, p99 {p99:.2f} ms ({len(ms)} connects)"
                    )
        finally:
            t.stop()


if __name__ == "__main__":
    main()
