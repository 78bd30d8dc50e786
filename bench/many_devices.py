"""The workload a fleet sends: many devices, each on its own connection and topic at a low fixed
rate, each read by its own application, Lightgate and Mosquitto side by side in one run.

Ten busy sockets hand a broker ready-made batches; a fleet does not. Here every device
(`fleet/dev<i>/data`) publishes alone on its own connection, at `--rate` msg/s (QoS 1 by
default), with starts spread evenly over the period, and application i subscribes to device i's
topic only (the "point to point" scenario of public broker comparisons). Each 64-byte payload
carries its send time on CLOCK_MONOTONIC (system-wide on Linux), so latency publish -> deliver is
read in whichever process receives it.

Load comes from `--workers` processes (fork), each an asyncio loop (uvloop when installed) of raw
MQTT 3.1.1 clients on Protocols (paho costs too much per client for thousands of them).
Connections spread over loopback source addresses 127.0.0.2, 127.0.0.3, ... (one per ~25k
connections, `--source-ips`), as one source address has ~28k ephemeral ports.

Each round starts every broker afresh, the order rotating per round: Lightgate by
`bench/mqtt_serve.sh` (defaults: every message persisted, default fsync), Mosquitto with a
generated config (loopback listener on a free port, anonymous, `max_connections -1`, no
persistence). Brokers get the highest RLIMIT_NOFILE allowed (`ulimit -n` raised to the hard
limit in their wrapper shell) and are stopped by PID.

Reported per broker and round: published / delivered (counted over the whole run plus the
drain: every message delivered?), broker CPU (utime + stime of its process tree, /proc) per
delivered message over the measured window only (not the connect phase or warmup), p50/p99/max
latency of messages sent inside the window, broker RSS (process tree) at the end of the window,
the time to connect all clients (and the broker's CPU per connect), and the load generator's own
CPU (per worker: above ~90 % of a core, the generator, not the broker, sets the pace:
`loadgen_bound`). One JSON line per run goes to bench/results/many-devices-<date>.jsonl
(git-ignored) and a table (median over rounds) to stdout.

Usage (from the repository root):
    .venv/bin/python bench/many_devices.py --devices 5000 --rate 2      # the main figure
    .venv/bin/python bench/many_devices.py --devices 500 --rounds 3
    .venv/bin/python bench/many_devices.py --lone      # 1 device at 1 msg/s (cf. lone_message.py)
  options: --brokers lightgate,mosquitto  --rounds R  --duration S  --warmup S  --drain S
           --qos 0|1  --payload 64  --workers W  --source-ips N  --serve-args "--set k=v ..."
Limits: each connection is one file descriptor in the broker, so devices + applications must stay
below the hard RLIMIT_NOFILE (`ulimit -Hn`; 20000 in the sandbox this was written in: 10,000
devices + 10,000 applications does not fit there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import resource
import signal
import socket
import statistics
import struct
import subprocess
import tempfile
import time
from array import array
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")
KEEPALIVE = 600  # s: applications only receive, and the connect phase may take a while
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux
STAMP = struct.Struct(">QI")  # send time (CLOCK_MONOTONIC ns), device index


# ---- MQTT 3.1.1 encoding: only what a device and an application send -------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + _varint(len(body)) + body


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def connect_packet(client_id: str) -> bytes:
    return _packet(
        0x10, _str("MQTT") + bytes([4, 0x02]) + struct.pack(">H", KEEPALIVE) + _str(client_id)
    )


def subscribe_packet(topic: str, qos: int) -> bytes:
    return _packet(0x82, struct.pack(">H", 1) + _str(topic) + bytes([qos]))


def topic_of(i: int) -> str:
    return f"fleet/dev{i}/data"


# ---- clients -------------------------------------------------------------------------------------


class Counters:
    """One worker's tallies; `window_*` only for messages whose send time falls in the window."""

    def __init__(self) -> None:
        self.sent = self.acked = self.delivered = self.sent_window = 0
        self.latency_us = array("q")
        self.window = (0, 0)  # monotonic ns [start, end)
        self.errors: list[str] = []


