"""MQTT QoS 1 fan-in through one `log = "kafka"` node vs. aiokafka straight into the same
cluster, alternating in one run: the ratio the node keeps of what the cluster takes.

    .venv/bin/python bench/kafka_fanin_ratio.py --rounds 3 --duration 8

Each round runs, in alternating order and each against a fresh Tansu (memory storage):
  (a) aiokafka: one producer, acks=all (what the node's appender uses), 64-byte values keyed
      like the MQTT topics, up to 1,000 unacknowledged (the fan-in's 10 publishers x window
      100), into 4-partition topics of its own: `send()` per message (what a Kafka device
      would do), then `send_batch()` of 250 per partition (the client batching for itself);
  (b) bench/mqttbench fanin: 10 publishers, QoS 1, window 100, 64-byte payloads, and the
      subscriber on dev/+/telemetry, through `lightgate serve --set log=kafka` on that Tansu
      (`--set` pairs may be added with `--node-set key=value`).
Prints one JSON line per measurement, the ratio per round, and `uptime` before and after.
`--second-node` adds an idle node on the same cluster (every node indexes every record)
and reports both nodes' CPU seconds. `--profile FILE` runs py-spy on the node during each fan-in (FILE gets the round number).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from kafka_log_bench import PY, mqttbench, out, stop  # noqa: E402 - same directory
from tansu import start_tansu  # noqa: E402 - the tests' Tansu starter


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def producer(bootstrap: str, seconds: float, window: int, warmup: float,
                   batch: bool) -> tuple[float, float]:  # fmt: skip
    """(messages acknowledged per second, this process's CPU µs per message)."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = "direct_batch" if batch else "direct"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 4, 1)])
    finally:
        await admin.close()
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0,
                         enable_idempotence=False, max_batch_size=2 << 20)  # fmt: skip
    await p.start()
    value = b"x" * 64
    keys = [f"dev/{i}/telemetry".encode() for i in range(10)]
    headers = [("mqtt.qos", b"1"), ("mqtt.client_id", b"c")]
    per = 250 if batch else 1  # messages per send: a batch per partition, or one message
    free = asyncio.Semaphore(max(1, window // per))
    counted = [0]
    counting = [False]

    def acked(_f: asyncio.Future[object]) -> None:
        free.release()
        if counting[0]:
            counted[0] += per

    try:
        t0 = time.perf_counter() + warmup
        c0 = 0.0
        i = 0
        while (now := time.perf_counter()) < t0 + seconds:
            if not counting[0] and now >= t0:
                counting[0] = True
                t0, c0 = now, time.process_time()
            await free.acquire()
            if batch:
                b = p.create_batch()
                ts = int(time.time() * 1000)
                for k in range(per):
                    b.append(key=keys[k % 10], value=value, timestamp=ts, headers=headers)
                b.close()
                fut = await p.send_batch(b, topic, partition=i % 4)
            else:
                fut = await p.send(topic, value, key=keys[i % 10], headers=headers)
            fut.add_done_callback(acked)
            i += 1
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - c0
        return counted[0] / elapsed, 1e6 * cpu / max(1, counted[0])
    finally:
        await p.stop()


def serve(
    data: Path, bootstrap: str, sets: list[str], tree: Path = ROOT
) -> tuple[subprocess.Popen[bytes], int, int]:
    args = [PY, "-m", "lightgate", "serve", "--data-dir", str(data), "--mqtt-port", "0",
            "--ws-port", "-1", "--mqtts-port", "-1", "--wss-port", "-1", "--kafka-port", "-1",
            "--http-port", "0", "--set", "log_level=warning", "--set", "probe_interval_ms=0",
            "--set", "log=kafka", "--set", f"kafka_bootstrap={bootstrap}",
            "--set", "kafka_client_enable_idempotence=false"]  # fmt: skip
    for kv in sets:
        args += ["--set", kv]
    proc = subprocess.Popen(args, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    ports = dict(w.split("=", 1) for w in line.split()[2:])
    return proc, int(ports["mqtt"].rsplit(":", 1)[1]), int(ports["http"].rsplit(":", 1)[1])


def mean_ms(http: int, family: str) -> float:
    """A histogram's mean since start (sum / count over its series), in ms."""
    total = count = 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(family + "_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith(family + "_count"):
                count += float(line.rsplit(" ", 1)[1])
    return round(1000 * total / count, 2) if count else -1.0


def fanin(bootstrap: str, tmp: Path, seconds: float, sets: list[str],
          profile: str | None, tree: Path = ROOT, second: bool = False) -> dict[str, object]:  # fmt: skip
    proc, port, http = serve(tmp / f"node-{time.monotonic_ns()}", bootstrap, sets, tree)
    spy = other = None
    try:
        if second:  # another node on the cluster, no client of its own: what it costs to follow
            other = serve(tmp / f"node-{time.monotonic_ns()}", bootstrap, sets, tree)[0]
            c0, m0 = cpu_s(other.pid), cpu_s(proc.pid)
        if profile:
            spy = subprocess.Popen(
                [str(Path(PY).parent / "py-spy"), "record", "-p", str(proc.pid), "-o", profile, "-f", "raw", "-r", "200",
                 "-d", str(int(seconds + 4)), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        rec = mqttbench(port, proc.pid, "lightgate-kafka", 1, seconds)
        if other is not None:
            # whole run (setup, warmup, window, drain) for both: the ratio is what matters
            rec["second_node_cpu_s"] = round(cpu_s(other.pid) - c0, 2)
            rec["first_node_cpu_s"] = round(cpu_s(proc.pid) - m0, 2)
        rec["puback_ms"] = mean_ms(http, "lightgate_puback_latency_seconds")
        rec["produce_ms"] = mean_ms(http, "lightgate_fsync_latency_seconds")
        return rec
    finally:
        if spy is not None:
            spy.wait(60)
        stop(proc)
        if other is not None:
            stop(other)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--window", type=int, default=1000, help="aiokafka sends unacknowledged")
    ap.add_argument("--node-set", action="append", default=[], help="key=value for the node")
    ap.add_argument(
        "--second-node",
        action="store_true",
        help="run a second node on the cluster, idle, and report both CPU figures",
    )
    ap.add_argument("--profile", default="", help="py-spy raw output per round (FILE.N)")
    ap.add_argument(
        "--before",
        default="",
        help="another tree (a checkout with its compiled "
        "modules) whose node runs too, alternating: before/after in one run",
    )
    a = ap.parse_args()
    out({"uptime": os.popen("uptime").read().strip()})
    ratios: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="kafka-fanin-ratio-") as d:
        tmp = Path(d)
        for r in range(a.rounds):
            got: dict[str, float] = {}
            order = ["send", "send_batch", "node"] + (["node_before"] if a.before else [])
            if r % 2:
                order.reverse()
            for what in order:
                # A fresh Tansu per measurement: its memory storage answers slower as it
                # fills, so a shared one favoured whatever ran first.
                t = start_tansu(tmp)
                try:
                    c0 = cpu_s(t.proc.pid)
                    if what in ("send", "send_batch"):
                        batch = what == "send_batch"
                        rate, cpu = asyncio.run(
                            producer(t.bootstrap, a.duration, a.window, 2.0, batch)
                        )
                        got[what] = rate
                        out({"bench": "aiokafka", "api": what, "round": r,
                             "msgs_per_s": round(rate), "client_cpu_us_per_msg": round(cpu, 2),
                             "tansu_cpu_s": round(cpu_s(t.proc.pid) - c0, 2)})  # fmt: skip
                        continue
                    prof = f"{a.profile}.{what}.{r}" if a.profile else None
                    tree = Path(a.before) if what == "node_before" else ROOT
                    rec = fanin(t.bootstrap, tmp, a.duration, a.node_set, prof, tree,
                                a.second_node)  # fmt: skip
                    got[what] = float(rec.get("pub_msgs_per_s") or 0)  # type: ignore[arg-type]
                    out({"bench": what, "round": r, "tansu_cpu_s":
                         round(cpu_s(t.proc.pid) - c0, 2), **{
                        k: rec.get(k) for k in ("pub_msgs_per_s", "recv_msgs_per_s",
                                                "broker_cpu_pct", "broker_cpu_us_per_msg",
                                                "puback_ms", "produce_ms",
                                                "first_node_cpu_s", "second_node_cpu_s",
                                                "machine_busy_pct", "ok")}})  # fmt: skip
                finally:
                    t.stop()
            ratio = {
                f"{n}/{api}": round(got[n] / got[api], 3)
                for n in ("node", "node_before")
                if n in got
                for api in ("send", "send_batch")
            }
            ratios.append(ratio)
            out({"round": r, "node_over": ratio})
    out({"node_over": ratios, "uptime": os.popen("uptime").read().strip()})


if __name__ == "__main__":
    main()
