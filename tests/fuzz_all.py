"""`make fuzz SECONDS=n [SEED=s]`: a third of the budget to the hypothesis properties of both
codecs, the rest to the socket fuzzer against a fresh gateway.

The properties run in rounds of pytest, each with its own `--hypothesis-seed` (printed), until
their share is spent (at least one round); the socket fuzzer then runs for what is left (at
least 10 s) with `SEED` or a random seed (printed). Exit status 1 on the first failure; the
lines to reproduce it are printed above.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROPERTIES = [
    "tests/test_mqtt_codec_roundtrip.py",
    "tests/test_kafka_fuzz_properties.py",
    "tests/test_store_record_batch.py",
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seconds", type=float, default=120)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    start = time.monotonic()
    rng = random.Random(args.seed)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rounds = 0
    while True:
        seed = rng.randrange(2**32)
        print(f"fuzz: properties round {rounds + 1}, --hypothesis-seed={seed}", flush=True)
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--hypothesis-seed={seed}", *PROPERTIES]  # fmt: skip
        if subprocess.run(cmd, cwd=ROOT, env=env).returncode:
            print(f"fuzz: FAIL; reproduce: {' '.join(cmd[1:])}", flush=True)
            return 1
        rounds += 1
        spent = time.monotonic() - start
        if spent + (time.monotonic() - t0) > args.seconds / 3:
            break
    left = max(10.0, args.seconds - (time.monotonic() - start))
    cmd = [sys.executable, str(HERE / "socket_fuzzer.py"), "--seconds", f"{left:.0f}"]
    if args.seed is not None:
        cmd += ["--seed", str(args.seed)]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
