"""`log = "kafka"`: MQTT through Lightgate into a Kafka cluster vs. a producer straight
into it, and the offline drain of 100k messages, in one run against one Tansu broker.

    .venv/bin/python bench/kafka_log_bench.py --duration 10 --drain 100000

1. ceiling: aiokafka producers (acks=all, 64-byte values, keyed like MQTT records) straight into
   the cluster, `send()` per message and `send_batch()` of 1000; what one Python client gets.
2. fan-in: bench/mqttbench fanin, 10 publishers, QoS 1 (window 100) and QoS 0, through
   `lightgate serve --set log=kafka` (and the same against `log = "local"` for reference).
3. drain: a persistent session subscribes, goes away, 100k QoS 1 messages are published, the
   session comes back; time until the last message arrives, and the Fetch requests it cost.
Prints one JSON line per measurement and `uptime` before and after (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tansu import start_tansu  # noqa: E402 - the tests' Tansu starter

PY = sys.executable


def out(rec: dict[str, object]) -> None:
    print(json.dumps(rec), flush=True)


async def ceiling(bootstrap: str, seconds: float, batch: bool) -> float:
    from aiokafka import AIOKafkaProducer

    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
    await p.start()
    topic = "ceiling_batch" if batch else "ceiling"
    value = b"x" * 64
    n = 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            if batch:
                futs = []
                for part in range(4):
                    b = p.create_batch()
                    ts = int(time.time() * 1000)
                    for i in range(250):
                        b.append(key=f"{topic}/d{i % 10}".encode(), value=value, timestamp=ts,
                                 headers=[("mqtt.qos", b"1"), ("mqtt.client_id", b"c")])  # fmt: skip
                    b.close()
                    futs.append(await p.send_batch(b, topic, partition=part))
                await asyncio.gather(*futs)
                n += 1000
            else:
                futs = [
                    await p.send(
                        topic,
                        value,
                        key=f"{topic}/d{i % 10}".encode(),
                        headers=[("mqtt.qos", b"1"), ("mqtt.client_id", b"c")],
                    )  # fmt: skip
                    for i in range(1000)
                ]
                await asyncio.gather(*futs)
                n += 1000
        return n / (time.perf_counter() - t0)
    finally:
        await p.stop()


def serve(data: Path, bootstrap: str | None) -> tuple[subprocess.Popen[bytes], int, int]:
    args = [PY, "-m", "lightgate", "serve", "--data-dir", str(data), "--mqtt-port", "0",
            "--ws-port", "-1", "--mqtts-port", "-1", "--wss-port", "-1", "--kafka-port", "-1",
            "--http-port", "0", "--set", "log_level=warning", "--set", "probe_interval_ms=0"]  # fmt: skip
    if bootstrap:
        args += ["--set", "log=kafka", "--set", f"kafka_bootstrap={bootstrap}",
                 "--set", "kafka_client_enable_idempotence=false"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    ports = dict(w.split("=", 1) for w in line.split()[2:])
    return proc, int(ports["mqtt"].rsplit(":", 1)[1]), int(ports["http"].rsplit(":", 1)[1])


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def mqttbench(port: int, pid: int, label: str, qos: int, seconds: float) -> dict[str, object]:
    cmd = [PY, str(ROOT / "bench/mqttbench/mqttbench.py"), "--port", str(port), "--broker-pid",
           str(pid), "--label", label, "--duration", str(seconds), "fanin", "--publishers", "10",
           "--qos", str(qos)]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    rec: dict[str, object] = json.loads(res.stdout.strip().splitlines()[-1])
    return rec


# --- a raw MQTT 3.1.1 client for the drain: connect, subscribe, count PUBLISHes, PUBACK them --------


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def _pkt(t: int, body: bytes) -> bytes:
    n, enc = len(body), b""
    while True:
        d, n = n % 128, n // 128
        enc += bytes([d | (0x80 if n else 0)])
        if not n:
            return bytes([t]) + enc + body


def connect(port: int, cid: str, clean: bool) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    flags = 0x02 if clean else 0x00
    s.sendall(_pkt(0x10, _str("MQTT") + bytes([4, flags]) + struct.pack(">H", 600) + _str(cid)))
    assert s.recv(4)[:1] == b"\x20"
    return s


def drain_count(s: socket.socket, n: int, timeout: float) -> tuple[int, float]:
    """Read PUBLISHes until `n` arrived (QoS 1: PUBACK each); (count, seconds)."""
    t0 = time.perf_counter()
    buf = bytearray()
    got = 0
    s.settimeout(timeout)
    while got < n:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        buf += chunk
        i, acks = 0, []
        while True:
            if len(buf) - i < 2:
                break
            mult, ln, j = 1, 0, i + 1
            while j < len(buf):
                b = buf[j]
                ln += (b & 0x7F) * mult
                mult *= 128
                j += 1
                if not b & 0x80:
                    break
            else:
                break
            if j + ln > len(buf):
                break
            if buf[i] >> 4 == 3:
                got += 1
                if buf[i] & 0x06:
                    tl = struct.unpack_from(">H", buf, j)[0]
                    acks.append(b"\x40\x02" + bytes(buf[j + 2 + tl : j + 4 + tl]))
            i = j + ln
        del buf[:i]
        if acks:
            s.sendall(b"".join(acks))
    return got, time.perf_counter() - t0


def metric(http: int, name: str) -> float:
    """A family's value summed over its series (labels), -1 when /metrics has none."""
    total, seen = 0.0, False
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith((name + " ", name + "{")):
                total += float(line.rsplit(" ", 1)[1])
                seen = True
    return total if seen else -1.0