class Client(asyncio.Protocol):
    """A 3.1.1 client that walks fixed headers only: CONNACK and SUBACK resolve `ready`; a
    PUBLISH is timed from its payload and, at QoS 1, PUBACKed; a PUBACK is counted."""

    def __init__(
        self, counters: Counters, hello: bytes, acks_due: int, ready: asyncio.Future[None]
    ) -> None:
        self.c = counters
        self.hello = hello  # CONNECT (+ SUBSCRIBE)
        self.acks_due = acks_due  # CONNACK (+ SUBACK) before ready
        self.ready = ready
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it
        sock = transport.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.write(self.hello)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.ready.done():
            self.ready.set_exception(ConnectionError(f"closed before ready: {exc}"))

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, end = 0, len(buf)
        acks: list[bytes] = []
        while pos + 2 <= end:
            first = buf[pos]
            length, shift, i = 0, 0, pos + 1
            while i < end:
                b = buf[i]
                length |= (b & 0x7F) << shift
                i += 1
                if not b & 0x80:
                    break
                shift += 7
            else:
                break  # length bytes incomplete
            if i + length > end:
                break
            kind = first >> 4
            if kind == 3:  # PUBLISH
                at = i + 2 + ((buf[i] << 8) | buf[i + 1])
                if first & 0x06:
                    acks.append(b"\x40\x02" + buf[at : at + 2])
                    at += 2
                sent = STAMP.unpack_from(buf, at)[0]
                self.c.delivered += 1
                lo, hi = self.c.window
                if lo <= sent < hi:
                    self.c.latency_us.append((time.monotonic_ns() - sent) // 1000)
            elif kind == 4:  # PUBACK
                self.c.acked += 1
            elif kind in (2, 9):  # CONNACK, SUBACK
                if kind == 2 and buf[i + 1] != 0:
                    self.c.errors.append(f"CONNACK refused: {buf[i + 1]}")
                if kind == 9 and buf[i + 2] == 0x80:
                    self.c.errors.append("SUBACK refused")
                self.acks_due -= 1
                if self.acks_due == 0 and not self.ready.done():
                    self.ready.set_result(None)
            pos = i + length
        self.buf = buf[pos:]
        if acks and self.transport is not None:
            self.transport.write(b"".join(acks))


async def open_client(
    port: int, source: str, counters: Counters, hello: bytes, acks_due: int, timeout: float
) -> Client:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    # a socket of our own: create_connection(host, local_addr=...) would resolve both addresses
    # in the loop's thread pool for every connection
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        # the port is chosen at connect() (per 4-tuple): bind() picking it walks every bound port
        sock.setsockopt(socket.SOL_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source, 0))
        await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", port)), timeout)
        _, proto = await loop.create_connection(
            lambda: Client(counters, hello, acks_due, ready), sock=sock
        )
    except BaseException:
        sock.close()
        raise
    await asyncio.wait_for(ready, timeout)
    return proto


# ---- one worker process ------------------------------------------------------------------------


