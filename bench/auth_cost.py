"""What proving identity costs: CONNECT rate and gateway CPU per CONNECT and per published message,
for each way a client can log in, against a fresh `lightgate serve` per (mode, repeat), modes
rotated per repeat so no mode always runs first on a warm or cold machine.

Modes (every authenticated client may write `bench/#` and nothing else):
- `anonymous`: no users, no ACL (the baseline: the publish fast path);
- `passwd`: password_file (PBKDF2-SHA512, 4,096 iterations, run in a thread) + acl_file;
- `jwt-hs256`, `jwt-es256`: a token as the password, with `{"pub": ["bench/#"]}` as its ACL claim;
- `http`: the auth hook (auth_http_connect_url + auth_http_acl_url) served by an aiohttp service
  in this process (its CPU is not counted as the gateway's; it shares the machine).

The client is a raw asyncio MQTT 3.1.1 client: `--connects` CONNECT/CONNACK/DISCONNECT with
`--concurrency` in flight, each a new client id (no cache helps the hook); then one connection
publishes `--messages` QoS 0 PUBLISHes to 10 topics and a PINGREQ whose PINGRESP says the
gateway has handled them all. CPU is the gateway process's utime+stime from /proc.

Run from the repository root: .venv/bin/python bench/security_cost.py --auth --repeat 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from auth_helpers import HS_SECRET, WebServer, ec_key, jwk_of, token  # noqa: E402

from store.auth import PasswordFile  # noqa: E402

MODES = ["anonymous", "passwd", "jwt-hs256", "jwt-es256", "http"]
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _remaining(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _s(b: bytes) -> bytes:
    return struct.pack(">H", len(b)) + b


def connect_packet(cid: str, user: str | None, password: str | None) -> bytes:
    flags = 0x02 | (0x80 if user is not None else 0) | (0x40 if password is not None else 0)
    body = _s(b"MQTT") + bytes((4, flags)) + struct.pack(">H", 60) + _s(cid.encode())
    if user is not None:
        body += _s(user.encode())
    if password is not None:
        body += _s(password.encode())
    return b"\x10" + _remaining(len(body)) + body


def publish_packet(topic: str, payload: bytes) -> bytes:
    body = _s(topic.encode()) + payload
    return b"\x30" + _remaining(len(body)) + body


class Mode:
    """A gateway configured for one mode and the credentials its clients send."""

    def __init__(self, name: str, tmp: Path, hook: WebServer) -> None:
        self.name = name
        self.args: list[str] = [
            "--set",
            "allow_anonymous=" + ("true" if name == "anonymous" else "false"),
        ]
        self.user: str | None = "bench"
        self.password: str | None = None
        if name == "anonymous":
            self.user = None
        elif name == "passwd":
            pw = PasswordFile()
            pw.set("bench", "bench-password")
            pw.save(tmp / "passwd")
            (tmp / "acl").write_text("user bench\ntopic write bench/#\n")
            self.args += ["--set", f"password_file={tmp / 'passwd'}",
                          "--set", f"acl_file={tmp / 'acl'}"]  # fmt: skip
            self.password = "bench-password"
        elif name.startswith("jwt"):
            rights = {"pub": ["bench/#"]}
            if name == "jwt-hs256":
                (tmp / "secret").write_bytes(HS_SECRET)
                self.args += ["--set", f"auth_jwt_secret_file={tmp / 'secret'}"]
                self.password = token(HS_SECRET, "HS256", sub="bench", ttl=3600, acl=rights)
            else:
                key = ec_key()
                (tmp / "jwks.json").write_text(json.dumps({"keys": [jwk_of(key, "e1")]}))
                self.args += ["--set", f"auth_jwt_key_file={tmp / 'jwks.json'}"]
                self.password = token(key, "ES256", sub="bench", ttl=3600, kid="e1", acl=rights)
        elif name == "http":
            self.args += ["--set", f"auth_http_connect_url={hook.url('/auth')}",
                          "--set", f"auth_http_acl_url={hook.url('/acl')}"]  # fmt: skip
            self.password = "bench-password"


async def connect_one(port: int, cid: str, mode: Mode) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_packet(cid, mode.user, mode.password))
    ack = await reader.readexactly(4)
    if ack[3] != 0:
        raise SystemExit(f"{mode.name}: CONNACK {ack[3]:#x} for {cid}")
    writer.write(b"\xe0\x00")
    writer.close()
    await writer.wait_closed()


async def connect_storm(port: int, mode: Mode, count: int, concurrency: int) -> float:
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            await connect_one(port, f"{mode.name}-{i}", mode)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    return time.perf_counter() - t0


async def publish_run(port: int, mode: Mode, messages: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(connect_packet(f"{mode.name}-pub", mode.user, mode.password))
    ack = await reader.readexactly(4)
    assert ack[3] == 0, ack
    packets = [publish_packet(f"bench/t{i}", b"x" * 64) for i in range(10)]
    chunk = b"".join(packets * 100)  # 1,000 messages
    for _ in range(messages // 1000):
        writer.write(chunk)
        await writer.drain()
    writer.write(b"\xc0\x00")  # PINGREQ: its PINGRESP comes after every PUBLISH before it
    while (await reader.readexactly(2)) != b"\xd0\x00":
        pass
    writer.write(b"\xe0\x00")
    writer.close()


def serve(tmp: Path, mode: Mode, port: int) -> subprocess.Popen[bytes]:
    data = tmp / f"data-{mode.name}-{time.monotonic_ns()}"
    args = ["--data-dir", str(data), "--mqtt-port", str(port), "--mqtts-port", "-1",
            "--ws-port", "-1", "--wss-port", "-1", "--kafka-port", "-1", "--kafka-tls-port", "-1",
            "--http-port", "-1", "--set", "log_level=warning", "--set", "sys_interval_s=0",
            "--set", "probe_interval_ms=0", "--set", "max_connection_rate=0", *mode.args]  # fmt: skip
    proc = subprocess.Popen([str(ROOT / ".venv/bin/lightgate"), "serve", *args],
                            stdout=subprocess.PIPE, cwd=ROOT)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("lightgate ready"):
        proc.kill()
        raise SystemExit(f"{mode.name}: gateway did not start: {line!r}")
    return proc


def run_one(tmp: Path, mode: Mode, port: int, ns: argparse.Namespace) -> dict[str, Any]:
    proc = serve(tmp, mode, port)
    try:
        asyncio.run(connect_storm(port, mode, 50, 10))  # warm up (imports, first JWKS use)
        c0 = cpu_s(proc.pid)
        wall = asyncio.run(connect_storm(port, mode, ns.connects, ns.concurrency))
        c1 = cpu_s(proc.pid)
        asyncio.run(publish_run(port, mode, 10_000))  # warm up: topics cached, log open
        c2 = cpu_s(proc.pid)
        t0 = time.perf_counter()
        asyncio.run(publish_run(port, mode, ns.messages))
        pub_wall = time.perf_counter() - t0
        c3 = cpu_s(proc.pid)
        return {
            "mode": mode.name,
            "connects_per_s": ns.connects / wall,
            "cpu_ms_per_connect": (c1 - c0) * 1000 / ns.connects,
            "publish_msgs_per_s": ns.messages / pub_wall,
            "cpu_us_per_msg": (c3 - c2) * 1e6 / ns.messages,
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=18860)
    ap.add_argument("--connects", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "auth-cost.jsonl"))
    ns = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lg-auth-"))
    hook = WebServer().start()

    async def allow(_request: Any) -> Any:
        from aiohttp import web

        return web.json_response({"result": "allow"})

    hook.routes["/auth"] = hook.routes["/acl"] = allow
    names = ns.modes.split(",")
    rows: dict[str, list[dict[str, Any]]] = {}
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(ns.out, "a") as fh:
            for r in range(ns.repeat):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    d = tmp / f"{name}-{r}"
                    d.mkdir()
                    res = run_one(d, Mode(name, d, hook), ns.port, ns)
                    res["repeat"] = r
                    fh.write(json.dumps(res) + "\n")
                    rows.setdefault(name, []).append(res)
                    print(f"{name:10} {res['connects_per_s']:8.0f} CONNECT/s "
                          f"{res['cpu_ms_per_connect']:6.2f} ms CPU/CONNECT "
                          f"{res['publish_msgs_per_s']:9.0f} msg/s "
                          f"{res['cpu_us_per_msg']:6.2f} us CPU/msg", flush=True)  # fmt: skip
    finally:
        hook.stop()
    print(
        "\n| mode | CONNECT/s | gateway CPU ms per CONNECT | publish msg/s | gateway CPU us per msg |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in names:
        rs = rows.get(name, [])
        if not rs:
            continue

        def med(k: str, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median(float(x[k]) for x in rs)

        print(f"| {name} | {med('connects_per_s'):,.0f} | {med('cpu_ms_per_connect'):.2f} | "
              f"{med('publish_msgs_per_s'):,.0f} | {med('cpu_us_per_msg'):.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
