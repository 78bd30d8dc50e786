"""MQTT 5 server-assigned topic aliases: bytes per delivered message and delivery cost, with and
without.

Each run starts a fresh `lightgate serve` from this checkout (`python -m lightgate`, so the split
shape's proxy child runs the same code) and drives it with raw asyncio clients, so no client
library sits between the socket and the count: subscribers are MQTT 5 and subscribe to
`dev/+/telemetry` at QoS 0, announcing a Topic Alias Maximum (`alias`) or not (`plain`);
publishers are MQTT 3.1.1 and send 64-byte payloads round robin over `dev/<i>/telemetry`,
i = 0..topics-1, as fast as TCP lets them. Scenarios:

- `bytes`: one subscriber, one publisher (default 10,000 messages over 100 topics);
- `fanout`: one publisher, many subscribers (every message to each; default 30,000 x 20);
- `fanin`: many publishers, one subscriber (default 10 publishers, 30,000 messages in all).

Measured per run: bytes the subscribers read per PUBLISH they got, delivered messages per second
(first to last delivery, all subscribers together), and the gateway's CPU (user + system of
`serve` and its children, from /proc via psutil) per delivered message. `alias` and `plain` runs
alternate, each on a fresh gateway; the summary is the median of `--repeat` runs.

Usage (from the repository root):
    .venv/bin/python bench/topic_alias_bench.py [--repeat 3] [--shape serve|split]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _packet(b0: int, body: bytes) -> bytes:
    return bytes((b0,)) + _varint(len(body)) + body


def connect_v5(cid: str, alias_max: int) -> bytes:
    props = b"\x22" + struct.pack(">H", alias_max) if alias_max else b""
    body = _str("MQTT") + b"\x05\x02\x00\x3c" + _varint(len(props)) + props + _str(cid)
    return _packet(0x10, body)


def connect_v4(cid: str) -> bytes:
    return _packet(0x10, _str("MQTT") + b"\x04\x02\x00\x3c" + _str(cid))


class Subscriber(asyncio.Protocol):
    """Counts the bytes it reads and the PUBLISH packets in them (fixed headers walked)."""

    def __init__(self, expect: int, done: asyncio.Future[None]) -> None:
        self.buf = b""
        self.nbytes = 0
        self.publishes = 0
        self.expect = expect
        self.done = done
        self.first = 0.0
        self.last = 0.0
        self.acks: asyncio.Queue[bytes] = asyncio.Queue()

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        i, n = 0, len(buf)
        while i + 2 <= n:
            rl, mul, j = 0, 1, i + 1
            while j < n:
                b = buf[j]
                rl += (b & 0x7F) * mul
                mul <<= 7
                j += 1
                if not b & 0x80:
                    break
            else:
                break
            if j + rl > n:
                break
            if buf[i] >> 4 == 3:
                self.nbytes += j + rl - i
                self.publishes += 1
            else:
                self.acks.put_nowait(buf[i : j + rl])
            i = j + rl
        self.buf = buf[i:]
        if self.publishes and not self.first:
            self.first = time.perf_counter()
        if self.publishes >= self.expect and not self.done.done():
            self.last = time.perf_counter()
            self.done.set_result(None)


async def open_sub(port: int, cid: str, alias_max: int, expect: int) -> Subscriber:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    tr, proto = await loop.create_connection(lambda: Subscriber(expect, done), "127.0.0.1", port)
    tr.write(connect_v5(cid, alias_max))
    ack = await asyncio.wait_for(proto.acks.get(), 10)
    assert ack[0] == 0x20 and ack[3] == 0, ack
    tr.write(_packet(0x82, b"\x00\x01\x00" + _str("dev/+/telemetry") + b"\x00"))
    ack = await asyncio.wait_for(proto.acks.get(), 10)
    assert ack[0] == 0x90, ack
    return proto


async def publish(port: int, cid: str, n: int, topics: int, offset: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_v4(cid))
    await reader.readexactly(4)
    payload = bytes(64)
    pkts = [
        _packet(0x30, _str(f"dev/{i}/telemetry") + payload) for i in range(topics)
    ]  # QoS 0, 3.1.1
    batch = []
    for k in range(n):
        batch.append(pkts[(offset + k) % topics])
        if len(batch) == 256:
            writer.write(b"".join(batch))
            batch = []
            await writer.drain()
    writer.write(b"".join(batch) + b"\xe0\x00")
    await writer.drain()
    writer.close()


def gateway_cpu(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def run_clients(
    port: int, gw: psutil.Process, scenario: str, alias: bool, args: argparse.Namespace
) -> dict[str, Any]:
    nsubs = args.subscribers if scenario == "fanout" else 1
    npubs = args.publishers if scenario == "fanin" else 1
    n = args.messages if scenario == "bytes" else args.fan_messages
    per_pub = n // npubs
    total = per_pub * npubs
    amax = args.alias_max if alias else 0
    subs = [await open_sub(port, f"sub{i}", amax, total) for i in range(nsubs)]
    await asyncio.sleep(0.5)  # subscriptions attached
    cpu0 = gateway_cpu(gw)
    await asyncio.gather(*(publish(port, f"pub{i}", per_pub, args.topics, i) for i in range(npubs)))
    await asyncio.wait_for(asyncio.gather(*(s.done for s in subs)), 300)
    cpu = gateway_cpu(gw) - cpu0
    delivered = sum(s.publishes for s in subs)
    elapsed = max(s.last for s in subs) - min(s.first for s in subs)
    return {
        "scenario": scenario,
        "mode": "alias" if alias else "plain",
        "delivered": delivered,
        "bytes_per_msg": sum(s.nbytes for s in subs) / delivered,
        "msgs_per_s": delivered / elapsed,
        "cpu_us_per_msg": cpu / delivered * 1e6,
    }


def run(scenario: str, alias: bool, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    data = tmp / f"data-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(data),
           "--mqtt-port", "0", "--ws-port", "-1", "--kafka-port", "-1", "--http-port", "-1",
           "--mqtts-port", "-1", "--set", "log_level=warning", "--set", "sys_interval_s=0",
           "--set", "probe_interval_ms=0",
           "--set", f"mqtt_processes={1 if args.shape == 'split' else 0}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT, env=env)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        if not line.startswith("lightgate ready"):
            raise SystemExit(f"gateway did not start: {line!r}")
        port = int(line.split("mqtt=")[1].split()[0].rsplit(":", 1)[1])
        return asyncio.run(run_clients(port, psutil.Process(proc.pid), scenario, alias, args))
    finally:
        proc.terminate()
        proc.wait(30)


def micro(n: int = 100_000, topics: int = 100) -> None:
    """The delivery step alone, in this process (no sockets, no other load in the loop): what
    one delivered PUBLISH costs to encode without and with an alias."""
    sys.path.insert(0, str(ROOT))
    from mqtt_proxy.codec import PublishTemplate, publish_qos0, publish_qos0_alias
    from mqtt_proxy.delivery.topic_aliases import AliasBook, OutAliases

    names = [f"dev/{i}/telemetry" for i in range(topics)]
    seq = [names[k % topics] for k in range(n)]
    payload = bytes(64)
    book = AliasBook(256)
    oa = OutAliases(book, topics)
    tpls = {t: PublishTemplate.build(t, payload, 1, False, None, 5) for t in names}
    for t in names:
        oa.packet(t, tpls[t], 1, b"")  # every alias known: the steady state

    def qos0_plain() -> None:
        for t in seq:
            publish_qos0(t, payload, False, True)

    def qos0_alias() -> None:
        lookup = book.lookup
        for t in seq:
            publish_qos0_alias(t, payload, lookup(t), False)

    def qos1_plain() -> None:
        for t in seq:
            tpls[t].packet(7)

    def qos1_alias() -> None:
        for t in seq:
            data = tpls[t].packet(7)  # kept for a resend after reconnect
            oa.packet(t, tpls[t], 7, data)

    used = {book.alias[t]: t for t in seq[:256]}  # a 256-message run over every topic

    def member_check() -> None:  # a fan-out member: may it share the run's bytes?
        knows = oa.knows
        for _ in range(n // 256):
            knows(used)

    for name, fn in [("qos0 v5 plain", qos0_plain), ("qos0 v5 alias", qos0_alias),
                     ("qos1 v5 plain", qos1_plain), ("qos1 v5 alias", qos1_alias),
                     ("fan-out member check, per message", member_check)]:  # fmt: skip
        best = min(_timed(fn) for _ in range(21))  # best of 21: a shared machine
        print(f"{name}: {best / n * 1e6:.3f} us per message")


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default="bytes,fanout,fanin")
    ap.add_argument("--shape", choices=("serve", "split"), default="serve")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--messages", type=int, default=10_000, help="published per run")
    ap.add_argument("--fan-messages", type=int, default=30_000, help="published per fan run")
    ap.add_argument("--topics", type=int, default=100)
    ap.add_argument("--alias-max", type=int, default=100, help="the alias runs' Topic Alias Max")
    ap.add_argument("--subscribers", type=int, default=20, help="fanout")
    ap.add_argument("--publishers", type=int, default=10, help="fanin")
    ap.add_argument("--out", default="", help="append the JSON lines here too")
    ap.add_argument("--micro", action="store_true", help="only the in-process encode step")
    args = ap.parse_args()
    if args.micro:
        micro(topics=args.topics)
        return 0
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as t:
        for scenario in args.scenarios.split(","):
            for _ in range(args.repeat):
                for alias in (False, True):
                    r = run(scenario, alias, args, Path(t))
                    r["shape"] = args.shape
                    print(json.dumps(r), flush=True)
                    rows.append(r)
                    if args.out:
                        with open(args.out, "a") as f:
                            f.write(json.dumps(r) + "\n")
    print(
        f"\n| {args.shape} | plain: B/msg, msgs/s, CPU us/msg | alias: B/msg, msgs/s, CPU us/msg |"
    )
    print("|---|---:|---:|")
    for scenario in args.scenarios.split(","):
        cells = []
        for mode in ("plain", "alias"):
            rs = [r for r in rows if r["scenario"] == scenario and r["mode"] == mode]
            b = statistics.median(r["bytes_per_msg"] for r in rs)
            m = statistics.median(r["msgs_per_s"] for r in rs)
            c = statistics.median(r["cpu_us_per_msg"] for r in rs)
            cells.append(f"{b:.1f} / {m:,.0f} / {c:.1f}")
        print(f"| {scenario} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
