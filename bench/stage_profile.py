"""CPU by stage of the MQTT path, from a py-spy raw (collapsed) profile of a broker.

    py-spy record --native -r 200 -d 20 -f raw -o prof.txt -p PID
    python bench/stage_profile.py prof.txt --messages N   # N: messages delivered meanwhile

Each sample goes to the deepest stage named in its stack (read from the leaf up), so a
delivery that runs inside the publish round counts as delivery, not as the round. Samples
in the event loop's poll are `idle`; with --messages the table also gives µs per message
(samples / rate / messages).
"""

from __future__ import annotations

import argparse
from collections import Counter

# (stage, markers in a frame's text), checked from the leaf frame up; first match wins.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("idle (poll)", ("epoll_wait", "uv__io_poll (", "select (selectors")),
    ("PUBACK write", ("_send_acks", "acks_bytes", "_durable (mqtt_proxy")),
    ("fsync completion", ("_sync_done", "done_one", "SyncWorkers", "FsyncPool", "_fsync")),
    ("delivery", ("on_round", "Delivery", "_pump", "cohorts", "qos1_run", "queue_cache",
                  "_from_recent", "load_entries")),
    ("notify", ("notify/", "routes.publish", "RouteTable")),
    ("index", ("dispatcher.py", "index_batch", "_cindex", "_cblocks", "lightqueue/")),
    ("append+write", ("append_mqtt", "commit.py", "store/log.py", "segment.py", "mqtt_batches",
                      "write_now", "writev")),
    ("subscriber PUBACK in", ("handle_pubacks", "handle_puback", "acked_many", "acked (")),
    ("read/parse", ("data_received", "receive_data", "_cparser", "parser.py", "handle_publish",
                    "publish_messages", "add_many", "Inbound.add")),
    ("timers/keepalive", ("keepalive", "call_later", "TimerHandle", "_hold_expired")),
    ("sys/metrics", ("sys_topics", "metrics", "latency.py")),
]


def stage_of(stack: str) -> str:
    frames = stack.split(";")
    for f in reversed(frames):
        for name, marks in STAGES:
            if any(m in f for m in marks):
                return name
    return "other (loop, syscalls)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--messages", type=int, default=0)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ns = ap.parse_args()
    by: Counter[str] = Counter()
    total = 0
    for line in open(ns.raw):
        stack, _, n = line.rstrip("\n").rpartition(" ")
        if not n.isdigit():
            continue
        by[stage_of(stack)] += int(n)
        total += int(n)
    busy = total - by["idle (poll)"]
    print(f"samples {total}, busy {busy}")
    print("| stage | share of busy | µs per message |")
    print("|---|---|---|")
    for name, n in by.most_common():
        if name == "idle (poll)":
            continue
        us = f"{n / ns.rate / ns.messages * 1e6:.1f}" if ns.messages else "-"
        print(f"| {name} | {100 * n / max(busy, 1):.1f} % | {us} |")
    if ns.messages:
        print(f"| **all busy** | 100 % | {busy / ns.rate / ns.messages * 1e6:.1f} |")


if __name__ == "__main__":
    main()
