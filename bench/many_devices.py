"""The workload a fleet sends: many devices, each on its own connection and topic at a low fixed
rate, each read by its own application, Lightgate and Mosquitto side by side in one run.

Ten busy sockets hand a broker ready-made batches; a fleet does not. Here every device
(`fleet/dev<i>/data`) publishes alone on its own connection, at `--rate` msg/s (QoS 1 by
default), with starts spread evenly over the period, and application i subscribes to device i's
topic only (the "point to point" scenario of public broker comparisons). Each 64-byte payload
carries its send time on CLOCK_MONOTONIC (system-wide on Linux), so latency publish -> deliver is
read in whichever process receives it.

Load comes from `--workers` processes (fork), each an asyncio loop (uvloop when installed) of raw
MQTT 3.1.1 clients on Protocols (paho costs too much per client for thousands of them).
Connections spread over loopback source addresses 127.0.0.2, 127.0.0.3, ... (one per ~25k
connections, `--source-ips`), as one source address has ~28k ephemeral ports.

Each round starts every broker afresh, the order rotating per round: Lightgate by
`bench/mqtt_serve.sh` (defaults: every message persisted, default fsync), Mosquitto with a
generated config (loopback listener on a free port, anonymous, `max_connections -1`, no
persistence). Brokers get the highest RLIMIT_NOFILE allowed (`ulimit -n` raised to the hard
limit in their wrapper shell) and are stopped by PID.

Reported per broker and round: published / delivered (counted over the whole run plus the
drain: every message delivered?), broker CPU (utime + stime of its process tree, /proc) per
delivered message over the measured window only (not the connect phase or warmup), p50/p99/max
latency of messages sent inside the window, broker RSS (process tree) at the end of the window,
the time to connect all clients (and the broker's CPU per connect), and the load generator's own
CPU (per worker: above ~90 % of a core, the generator, not the broker, sets the pace:
`loadgen_bound`). One JSON line per run goes to bench/results/many-devices-<date>.jsonl
(git-ignored) and a table (median over rounds) to stdout.

Usage (from the repository root):
    .venv/bin/python bench/many_devices.py --devices 5000 --rate 2      # the main figure
    .venv/bin/python bench/many_devices.py --devices 500 --rounds 3
    .venv/bin/python bench/many_devices.py --lone      # 1 device at 1 msg/s (cf. lone_message.py)
  options: --brokers lightgate,mosquitto  --rounds R  --duration S  --warmup S  --drain S
           --qos 0|1  --payload 64  --workers W  --source-ips N  --serve-args "--set k=v ..."
Limits: each connection is one file descriptor in the broker, so devices + applications must stay
below the hard RLIMIT_NOFILE (`ulimit -Hn`; 20000 in the sandbox this was written in: 10,000
devices + 10,000 applications does not fit there).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import resource
import statistics
import struct
import tempfile
import time
from array import array
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fleet_mqtt import (
    ROOT,
    STAMP,
    Client,
    Counters,
    connect_packet,
    cpu_s,
    free_port,
    machine_busy_s,
    mqtt_str,
    open_client,
    pct,
    process_tree,
    recv_within,
    rss_kb,
    run_worker,
    sleep_until,
    source_addresses,
    start_broker,
    stop_broker,
    subscribe_packet,
    topic_of,
    varint,
)

# ---- one worker process ------------------------------------------------------------------------


async def worker_main(spec: dict[str, Any], pipe: Connection) -> None:
    """Connects its applications then its devices, reports, then publishes on the coordinator's
    schedule: device i sends at t0 + phase_i + k / rate, phase_i = i / devices of a period."""
    c = Counters()
    port, qos, devices = spec["port"], spec["qos"], spec["devices"]
    mine: list[int] = spec["indexes"]
    sources: list[str] = spec["sources"]
    sem = asyncio.Semaphore(spec["connect_parallel"])
    connack_ms = array("d")

    async def connect(hello: bytes, acks_due: int, n: int) -> Client:
        async with sem:
            t = time.monotonic()
            cl = await open_client(port, sources[n % len(sources)], c, hello, acks_due, 60)
            connack_ms.append((time.monotonic() - t) * 1000)
            return cl

    t_connect = time.monotonic()
    apps = await asyncio.gather(
        *(
            connect(connect_packet(f"app{i}") + subscribe_packet(topic_of(i), qos), 2, 2 * i)
            for i in mine
        ),
        return_exceptions=True,
    )
    devs = await asyncio.gather(
        *(connect(connect_packet(f"dev{i}"), 1, 2 * i + 1) for i in mine),
        return_exceptions=True,
    )
    failed = [x for x in (*apps, *devs) if isinstance(x, BaseException)]
    pipe.send(
        {
            "connected": len(apps) + len(devs) - len(failed),
            "failed": len(failed),
            "first_error": repr(failed[0]) if failed else "",
            "connect_s": time.monotonic() - t_connect,
            "connack_ms": sorted(connack_ms),
        }
    )
    plan = pipe.recv()  # {"t0", "w0", "w1", "stop", "drain"} on CLOCK_MONOTONIC (s)
    c.window = (int(plan["w0"] * 1e9), int(plan["w1"] * 1e9))
    period = 1.0 / spec["rate"]
    pad = b"\0" * (spec["payload"] - STAMP.size)
    live = [(i, d) for i, d in zip(mine, devs, strict=True) if isinstance(d, Client)]
    live.sort(key=lambda x: x[0])
    headers = []
    for i, _ in live:
        topic = mqtt_str(topic_of(i))
        rest = len(topic) + (2 if qos else 0) + spec["payload"]
        headers.append(bytes([0x30 | (qos << 1)]) + varint(rest) + topic)
    phases = [plan["t0"] + period * i / devices for i, _ in live]
    pids = [0] * len(live)
    k, j, n = 0, 0, len(live)
    w0_ns, w1_ns = c.window
    while n:
        due = phases[j] + k * period
        if due >= plan["stop"]:
            break
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
        # everything due by now, in phase order
        now = time.monotonic()
        while True:
            i, cl = live[j]
            if cl.transport is not None and not cl.closed:
                stamp = time.monotonic_ns()
                if qos:
                    pids[j] = pids[j] % 65535 + 1
                    body = struct.pack(">H", pids[j]) + STAMP.pack(stamp, i) + pad
                else:
                    body = STAMP.pack(stamp, i) + pad
                cl.transport.write(headers[j] + body)
                c.sent += 1
                if w0_ns <= stamp < w1_ns:
                    c.sent_window += 1
            j += 1
            if j == n:
                j, k = 0, k + 1
            if phases[j] + k * period > now:
                break
    await asyncio.sleep(max(0.0, plan["stop"] + plan["drain"] - time.monotonic()))
    for x in (*apps, *devs):
        if isinstance(x, Client) and x.transport is not None:
            x.transport.write(b"\xe0\x00")
            x.transport.close()
    pipe.send(
        {
            "sent": c.sent,
            "sent_window": c.sent_window,
            "acked": c.acked,
            "delivered": c.delivered,
            "latency_us": c.latency_us.tobytes(),
            "errors": c.errors[:5],
        }
    )


def worker_entry(spec: dict[str, Any], pipe: Connection) -> None:
    run_worker(worker_main, spec, pipe)


def run_once(args: argparse.Namespace, kind: str, rnd: int) -> dict[str, Any]:
    port = free_port()
    conns = 2 * args.devices
    sources = source_addresses(conns, args.source_ips)
    n_src = len(sources)
    workers = max(1, min(args.workers, args.devices))
    with tempfile.TemporaryDirectory(prefix=f"many-devices-{kind}-") as tmp:
        broker = start_broker(kind, port, Path(tmp), args.serve_args.split())
        procs: list[mp.process.BaseProcess] = []
        try:
            bpids = process_tree(broker.pid)
            ctx = mp.get_context("fork")
            pipes: list[Connection] = []
            cpu_b0, t_c0 = cpu_s(bpids), time.monotonic()
            for w in range(workers):
                here, there = ctx.Pipe()
                spec = {
                    "port": port,
                    "qos": args.qos,
                    "rate": args.rate,
                    "payload": args.payload,
                    "devices": args.devices,
                    "indexes": list(range(w, args.devices, workers)),
                    "sources": sources,
                    "connect_parallel": args.connect_parallel,
                }
                p = ctx.Process(target=worker_entry, args=(spec, there), daemon=True)
                p.start()
                procs.append(p)
                pipes.append(here)
            ready = [recv_within(pp, 60 + conns / 200) for pp in pipes]
            connect_s = time.monotonic() - t_c0
            bpids = process_tree(broker.pid)
            cpu_connect = cpu_s(bpids) - cpu_b0
            t0 = time.monotonic() + 0.5
            plan = {
                "t0": t0,
                "w0": t0 + args.warmup,
                "w1": t0 + args.warmup + args.duration,
                "stop": t0 + args.warmup + args.duration,
                "drain": args.drain,
            }
            for pp in pipes:
                pp.send(plan)
            gpids = [p.pid for p in procs if p.pid]
            sleep_until(plan["w0"])
            b0, g0, m0 = cpu_s(bpids), [cpu_s([g]) for g in gpids], machine_busy_s()
            sleep_until(plan["w1"])
            b1, g1, m1 = cpu_s(bpids), [cpu_s([g]) for g in gpids], machine_busy_s()
            rss = rss_kb(process_tree(broker.pid))
            done = [recv_within(pp, args.drain + 60) for pp in pipes]
        finally:
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
            stop_broker(broker)
    lat = sorted(x for d in done for x in array("q", d["latency_us"]))
    connack = sorted(x for r in ready for x in r["connack_ms"])
    sent = sum(d["sent"] for d in done)
    delivered = sum(d["delivered"] for d in done)
    sent_window = sum(d["sent_window"] for d in done)
    window_delivered = len(lat)
    broker_cpu = b1 - b0
    gen_cpu = [b - a for a, b in zip(g0, g1, strict=True)]
    busy = m1 - m0
    return {
        "bench": "many_devices",
        "broker": kind,
        "round": rnd,
        "ts": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "devices": args.devices,
        "applications": args.devices,
        "rate_per_device": args.rate,
        "qos": args.qos,
        "payload": args.payload,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "workers": workers,
        "source_ips": n_src,
        "connected": sum(r["connected"] for r in ready),
        "connect_failed": sum(r["failed"] for r in ready),
        "connect_error": next((r["first_error"] for r in ready if r["first_error"]), ""),
        "connect_s": round(connect_s, 3),
        "connack_p50_ms": round(pct(connack, 0.5), 3),
        "connack_p99_ms": round(pct(connack, 0.99), 3),
        "broker_cpu_us_per_connect": round(cpu_connect * 1e6 / max(1, conns), 1),
        "published": sent,
        "acked": sum(d["acked"] for d in done),
        "delivered": delivered,
        "delivered_ratio": round(delivered / sent, 6) if sent else None,
        "published_in_window": sent_window,
        "delivered_of_window": window_delivered,
        "msgs_per_s": round(window_delivered / args.duration, 1),
        "broker_cpu_pct": round(100 * broker_cpu / args.duration, 1),
        "broker_cpu_us_per_msg": round(broker_cpu * 1e6 / window_delivered, 1)
        if window_delivered
        else None,
        "lat_p50_ms": round(pct(lat, 0.5) / 1000, 3),
        "lat_p99_ms": round(pct(lat, 0.99) / 1000, 3),
        "lat_max_ms": round(lat[-1] / 1000, 3) if lat else None,
        "broker_rss_kb": rss,
        "loadgen_cpu_pct": round(100 * sum(gen_cpu) / args.duration, 1),
        "worker_cpu_pct": [round(100 * x / args.duration, 1) for x in gen_cpu],
        "loadgen_bound": any(x / args.duration > 0.9 for x in gen_cpu),
        "other_cpu_pct": round(100 * (busy - broker_cpu - sum(gen_cpu)) / args.duration, 1),
        "errors": [e for d in done for e in d["errors"]][:5],
    }


# ---- main --------------------------------------------------------------------------------------

COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("delivered/published", "delivered_ratio", lambda v: f"{v:.4f}" if v is not None else "-"),
    ("msg/s", "msgs_per_s", lambda v: f"{v:,.0f}"),
    ("broker CPU µs/msg", "broker_cpu_us_per_msg", lambda v: f"{v:.1f}" if v else "-"),
    ("broker CPU %", "broker_cpu_pct", lambda v: f"{v:.1f}"),
    ("p50 ms", "lat_p50_ms", lambda v: f"{v:.2f}"),
    ("p99 ms", "lat_p99_ms", lambda v: f"{v:.2f}"),
    ("max ms", "lat_max_ms", lambda v: f"{v:.1f}" if v is not None else "-"),
    ("RSS MB", "broker_rss_kb", lambda v: f"{v / 1024:.0f}"),
    ("connect s", "connect_s", lambda v: f"{v:.1f}"),
    ("µs/connect", "broker_cpu_us_per_connect", lambda v: f"{v:.0f}"),
    ("loadgen CPU %", "loadgen_cpu_pct", lambda v: f"{v:.0f}"),
    ("other CPU %", "other_cpu_pct", lambda v: f"{v:.0f}"),
]


def table(rows: list[dict[str, Any]], brokers: list[str]) -> str:
    head = "| broker (median of rounds) | " + " | ".join(c[0] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for b in brokers:
        mine = [r for r in rows if r["broker"] == b]
        if not mine:
            continue
        cells = []
        for _, key, fmt in COLUMNS:
            vals = [r[key] for r in mine if r[key] is not None]
            cells.append(fmt(statistics.median(vals)) if vals else "-")
        lines.append(f"| {b} ({len(mine)}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--devices", type=int, default=5000)
    ap.add_argument("--rate", type=float, default=2.0, help="msg/s per device")
    ap.add_argument("--lone", action="store_true", help="1 device at 1 msg/s")
    ap.add_argument("--qos", type=int, choices=(0, 1), default=1)
    ap.add_argument("--payload", type=int, default=64)
    ap.add_argument("--brokers", default="lightgate,mosquitto")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--duration", type=float, default=20.0, help="measured window (s)")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--drain", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=2, help="load generator processes")
    ap.add_argument("--source-ips", type=int, default=0, help="0: one per 25k connections")
    ap.add_argument("--connect-parallel", type=int, default=100, help="per worker")
    ap.add_argument("--serve-args", default="", help="extra `lightgate serve` arguments")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.lone:
        args.devices, args.rate = 1, 1.0
    if args.payload < STAMP.size:
        raise SystemExit(f"--payload must be at least {STAMP.size}")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if 2 * args.devices + 100 > hard:
        # a broker out of descriptors refuses connections (or spins on accept): no figure
        raise SystemExit(
            f"{2 * args.devices} connections do not fit the hard fd limit of {hard} "
            "(`ulimit -Hn`), which the brokers inherit: raise it (as root) or use fewer devices"
        )
    brokers = args.brokers.split(",")
    out = args.out or ROOT / "bench" / "results" / f"many-devices-{dt.date.today()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(args.rounds):
        for k in range(len(brokers)):
            kind = brokers[(k + rnd) % len(brokers)]  # whoever goes first rotates
            row = run_once(args, kind, rnd)
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(
                f"round {rnd} {kind}: delivered {row['delivered']}/{row['published']}, "
                f"{row['broker_cpu_us_per_msg']} µs/msg, p99 {row['lat_p99_ms']} ms, "
                f"connect {row['connect_s']} s ({row['connect_failed']} failed), "
                f"loadgen {row['worker_cpu_pct']} %, other {row['other_cpu_pct']} %",
                flush=True,
            )
    print(
        f"\n{args.devices} devices + {args.devices} applications, {args.rate:g} msg/s each, "
        f"QoS {args.qos}, {args.payload} B, {args.duration:g} s window; raw lines: {out}\n"
    )
    print(table(rows, brokers))


if __name__ == "__main__":
    main()
