"""What metrics and probes cost on MQTT fan-in: the same mqttbench fan-in scenarios
against three gateways, interleaved in one run so that the machine's noise hits all alike.

- `before`: the code before the operations work (a `git archive` of `--base`, default the commit
  this work started from): no histograms, the old hand-written HTTP listener (off here);
- `off`: this tree with probes off and no HTTP listener (the hot-path histograms always run);
- `on`: this tree with probes every second and the HTTP listener scraped (`/metrics` and
  `/api/stats`) once a second, as Prometheus and an open dashboard would.

Each broker is a fresh `lightgate serve` (MQTT only, fsync `always`, fresh data dir) started by
this script and stopped by its PID. Usage (from the repository root):

    python bench/ops_overhead.py --repeat 3 [--base COMMIT] [--out bench/results/ops.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import urllib.request
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MQTTBENCH = ROOT / "bench" / "mqttbench" / "mqttbench.py"
SCENARIOS = {
    "fanin qos0 max": ["fanin", "--publishers", "10", "--qos", "0"],
    "fanin qos1 w100": ["fanin", "--publishers", "10", "--qos", "1", "--window", "100"],
    "fanin qos0 20k/s": ["fanin", "--publishers", "10", "--qos", "0", "--rate", "20000"],
}


def checkout(base: str, into: Path) -> Path:
    """`base`'s tree, with this tree's compiled modules copied in where their .pyx did not
    change (git has no .so files: without them `before` would run the pure-Python twins)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", base], check=True,
                          capture_output=True).stdout  # fmt: skip
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into)  # our own repository's archive
    for so in ROOT.glob("*/**/*.so"):
        rel = so.relative_to(ROOT)
        pyx = (into / rel).parent / (so.name.split(".")[0] + ".pyx")
        if (
            ".venv" not in rel.parts
            and pyx.exists()
            and pyx.read_bytes() == (ROOT / pyx.relative_to(into)).read_bytes()
        ):
            shutil.copy(so, into / rel)
    return into


def start(tree: Path, port: int, http: bool, probes: bool) -> tuple[subprocess.Popen[bytes], int]:
    data = Path(tempfile.mkdtemp(prefix="lg-ops-bench-"))
    args = [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(data),
            "--mqtt-port", str(port), "--mqtts-port", "-1", "--ws-port", "-1",
            "--kafka-port", "-1", "--http-port", "0" if http else "-1",
            "--set", "log_level=warning"]  # fmt: skip
    if (tree / "lightgate" / "probe.py").exists():
        args += ["--set", f"probe_interval_ms={1000 if probes else 0}"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen(args, cwd=tree, env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    assert line.startswith("lightgate ready"), line
    http_port = 0
    for word in line.split():
        if word.startswith("http="):
            http_port = int(word.rsplit(":", 1)[1])
    proc.data_dir = data  # type: ignore[attr-defined]
    return proc, http_port


def scrape_loop(port: int, stop: threading.Event) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    while not stop.wait(1.0):
        for path in ("/metrics", "/api/stats"):
            try:
                opener.open(f"http://127.0.0.1:{port}{path}", timeout=5).read()
            except OSError:
                pass


def run_one(tree: Path, mode: str, scenario: list[str], port: int) -> dict[str, object]:
    proc, http_port = start(tree, port, http=mode == "on", probes=mode == "on")
    stop = threading.Event()
    scraper = None
    if mode == "on":
        scraper = threading.Thread(target=scrape_loop, args=(http_port, stop), daemon=True)
        scraper.start()
    try:
        out = subprocess.run(
            [sys.executable, str(MQTTBENCH), "--port", str(port), "--broker-pid", str(proc.pid),
             "--label", f"lightgate-{mode}", "--duration", "10", "--warmup", "2", *scenario],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        lines = out.stdout.strip().splitlines()
        if not lines:
            raise RuntimeError(f"mqttbench said nothing: {out.stderr[-2000:]}")
        return dict(json.loads(lines[-1]))
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        shutil.rmtree(proc.data_dir, ignore_errors=True)  # type: ignore[attr-defined]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--base", default="6448025")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ops-overhead.jsonl"))
    ap.add_argument("--port", type=int, default=18840)
    ap.add_argument("--only", help="run only the scenario with this name")
    ap.add_argument(
        "--rotate", action="store_true", help="rotate the gateway order each repeat (order effects)"
    )
    ns = ap.parse_args()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is git-ignored
    tmp = Path(tempfile.mkdtemp(prefix="lg-ops-base-"))
    trees = {"before": checkout(ns.base, tmp), "off": ROOT, "on": ROOT}
    scenarios = {k: v for k, v in SCENARIOS.items() if ns.only in (None, k)}
    rows: dict[tuple[str, str], list[dict[str, object]]] = {}
    try:
        with open(ns.out, "a") as fh:
            for r in range(ns.repeat):
                for name, scenario in scenarios.items():
                    order = list(trees.items())
                    if ns.rotate:
                        order = order[r % 3 :] + order[: r % 3]
                    for mode, tree in order:
                        res = run_one(tree, mode, scenario, ns.port)
                        res.update(mode=mode, scenario_name=name, repeat=r)
                        fh.write(json.dumps(res) + "\n")
                        fh.flush()
                        rows.setdefault((name, mode), []).append(res)
                        print(f"{name:18} {mode:6} recv {res.get('recv_msgs_per_s')}/s "
                              f"cpu {res.get('broker_cpu_us_per_msg')} us/msg", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\n| scenario | gateway | recv msgs/s (median) | broker CPU us/msg (median) |")
    print("|---|---|---:|---:|")
    for (name, mode), rs in rows.items():
        recv = statistics.median(float(x["recv_msgs_per_s"]) for x in rs)  # type: ignore[arg-type]
        cpu = statistics.median(float(x["broker_cpu_us_per_msg"]) for x in rs)  # type: ignore[arg-type]
        print(f"| {name} | {mode} | {recv:,.0f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
