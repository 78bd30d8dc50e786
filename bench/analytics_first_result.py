"""Time to first result of `lightgate analytics`: seconds from launch to the first job's result
line on stdout, and to the end, for a command run as a user runs it (a fresh process, its own JVM).

    .venv/bin/python bench/analytics_first_result.py --data-dir ./data [--checkout DIR] [JOB ...]

`--checkout` runs another checkout's code with this venv (PYTHONPATH), to compare before/after.
Results: bench/RESULTS.md, "Analytics: time to first result".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(checkout: Path, data_dir: str, argv: list[str]) -> tuple[float | None, float, int]:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "spark_analytics.cli", *argv, "--data-dir", data_dir]
        cmd += ["--out", out, "--master", "local[2]"]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        first = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if " rows -> " in line and first is None:
                first = time.monotonic() - t0
        rc = proc.wait()
        return first, time.monotonic() - t0, rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--checkout", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("jobs", nargs="*", default=["top-talkers", "rates", "all"])
    args = ap.parse_args()
    print(f"checkout {args.checkout}; load average {os.getloadavg()[0]:.1f}")
    for job in args.jobs:
        first, total, rc = run(Path(args.checkout), args.data_dir, [job])
        shown = "-" if first is None else f"{first:.1f}"
        print(f"{job:<12} first result {shown:>6} s   total {total:6.1f} s   rc {rc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
