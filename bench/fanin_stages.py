"""py-spy samples of a fan-in run → µs per message per stage (bench/fanin_profile.sh).

    .venv/bin/python bench/fanin_stages.py bench/out/NAME [bench/out/OTHER ...]

A sample belongs to the innermost frame that names a stage (compiled functions have no frame of
their own: they count in their Python caller's stage). µs per message = the stage's share of the
samples × mqttbench's broker CPU µs per message (all threads; the fsync and I/O threads' samples
land in "append" or "other").
"""

from __future__ import annotations

import collections
import json
import sys

STAGES = [
    ("parse", ("Connection.receive_data",)),
    ("build", ("build_mqtt_batches",)),
    ("dispatch", ("Dispatcher.",)),
    ("delivery", ("Delivery.", "CohortPump.", "CachedMsg")),  # and GroupDelivery.
    ("append", ("Store.append_mqtt", "Inbound.flush", "Inbound._staged", "Backend.remember",
                "Inbound._durable", "commit.py", "Log.", "store.py")),
    ("handle", ("MqttConnection._handle", "handle_publish", "make_message", "Inbound.add",
                "MqttConnection.data_received")),
]  # fmt: skip
ORDER = ["parse", "handle", "build", "append", "dispatch", "delivery", "other"]


def stage(frames: list[str]) -> str:
    for f in reversed(frames):
        for name, pats in STAGES:
            if any(p in f for p in pats):
                return name
    return "other"


def load(base: str) -> tuple[dict[str, float], collections.Counter[str], int]:
    with open(base + ".bench.json") as f:
        res = json.loads(f.read().strip().splitlines()[-1])
    c: collections.Counter[str] = collections.Counter()
    tot = 0
    with open(base + ".raw") as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            tot += int(n)
            c[stage(stack.split(";"))] += int(n)
    return res, c, tot


def main(bases: list[str]) -> None:
    data = [load(b) for b in bases]
    print("| stage | " + " | ".join(b.rsplit("/", 1)[-1] for b in bases) + " |")
    print("|---|" + "---:|" * len(bases))
    for st in ORDER:
        cells = [f"{r['broker_cpu_us_per_msg'] * c[st] / t:.2f} ({c[st] * 100 / t:.0f} %)"
                 for r, c, t in data]  # fmt: skip
        print(f"| {st} | " + " | ".join(cells) + " |")
    for key, label in (
        ("broker_cpu_us_per_msg", "broker CPU µs/msg"),
        ("recv_msgs_per_s", "delivered msg/s (profiled)"),
        ("pub_msgs_per_s", "published msg/s (profiled)"),
        ("other_cpu_pct", "other CPU % on the machine"),
    ):
        print(f"| {label} | " + " | ".join(f"{r[key]:,}" for r, _, _ in data) + " |")


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    if not sys.argv[1:]:
        sys.exit(__doc__)
    main(sys.argv[1:])