def drain(bootstrap: str | None, n: int, tmp: Path, label: str, cold: bool) -> None:
    """`cold`: the node restarts between publish and drain, so nothing is in its memory."""
    data = tmp / f"drain-{label}-{'cold' if cold else 'warm'}"
    proc, port, http = serve(data, bootstrap)
    try:
        s = connect(port, "drainer", clean=False)
        s.sendall(_pkt(0x82, struct.pack(">H", 1) + _str("drain/#") + b"\x01"))
        s.recv(5)
        s.sendall(b"\xe0\x00")
        s.close()
        p = connect(port, "pub", clean=True)
        payload = b"y" * 64
        t0 = time.perf_counter()
        for k in range(0, n, 1000):  # QoS 0 in bulk, then one QoS 1 as the fence
            p.sendall(b"".join(_pkt(0x30, _str(f"drain/{i % 10}") + payload)
                               for i in range(k, min(n, k + 1000))))  # fmt: skip
        p.sendall(_pkt(0x32, _str("drain/fence") + struct.pack(">H", 1) + payload))
        p.settimeout(120)
        while p.recv(4)[:1] != b"\x40":
            pass
        pub_s = time.perf_counter() - t0
        deadline = time.monotonic() + 120
        while metric(http, "lightgate_dispatch_lag_records") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        if cold:
            stop(proc)
            proc, port, http = serve(data, bootstrap)
        f0 = metric(http, "lightgate_kafka_log_fetches_total")
        s = connect(port, "drainer", clean=False)
        got, secs = drain_count(s, n + 1, 300)
        f1 = metric(http, "lightgate_kafka_log_fetches_total")
        out({"bench": "drain", "log": label, "cold": cold, "messages": n + 1, "received": got,
             "drain_s": round(secs, 2), "drain_msgs_per_s": round(got / secs),
             "publish_s": round(pub_s, 2),
             "fetches": None if f0 < 0 else int(f1 - f0)})  # fmt: skip
        s.close()
        p.close()
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--drain", type=int, default=100_000)
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--only-drain", action="store_true")
    a = ap.parse_args()
    out({"uptime": os.popen("uptime").read().strip()})
    # A fresh broker per scenario: a new node indexes every record already on the cluster
    # before it is ready, and the ceiling's millions of records are not what is measured.
    with tempfile.TemporaryDirectory(prefix="kafka-log-bench-") as d:
        tmp = Path(d)
        for batch in () if a.only_drain else (False, True):
            t = start_tansu(tmp)
            try:
                rate = asyncio.run(ceiling(t.bootstrap, a.duration, batch))
                out({"bench": "ceiling", "api": "send_batch" if batch else "send",
                     "msgs_per_s": round(rate)})  # fmt: skip
            finally:
                t.stop()
        for label in () if a.only_drain else ("kafka", "local"):
            if label == "local" and a.skip_local:
                continue
            for qos in (1, 0):
                t = start_tansu(tmp)
                proc, port, _http = serve(tmp / f"fanin-{label}-{qos}",
                                          t.bootstrap if label == "kafka" else None)  # fmt: skip
                try:
                    rec = mqttbench(port, proc.pid, f"lightgate-{label}", qos, a.duration)
                    out({"bench": "fanin", "log": label, "qos": qos, **{
                        k: rec.get(k) for k in ("pub_msgs_per_s", "recv_msgs_per_s",
                                                "broker_cpu_pct", "broker_cpu_us_per_msg",
                                                "other_cpu_pct", "machine_busy_pct", "ok")}})  # fmt: skip
                finally:
                    stop(proc)
                    t.stop()
        for label, cold in (("kafka", False), ("kafka", True), ("local", False), ("local", True)):
            if label == "local" and a.skip_local:
                continue
            t = start_tansu(tmp)
            try:
                drain(t.bootstrap if label == "kafka" else None, a.drain, tmp, label, cold)
            finally:
                t.stop()
    out({"uptime": os.popen("uptime").read().strip()})


if __name__ == "__main__":
    main()
