"""Several MQTT proxies over one core: fan-in QoS 0 / QoS 1 and fan-out 1→1000
against `lightgate serve` with `mqtt_processes` = 1, 2 and `auto`, and Mosquitto, in one run.

For each gateway run it reads the CPU time of the core (the `serve` process) and of its proxy
children from /proc around the mqttbench run, and splits mqttbench's broker CPU per message
(the whole process tree, over the measurement window) in that ratio: core µs/msg and proxies
µs/msg. The projection: one core process saturates at 1e6 / core µs/msg messages a second,
one proxy at 1e6 / (proxies µs/msg) on its own CPU, so one core feeds about
(proxies µs/msg) / (core µs/msg) fully busy proxies before the core is the limit.

Usage (from the repository root):
    .venv/bin/python bench/proxies_bench.py [--repeat 1] [--duration 5]
Raw lines go to bench/results/proxies.jsonl (git-ignored); the table is printed (markdown),
with `uptime`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MQTTBENCH = ROOT / "bench" / "mqttbench" / "mqttbench.py"
MOSQUITTO_CONF = ROOT / "bench" / "mqttbench" / "brokers" / "mosquitto.conf"
MOSQUITTO_PORT = 18830  # fixed by its config
SCENARIOS = {
    "fanin qos0": ["fanin", "--publishers", "10", "--qos", "0"],
    "fanin qos1": ["fanin", "--publishers", "10", "--qos", "1", "--window", "100"],
    "fanout 1->1000": ["fanout", "--subscribers", "1000", "--sub-workers", "2", "--qos", "0"],
}
SHAPES = ["1", "2", "auto", "mosquitto"]
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    try:
        s = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 0.0
    f = s[s.rfind(b")") + 2 :].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def start(shape: str, port: int, tmp: Path) -> subprocess.Popen[bytes]:
    if shape == "mosquitto":
        proc = subprocess.Popen(["mosquitto", "-c", str(MOSQUITTO_CONF)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(0.5)
        return proc
    data = tmp / f"data-{shape}-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(data),
            "--mqtt-port", str(port), "--ws-port", "-1", "--wss-port", "-1", "--mqtts-port", "-1",
            "--kafka-port", "-1", "--http-port", "-1", "--set", f"mqtt_processes={shape}",
            "--set", "log_level=warning", "--set", "sys_interval_s=0",
            "--set", "probe_interval_ms=0"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("lightgate ready"):
        proc.kill()
        raise SystemExit(f"{shape}: gateway did not start: {line!r}")
    return proc


def run_one(shape: str, scenario: list[str], port: int, tmp: Path, duration: float) -> dict:
    proc = start(shape, port, tmp)
    bport = MOSQUITTO_PORT if shape == "mosquitto" else port
    try:
        kids = children(proc.pid)
        core0, kids0 = cpu_s(proc.pid), {k: cpu_s(k) for k in kids}
        cmd = [sys.executable, str(MQTTBENCH), "--port", str(bport), "--broker-pid", str(proc.pid),
               "--label", shape, "--duration", str(duration), "--warmup", "2",
               "--wait-idle", "5"]  # fmt: skip
        out = subprocess.run([*cmd, *scenario], capture_output=True, text=True, timeout=300)
        core1, kids1 = cpu_s(proc.pid), {k: cpu_s(k) for k in kids}
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
        if line is None:
            return {"error": out.stderr[-500:]}
        res = dict(json.loads(line))
        res["proxies"] = len(kids)
        core, prox = core1 - core0, sum(kids1[k] - kids0[k] for k in kids)
        tot = res.get("broker_cpu_us_per_msg")
        if kids and tot and core + prox > 0:
            res["core_us_per_msg"] = round(tot * core / (core + prox), 2)
            res["proxies_us_per_msg"] = round(tot * prox / (core + prox), 2)
        return res
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=18860)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "proxies.jsonl"))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset")
    ap.add_argument("--scenarios", default="", help="comma-separated names (default: all)")
    ns = ap.parse_args()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is git-ignored
    shapes = ns.shapes.split(",")
    wanted = ns.scenarios.split(",") if ns.scenarios else list(SCENARIOS)
    tmp = Path(tempfile.mkdtemp(prefix="lg-proxies-"))
    load0 = os.getloadavg()
    rows: dict[tuple[str, str], list[dict]] = {}
    with open(ns.out, "a") as fh:
        for r in range(ns.repeat):
            for name, scenario in SCENARIOS.items():
                if name not in wanted:
                    continue
                order = shapes[r % len(shapes) :] + shapes[: r % len(shapes)]
                for shape in order:
                    res = run_one(shape, scenario, ns.port, tmp, ns.duration)
                    res.update(shape=shape, scenario_name=name, repeat=r, load=os.getloadavg())
                    fh.write(json.dumps(res) + "\n")
                    fh.flush()
                    rows.setdefault((name, shape), []).append(res)
                    print(f"{name:15} {shape:9} recv {res.get('recv_msgs_per_s')}/s "
                          f"cpu {res.get('broker_cpu_us_per_msg')} us/msg core "
                          f"{res.get('core_us_per_msg')} proxies {res.get('proxies_us_per_msg')}",
                          flush=True)  # fmt: skip
    load1 = os.getloadavg()
    print(f"\nload average before {load0[0]:.2f}, after {load1[0]:.2f} (1 min); "
          f"cores {len(os.sched_getaffinity(0))}")  # fmt: skip
    print(
        "\n| scenario | shape | proxies | recv msgs/s | broker µs/msg | core µs/msg "
        "| proxies µs/msg | proxies one core feeds |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")

    def med(rs: list[dict], k: str) -> float | None:
        v = [float(x[k]) for x in rs if x.get(k) is not None]
        return statistics.median(v) if v else None

    for (name, shape), rs in rows.items():
        recv, tot = med(rs, "recv_msgs_per_s"), med(rs, "broker_cpu_us_per_msg")
        core, prox = med(rs, "core_us_per_msg"), med(rs, "proxies_us_per_msg")
        n = rs[0].get("proxies", "")
        feeds = f"{prox / core:.1f}" if core and prox else ""
        cells = [f"{recv:,.0f}" if recv else "failed", f"{tot:.1f}" if tot else "",
                 f"{core:.1f}" if core else "", f"{prox:.1f}" if prox else "", feeds]  # fmt: skip
        print(f"| {name} | {shape} | {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
