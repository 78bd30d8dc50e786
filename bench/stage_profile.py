"""CPU by stage of the MQTT path, from a py-spy raw (collapsed) profile of a broker.

    py-spy record --native -r 200 -d 20 -f raw -o prof.txt -p PID
    python bench/stage_profile.py prof.txt --messages N   # N: messages delivered meanwhile
    python bench/stage_profile.py prof.txt --cpu US        # or: scaled to a measured µs/msg

Each sample goes to the deepest stage named in its stack (read from the leaf up), so a
delivery that runs inside the publish round counts as delivery, not as the round. Samples
in the event loop's poll are `idle`, the fsync pool's threads are left out, and a sample whose
leaf is a syscall counts in the syscall column (py-spy samples wall time: on a loaded machine
that includes time the loop sat preempted in a syscall).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

# (stage, markers in a frame's text), checked from the leaf frame up; first match wins.
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("idle (poll)", ("epoll_wait", "uv__io_poll (", "select (selectors")),
    ("PUBACK write", ("_send_acks", "acks_bytes", "_durable (mqtt_proxy")),
    ("fsync completion", ("_sync_done", "done_one", "SyncWorkers", "FsyncPool", "_fsync")),
    (
        "delivery",
        (
            "on_round",
            "Delivery",
            "_pump",
            "cohorts",
            "qos1_run",
            "queue_cache",
            "_from_recent",
            "load_entries",
        ),
    ),
    ("notify", ("notify/", "routes.publish", "RouteTable")),
    ("index", ("dispatcher.py", "index_batch", "_cindex", "_cblocks", "lightqueue/")),
    (
        "append+write",
        (
            "append_mqtt",
            "commit.py",
            "store/log.py",
            "segment.py",
            "mqtt_batches",
            "write_now",
            "writev",
        ),
    ),
    ("subscriber PUBACK in", ("handle_pubacks", "handle_puback", "acked_many", "acked (")),
    (
        "read/parse",
        (
            "data_received",
            "receive_data",
            "_cparser",
            "parser.py",
            "handle_publish",
            "publish_messages",
            "add_many",
            "Inbound.add",
        ),
    ),
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


# A leaf frame in one of these is a syscall (time in the kernel, or preempted there).
SYSCALLS = ("write (libc", "read (libc", "pthread_cond_signal", "futex", "fdatasync", "writev")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--messages", type=int, default=0)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--cpu", type=float, default=0.0,
                    help="measured CPU µs/msg: scale the busy samples to it instead")  # fmt: skip
    ns = ap.parse_args()
    code: Counter[str] = Counter()
    sys_: Counter[str] = Counter()
    idle = 0
    for line in Path(ns.raw).read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or "Thread._bootstrap" in stack:  # the fsync pool's threads
            continue
        stage = stage_of(stack)
        if stage == "idle (poll)":
            idle += int(n)
        elif any(m in stack.rsplit(";", 1)[-1] for m in SYSCALLS):
            sys_[stage] += int(n)
        else:
            code[stage] += int(n)
    busy = sum(code.values()) + sum(sys_.values())
    if ns.cpu:
        per = ns.cpu / max(busy, 1)
    elif ns.messages:
        per = 1e6 / ns.rate / ns.messages
    else:
        per = 0.0
    print(f"samples: busy {busy}, idle {idle}")
    print("| stage | share | µs/msg | in code | in syscalls |")
    print("|---|---:|---:|---:|---:|")
    for name in sorted(set(code) | set(sys_), key=lambda k: -(code[k] + sys_[k])):
        a, b = code[name], sys_[name]
        print(f"| {name} | {100 * (a + b) / max(busy, 1):.1f} % | {per * (a + b):.0f} | "
              f"{per * a:.0f} | {per * b:.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