async def worker_main(spec: dict[str, Any], pipe: Connection) -> None:
    """Connects its applications then its devices, reports, then publishes on the coordinator's
    schedule: device i sends at t0 + phase_i + k / rate, phase_i = i / devices of a period."""
    c = Counters()
    port, qos, devices = spec["port"], spec["qos"], spec["devices"]
    mine: list[int] = spec["indexes"]
    sources: list[str] = spec["sources"]
    sem = asyncio.Semaphore(spec["connect_parallel"])
    connack_ms = array("d")

    async def connect(hello: bytes, acks_due: int, n: int) -> Client:
        async with sem:
            t = time.monotonic()
            cl = await open_client(port, sources[n % len(sources)], c, hello, acks_due, 60)
            connack_ms.append((time.monotonic() - t) * 1000)
            return cl

    t_connect = time.monotonic()
    apps = await asyncio.gather(
        *(
            connect(connect_packet(f"app{i}") + subscribe_packet(topic_of(i), qos), 2, 2 * i)
            for i in mine
        ),
        return_exceptions=True,
    )
    devs = await asyncio.gather(
        *(connect(connect_packet(f"dev{i}"), 1, 2 * i + 1) for i in mine),
        return_exceptions=True,
    )
    failed = [x for x in (*apps, *devs) if isinstance(x, BaseException)]
    pipe.send(
        {
            "connected": len(apps) + len(devs) - len(failed),
            "failed": len(failed),
            "first_error": repr(failed[0]) if failed else "",
            "connect_s": time.monotonic() - t_connect,
            "connack_ms": sorted(connack_ms),
        }
    )
    plan = pipe.recv()  # {"t0", "w0", "w1", "stop", "drain"} on CLOCK_MONOTONIC (s)
    c.window = (int(plan["w0"] * 1e9), int(plan["w1"] * 1e9))
    period = 1.0 / spec["rate"]
    pad = b"\0" * (spec["payload"] - STAMP.size)
    live = [(i, d) for i, d in zip(mine, devs, strict=True) if isinstance(d, Client)]
    live.sort(key=lambda x: x[0])
    headers = []
    for i, _ in live:
        topic = _str(topic_of(i))
        rest = len(topic) + (2 if qos else 0) + spec["payload"]
        headers.append(bytes([0x30 | (qos << 1)]) + _varint(rest) + topic)
    phases = [plan["t0"] + period * i / devices for i, _ in live]
    pids = [0] * len(live)
    k, j, n = 0, 0, len(live)
    w0_ns, w1_ns = c.window
    while n:
        due = phases[j] + k * period
        if due >= plan["stop"]:
            break
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        # everything due by now, in phase order
        now = time.monotonic()
        while True:
            i, cl = live[j]
            if cl.transport is not None and not cl.closed:
                stamp = time.monotonic_ns()
                if qos:
                    pids[j] = pids[j] % 65535 + 1
                    body = struct.pack(">H", pids[j]) + STAMP.pack(stamp, i) + pad
                else:
                    body = STAMP.pack(stamp, i) + pad
                cl.transport.write(headers[j] + body)
                c.sent += 1
                if w0_ns <= stamp < w1_ns:
                    c.sent_window += 1
            j += 1
            if j == n:
                j, k = 0, k + 1
            if phases[j] + k * period > now:
                break
    await asyncio.sleep(max(0.0, plan["stop"] + plan["drain"] - time.monotonic()))
    for x in (*apps, *devs):
        if isinstance(x, Client) and x.transport is not None:
            x.transport.write(b"\xe0\x00")
            x.transport.close()
    pipe.send(
        {
            "sent": c.sent,
            "sent_window": c.sent_window,
            "acked": c.acked,
            "delivered": c.delivered,
            "latency_us": c.latency_us.tobytes(),
            "errors": c.errors[:5],
        }
    )


