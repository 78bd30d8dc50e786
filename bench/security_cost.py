"""What security costs on MQTT fan-in: the same mqttbench fan-in against three fresh
`lightgate serve` processes in one run, interleaved per repeat:

- `plain`: no ACL, plain TCP;
- `acl1000`: an acl_file of 1,000 rules (999 `topic readwrite site<N>/+/telemetry` plus the one
  the benchmark's topics match, `dev/#`, all in the anonymous section);
- `tls`: no ACL, MQTT over TLS (a throwaway CA and server certificate; the load generator
  verifies the server: bench/mqttbench's `--tls-ca`).

Usage (from the repository root): .venv/bin/python bench/security_cost.py --repeat 3

`--auth`: what each way of proving identity costs (bench/auth_cost.py), against fresh gateways
in one run, rotated per repeat: the CONNECT rate and gateway CPU per CONNECT, and gateway CPU
per published message, for `anonymous`, `passwd` (password_file + acl_file), `jwt` (HS256 or
ES256 token with an ACL claim) and `http` (the auth hook, a local aiohttp service):
.venv/bin/python bench/security_cost.py --auth --repeat 3
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
sys.path.insert(0, str(ROOT / "tests"))
from tls_helpers import make_pki  # noqa: E402 - the tests' throwaway CA (cryptography)

MQTTBENCH = ROOT / "bench" / "mqttbench" / "mqttbench.py"
SCENARIOS = {
    "fanin qos0 max": ["fanin", "--publishers", "10", "--qos", "0"],
    "fanin qos0 20k/s": ["fanin", "--publishers", "10", "--qos", "0", "--rate", "20000"],
    "fanin qos1 w100": ["fanin", "--publishers", "10", "--qos", "1", "--window", "100"],
}


def serve(tmp: Path, mode: str, port: int, pki: object) -> subprocess.Popen[bytes]:
    data = tmp / f"data-{mode}-{time.monotonic_ns()}"
    args = ["--data-dir", str(data), "--ws-port", "-1", "--kafka-port", "-1", "--http-port", "-1",
            "--set", "log_level=warning", "--set", "sys_interval_s=0",
            "--set", "probe_interval_ms=0"]  # fmt: skip
    if mode == "tls":
        args += ["--mqtt-port", "-1", "--mqtts-port", str(port), "--wss-port", "-1",
                 "--set", f"tls_cert={pki.server_cert}", "--set", f"tls_key={pki.server_key}"]  # type: ignore[attr-defined]  # fmt: skip
    else:
        args += ["--mqtt-port", str(port), "--mqtts-port", "-1"]
    if mode == "acl1000":
        acl = tmp / "acl"
        rules = [f"topic readwrite site{i}/+/telemetry" for i in range(999)] + [
            "topic readwrite dev/#"
        ]
        acl.write_text("\n".join(rules) + "\n")
        args += ["--set", f"acl_file={acl}"]
    proc = subprocess.Popen([str(ROOT / ".venv/bin/lightgate"), "serve", *args],
                            stdout=subprocess.PIPE, cwd=ROOT)  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline().decode()
    if not line.startswith("lightgate ready"):
        proc.kill()
        raise SystemExit(f"{mode}: gateway did not start: {line!r}")
    return proc


def run_one(tmp: Path, mode: str, scenario: list[str], port: int, pki: object) -> dict[str, object]:
    proc = serve(tmp, mode, port, pki)
    try:
        cmd = [sys.executable, str(MQTTBENCH), "--port", str(port), "--broker-pid", str(proc.pid),
               "--label", mode, "--duration", "10", "--warmup", "2", "--wait-idle", "5"]  # fmt: skip
        if mode == "tls":
            cmd += ["--tls-ca", pki.ca]  # type: ignore[attr-defined]
        out = subprocess.run([*cmd, *scenario], capture_output=True, text=True, timeout=300)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("{")), None)
        if line is None:
            return {"error": out.stderr[-500:]}
        return dict(json.loads(line))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> int:
    if "--auth" in sys.argv:
        from auth_cost import main as auth_main  # bench/auth_cost.py

        sys.argv.remove("--auth")
        return auth_main()
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--port", type=int, default=18850)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "security-cost.jsonl"))
    ns = ap.parse_args()
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)  # bench/results/ is git-ignored
    tmp = Path(tempfile.mkdtemp(prefix="lg-sec-"))
    pki = make_pki(tmp / "pki")
    modes = ["plain", "acl1000", "tls"]
    rows: dict[tuple[str, str], list[dict[str, object]]] = {}
    with open(ns.out, "a") as fh:
        for r in range(ns.repeat):
            for name, scenario in SCENARIOS.items():
                order = modes[r % 3 :] + modes[: r % 3]  # rotate: no order effect
                for mode in order:
                    res = run_one(tmp, mode, scenario, ns.port, pki)
                    res.update(mode=mode, scenario_name=name, repeat=r)
                    fh.write(json.dumps(res) + "\n")
                    rows.setdefault((name, mode), []).append(res)
                    print(f"{name:18} {mode:8} recv {res.get('recv_msgs_per_s')}/s "
                          f"cpu {res.get('broker_cpu_us_per_msg')} us/msg", flush=True)  # fmt: skip
    print("\n| scenario | gateway | recv msgs/s (median) | broker CPU us/msg (median) |")
    print("|---|---|---:|---:|")
    for (name, mode), rs in rows.items():
        ok = [x for x in rs if "recv_msgs_per_s" in x]
        if not ok:
            print(f"| {name} | {mode} | failed | |")
            continue
        recv = statistics.median(float(x["recv_msgs_per_s"]) for x in ok)  # type: ignore[arg-type]
        cpu = statistics.median(float(x["broker_cpu_us_per_msg"]) for x in ok)  # type: ignore[arg-type]
        print(f"| {name} | {mode} | {recv:,.0f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
