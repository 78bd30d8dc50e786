"""The pieces bench/many_devices.py and bench/connect_storm.py share: a minimal MQTT 3.1.1 client
on asyncio Protocols (cheap enough for thousands per process: it walks fixed headers only),
broker processes started afresh and stopped by PID, and their CPU and RSS from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import struct
import subprocess
import time
from array import array
from collections.abc import Callable, Coroutine
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


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, digit = n >> 7, n & 0x7F
        out.append(digit | (0x80 if n else 0))
        if not n:
            return bytes(out)


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def mqtt_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def connect_packet(client_id: str) -> bytes:
    return packet(
        0x10,
        mqtt_str("MQTT") + bytes([4, 0x02]) + struct.pack(">H", KEEPALIVE) + mqtt_str(client_id),
    )


def subscribe_packet(topic: str, qos: int) -> bytes:
    return packet(0x82, struct.pack(">H", 1) + mqtt_str(topic) + bytes([qos]))


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


# ---- /proc -------------------------------------------------------------------------------------


def proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                children.setdefault(int(proc_stat(int(name))[1]), []).append(int(name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_s(pids: list[int]) -> float:
    """CPU time (s) of these processes, all their threads, to the nanosecond: the kernel's
    per-process CPU clock (clock_getcpuclockid), as /proc's utime + stime count 10 ms ticks,
    too coarse for a broker at 1 msg/s. A process that is gone counts nothing."""
    total = 0.0
    for p in pids:
        try:
            total += time.clock_gettime(((~p) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(p, SCHED)
        except OSError:
            with contextlib.suppress(OSError):
                f = proc_stat(p)
                total += (int(f[11]) + int(f[12])) / TICK
    return total


def rss_kb(pids: list[int]) -> int:
    total = 0
    for p in pids:
        with contextlib.suppress(OSError):
            total += int(proc_stat(p)[21]) * PAGE // 1024
    return total


def machine_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / TICK  # all but idle and iowait


# ---- brokers -----------------------------------------------------------------------------------


def source_addresses(connections: int, override: int = 0) -> list[str]:
    """Loopback source addresses for `connections` client sockets (`override` of them when set):
    one per 25,000 connections, so no (source, destination) pair runs out of ephemeral ports."""
    n = override or max(1, -(-connections // 25000))
    return [f"127.0.0.{2 + k}" for k in range(n)]


def run_worker(main: Callable[[dict[str, Any], Connection], Coroutine[Any, Any, None]],
               spec: dict[str, Any], pipe: Connection) -> None:  # fmt: skip
    """A load process's body: `main(spec, pipe)` on uvloop where installed; Ctrl-C is the
    coordinator's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import uvloop  # type: ignore[import-not-found,unused-ignore]

        uvloop.run(main(spec, pipe))
    except ImportError:
        asyncio.run(main(spec, pipe))


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


def recv_within(pipe: Connection, timeout: float) -> dict[str, Any]:
    if not pipe.poll(timeout):
        raise RuntimeError(f"a load worker did not answer within {timeout:.0f} s")
    msg: dict[str, Any] = pipe.recv()
    return msg