def worker_entry(spec: dict[str, Any], pipe: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        uvloop.run(worker_main(spec, pipe))
    except ImportError:
        asyncio.run(worker_main(spec, pipe))


# ---- /proc -------------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                children.setdefault(int(_stat(int(name))[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_s(pids: list[int]) -> float:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            f = _stat(p)
            total += int(f[11]) + int(f[12])
    return total / TICK


def rss_kb(pids: list[int]) -> int:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            total += int(_stat(p)[21]) * PAGE // 1024
    return total


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK  # all but idle and iowait


# ---- brokers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_broker(
    kind: str, port: int, workdir: Path, serve_args: list[str]
) -> subprocess.Popen[bytes]:
    """A fresh broker on 127.0.0.1:port with the highest fd limit allowed; its PID is the
    broker's own (the wrapper shell execs it)."""
    if kind == "mosquitto":
        conf = workdir / "mosquitto.conf"
        conf.write_text(
            f"per_listener_settings false\nlistener {port} 127.0.0.1\nallow_anonymous true\n"
            "max_connections -1\npersistence false\nlog_dest stderr\nlog_type error\n"
            "connection_messages false\n"
        )
        cmd = f"exec mosquitto -c {conf}"
    elif kind == "lightgate":
        extra = " ".join(serve_args)
        cmd = f"exec bash {ROOT}/bench/mqtt_serve.sh {port} {workdir}/data {extra}"
    else:
        raise SystemExit(f"unknown broker {kind!r}")
    log = open(workdir / f"{kind}.log", "wb")  # noqa: SIM115 (lives as long as the broker)
    proc = subprocess.Popen(
        ["bash", "-c", f"ulimit -n $(ulimit -Hn); {cmd}"], stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind} exited: {(workdir / f'{kind}.log').read_text()[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return proc
        time.sleep(0.1)
    stop_broker(proc)
    raise RuntimeError(f"{kind} did not listen on {port} within 60 s")


def stop_broker(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---- one run -----------------------------------------------------------------------------------


def pct(sorted_vals: list[int] | list[float], q: float) -> float:
    if not sorted_vals:
        return float("nan")
    return float(sorted_vals[min(len(sorted_vals) - 1, int(q * len(sorted_vals)))])


def sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.monotonic()))


def run_once(args: argparse.Namespace, kind: str, rnd: int) -> dict[str, Any]:
    port = free_port()
    conns = 2 * args.devices
    n_src = args.source_ips or max(1, -(-conns // 25000))
    sources = [f"127.0.0.{2 + k}" for k in range(n_src)]
    workers = max(1, min(args.workers, args.devices))
    with tempfile.TemporaryDirectory(prefix=f"many-devices-{kind}-") as tmp:
        broker = start_broker(kind, port, Path(tmp), args.serve_args.split())
        procs: list[mp.process.BaseProcess] = []
        try:
            bpids = process_tree(broker.pid)
            ctx = mp.get_context("fork")
            pipes: list[Connection] = []
            cpu_b0, t_c0 = cpu_s(bpids), time.monotonic()
            for w in range(workers):
                here, there = ctx.Pipe()
                spec = {
                    "port": port,
                    "qos": args.qos,
                    "rate": args.rate,
                    "payload": args.payload,
                    "devices": args.devices,
                    "indexes": list(range(w, args.devices, workers)),
                    "sources": sources,
                    "connect_parallel": args.connect_parallel,
                }
                p = ctx.Process(target=worker_entry, args=(spec, there), daemon=True)
                p.start()
                procs.append(p)
                pipes.append(here)
            ready = [recv_within(pp, 60 + conns / 200) for pp in pipes]
            connect_s = time.monotonic() - t_c0
            bpids = process_tree(broker.pid)
            cpu_connect = cpu_s(bpids) - cpu_b0
            t0 = time.monotonic() + 0.5
            plan = {
                "t0": t0,
                "w0": t0 + args.warmup,
                "w1": t0 + args.warmup + args.duration,
                "stop": t0 + args.warmup + args.duration,
                "drain": args.drain,
            }
            for pp in pipes:
                pp.send(plan)
            gpids = [p.pid for p in procs if p.pid]
            sleep_until(plan["w0"])
            b0, g0, m0 = cpu_s(bpids), [cpu_s([g]) for g in gpids], machine_busy_s()
            sleep_until(plan["w1"])
            b1, g1, m1 = cpu_s(bpids), [cpu_s([g]) for g in gpids], machine_busy_s()
            rss = rss_kb(process_tree(broker.pid))
            done = [recv_within(pp, args.drain + 60) for pp in pipes]
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
            stop_broker(broker)
    lat = sorted(x for d in done for x in array("q", d["latency_us"]))
    connack = sorted(x for r in ready for x in r["connack_ms"])
    sent = sum(d["sent"] for d in done)
    delivered = sum(d["delivered"] for d in done)
    sent_window = sum(d["sent_window"] for d in done)
    window_delivered = len(lat)
    broker_cpu = b1 - b0
    gen_cpu = [b - a for a, b in zip(g0, g1, strict=True)]
    busy = m1 - m0
    return {
        "bench": "many_devices",
        "broker": kind,
        "round": rnd,
        "ts": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "devices": args.devices,
        "applications": args.devices,
        "rate_per_device": args.rate,
        "qos": args.qos,
        "payload": args.payload,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "workers": workers,
        "source_ips": n_src,
        "connected": sum(r["connected"] for r in ready),
        "connect_failed": sum(r["failed"] for r in ready),
        "connect_error": next((r["first_error"] for r in ready if r["first_error"]), ""),
        "connect_s": round(connect_s, 3),
        "connack_p50_ms": round(pct(connack, 0.5), 3),
        "connack_p99_ms": round(pct(connack, 0.99), 3),
        "broker_cpu_us_per_connect": round(cpu_connect * 1e6 / max(1, conns), 1),
        "published": sent,
        "acked": sum(d["acked"] for d in done),
        "delivered": delivered,
        "delivered_ratio": round(delivered / sent, 6) if sent else None,
        "published_in_window": sent_window,
        "delivered_of_window": window_delivered,
        "msgs_per_s": round(window_delivered / args.duration, 1),
        "broker_cpu_pct": round(100 * broker_cpu / args.duration, 1),
        "broker_cpu_us_per_msg": round(broker_cpu * 1e6 / window_delivered, 1)
        if window_delivered
        else None,
        "lat_p50_ms": round(pct(lat, 0.5) / 1000, 3),
        "lat_p99_ms": round(pct(lat, 0.99) / 1000, 3),
        "lat_max_ms": round(lat[-1] / 1000, 3) if lat else None,
        "broker_rss_kb": rss,
        "loadgen_cpu_pct": round(100 * sum(gen_cpu) / args.duration, 1),
        "worker_cpu_pct": [round(100 * x / args.duration, 1) for x in gen_cpu],
        "loadgen_bound": any(x / args.duration > 0.9 for x in gen_cpu),
        "other_cpu_pct": round(100 * (busy - broker_cpu - sum(gen_cpu)) / args.duration, 1),
        "errors": [e for d in done for e in d["errors"]][:5],
    }


def recv_within(pipe: Connection, timeout: float) -> dict[str, Any]:
    if not pipe.poll(timeout):
        raise RuntimeError(f"a load worker did not answer within {timeout:.0f} s")
    msg: dict[str, Any] = pipe.recv()
    return msg


# ---- main --------------------------------------------------------------------------------------

COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("delivered/published", "delivered_ratio", lambda v: f"{v:.4f}" if v is not None else "-"),
    ("msg/s", "msgs_per_s", lambda v: f"{v:,.0f}"),
    ("broker CPU µs/msg", "broker_cpu_us_per_msg", lambda v: f"{v:.1f}" if v else "-"),
    ("broker CPU %", "broker_cpu_pct", lambda v: f"{v:.1f}"),
    ("p50 ms", "lat_p50_ms", lambda v: f"{v:.2f}"),
    ("p99 ms", "lat_p99_ms", lambda v: f"{v:.2f}"),
    ("max ms", "lat_max_ms", lambda v: f"{v:.1f}" if v is not None else "-"),
    ("RSS MB", "broker_rss_kb", lambda v: f"{v / 1024:.0f}"),
    ("connect s", "connect_s", lambda v: f"{v:.1f}"),
    ("µs/connect", "broker_cpu_us_per_connect", lambda v: f"{v:.0f}"),
    ("loadgen CPU %", "loadgen_cpu_pct", lambda v: f"{v:.0f}"),
    ("other CPU %", "other_cpu_pct", lambda v: f"{v:.0f}"),
]


def table(rows: list[dict[str, Any]], brokers: list[str]) -> str:
    head = "| broker (median of rounds) | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for b in brokers:
        mine = [r for r in rows if r["broker"] == b]
        if not mine:
            continue
        cells = []
        for _, key, fmt in COLUMNS:
            vals = [r[key] for r in mine if r[key] is not None]
            cells.append(fmt(statistics.median(vals)) if vals else "-")
        lines.append(f"| {b} ({len(mine)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--devices", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=2.0, help="msg/s per device")
    ap.add_argument("--lone", action="store_true", help="1 device at 1 msg/s")
    ap.add_argument("--qos", type=int, choices=(0, 1), default=1)
    ap.add_argument("--payload", type=int, default=64)
    ap.add_argument("--brokers", default="lightgate,mosquitto")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--duration", type=float, default=20.0, help="measured window (s)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--drain", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2, help="load generator processes")
    ap.add_argument("--source-ips", type=int, default=0, help="0: one per 25k connections")
    ap.add_argument("--connect-parallel", type=int, default=100, help="per worker")
    ap.add_argument("--serve-args", default="", help="extra `lightgate serve` arguments")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.lone:
        args.devices, args.rate = 1, 1.0
    if args.payload < STAMP.size:
        raise SystemExit(f"--payload must be at least {STAMP.size}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if 2 * args.devices + 100 > hard:
        print(f"warning: {2 * args.devices} connections and a hard fd limit of {hard}")
    brokers = args.brokers.split(",")
    out = args.out or ROOT / "bench" / "results" / f"many-devices-{dt.date.today()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(args.rounds):
        for k in range(len(brokers)):
            kind = brokers[(k + rnd) % len(brokers)]  # whoever goes first rotates
            row = run_once(args, kind, rnd)
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"round {rnd} {kind}: delivered {row['delivered']}/{row['published']}, "
                f"{row['broker_cpu_us_per_msg']} µs/msg, p99 {row['lat_p99_ms']} ms, "
                f"connect {row['connect_s']} s ({row['connect_failed']} failed), "
                f"loadgen {row['worker_cpu_pct']} %, other {row['other_cpu_pct']} %",
                flush=True,
            )
    print(
        f"\n{args.devices} devices + {args.devices} applications, {args.rate:g} msg/s each, "
        f"QoS {args.qos}, {args.payload} B, {args.duration:g} s window; raw lines: {out}\n"
    )
    print(table(rows, brokers))


if __name__ == "__main__":
    main()
