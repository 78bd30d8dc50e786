"""A connect storm: devices coming back all at once (after a network outage or a broker restart),
`--rate` CONNECTs/s for `--seconds`, and how long each waits for its CONNACK, Lightgate and
Mosquitto side by side in one run.

Each CONNECT is scheduled at a fixed instant (t0 + k / rate, spread over `--workers` processes)
and its latency runs from that instant, not from when the generator got round to it, so a late
generator or a full listen backlog (SYN retried after 1 s) shows as latency rather than hiding.
At most `--max-pending` CONNECTs per worker await their CONNACK at once (as a device's backoff
would): unbounded, a listen backlog overflows and the kernel's SYN retries (1, 3, 7 ... s) make
the figure a measure of TCP's timers, not the broker. Connections stay open until the storm is over (a fleet reconnects to stay), so rate x seconds
must fit the broker's fd limit (`ulimit -Hn`); sources spread over 127.0.0.2, 127.0.0.3, ...

Brokers are started afresh each round and stopped by PID exactly as in many_devices.py (same
configs); the order rotates per round. Reported: connected / failed, CONNACK p50/p99/max (ms),
the achieved connect rate, broker CPU per connect and the load generator's CPU. JSON lines go to
bench/results/connect-storm-<date>.jsonl (git-ignored), a table to stdout.

Usage (from the repository root):
    .venv/bin/python bench/connect_storm.py --rate 10000 --seconds 1.5 [--rounds 3]
        [--brokers lightgate,mosquitto] [--workers 2] [--serve-args "--set k=v"]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from array import array
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fleet_mqtt import (
    ROOT,
    Client,
    Counters,
    connect_packet,
    cpu_s,
    free_port,
    open_client,
    pct,
    process_tree,
    recv_within,
    rss_kb,
    run_worker,
    source_addresses,
    start_broker,
    stop_broker,
)


async def storm(spec: dict[str, Any], pipe: Connection) -> None:
    c = Counters()
    t0 = pipe.recv()  # CLOCK_MONOTONIC (s), the same for every worker
    period = spec["workers"] / spec["rate"]
    offset = spec["index"] / spec["rate"]
    sources: list[str] = spec["sources"]
    lat_ms = array("d")
    clients: list[Client] = []
    failed: list[str] = []

    pending = asyncio.Semaphore(spec["max_pending"])

    async def one(k: int, due: float) -> None:
        hello = connect_packet(f"storm{spec['index']}-{k}")
        try:
            cl = await open_client(spec["port"], sources[k % len(sources)], c, hello, 1, 30)
        except (TimeoutError, OSError) as e:
            failed.append(repr(e))
            return
        finally:
            pending.release()
        lat_ms.append((time.monotonic() - due) * 1000)
        clients.append(cl)

    tasks = []
    for k in range(spec["count"]):
        due = t0 + offset + k * period
        delay = due - time.monotonic()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        await pending.acquire()  # a late CONNECT still counts from its due time
        tasks.append(asyncio.ensure_future(one(k, due)))
    await asyncio.gather(*tasks)
    done_at = time.monotonic()
    pipe.send(
        {
            "lat_ms": sorted(lat_ms),
            "failed": len(failed),
            "first_error": failed[0] if failed else "",
            "done_at": done_at,
            "errors": c.errors[:5],
        }
    )
    pipe.recv()  # hold until the coordinator has read the broker
    for cl in clients:
        if cl.transport is not None:
            cl.transport.write(b"\xe0\x00")
            cl.transport.close()
    await asyncio.sleep(0.2)


def worker_entry(spec: dict[str, Any], pipe: Connection) -> None:
    run_worker(storm, spec, pipe)


def run_once(args: argparse.Namespace, kind: str, rnd: int) -> dict[str, Any]:
    port = free_port()
    total = int(args.rate * args.seconds)
    sources = source_addresses(total, args.source_ips)
    n_src = len(sources)
    with tempfile.TemporaryDirectory(prefix=f"connect-storm-{kind}-") as tmp:
        broker = start_broker(kind, port, Path(tmp), args.serve_args.split())
        procs: list[Any] = []
        try:
            time.sleep(args.settle)
            bpids = process_tree(broker.pid)
            ctx = mp.get_context("fork")
            pipes = []
            for w in range(args.workers):
                here, there = ctx.Pipe()
                spec = {
                    "port": port,
                    "rate": args.rate,
                    "workers": args.workers,
                    "index": w,
                    "count": len(range(w, total, args.workers)),
                    "sources": sources,
                    "max_pending": args.max_pending,
                }
                p = ctx.Process(target=worker_entry, args=(spec, there), daemon=True)
                p.start()
                procs.append(p)
                pipes.append(here)
            time.sleep(0.3)  # workers up
            gpids = [p.pid for p in procs]
            rss0 = rss_kb(bpids)
            t0 = time.monotonic() + 0.2
            b0, g0 = cpu_s(bpids), cpu_s(gpids)
            for pp in pipes:
                pp.send(t0)
            res = [recv_within(pp, args.seconds + 90) for pp in pipes]
            b1, g1 = cpu_s(bpids), cpu_s(gpids)
            rss1 = rss_kb(process_tree(broker.pid))
            for pp in pipes:
                pp.send("close")
        finally:
            for proc in procs:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            stop_broker(broker)
    lat = sorted(x for r in res for x in r["lat_ms"])
    span = max(r["done_at"] for r in res) - t0
    return {
        "bench": "connect_storm",
        "broker": kind,
        "round": rnd,
        "ts": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "rate": args.rate,
        "seconds": args.seconds,
        "workers": args.workers,
        "source_ips": n_src,
        "attempted": total,
        "connected": len(lat),
        "failed": sum(r["failed"] for r in res),
        "first_error": next((r["first_error"] for r in res if r["first_error"]), ""),
        "connects_per_s": round(len(lat) / span, 1) if span > 0 else None,
        "connack_p50_ms": round(pct(lat, 0.5), 2),
        "connack_p99_ms": round(pct(lat, 0.99), 2),
        "connack_max_ms": round(lat[-1], 2) if lat else None,
        "broker_cpu_us_per_connect": round((b1 - b0) * 1e6 / max(1, len(lat)), 1),
        "broker_rss_kb_per_conn": round((rss1 - rss0) / max(1, len(lat)), 2),
        "loadgen_cpu_s": round(g1 - g0, 2),
        "storm_s": round(span, 2),
        "errors": [e for r in res for e in r["errors"]][:5],
    }


COLUMNS = [
    ("connected/attempted", lambda rs: f"{_med(rs, 'connected'):,.0f}/{rs[0]['attempted']:,}"),
    ("failed", lambda rs: f"{_med(rs, 'failed'):.0f}"),
    ("connects/s", lambda rs: f"{_med(rs, 'connects_per_s'):,.0f}"),
    ("CONNACK p50 ms", lambda rs: f"{_med(rs, 'connack_p50_ms'):.1f}"),
    ("CONNACK p99 ms", lambda rs: f"{_med(rs, 'connack_p99_ms'):.1f}"),
    ("max ms", lambda rs: f"{_med(rs, 'connack_max_ms'):.0f}"),
    ("broker CPU µs/connect", lambda rs: f"{_med(rs, 'broker_cpu_us_per_connect'):.0f}"),
    ("RSS KiB/conn", lambda rs: f"{_med(rs, 'broker_rss_kb_per_conn'):.1f}"),
    ("loadgen CPU s", lambda rs: f"{_med(rs, 'loadgen_cpu_s'):.2f}"),
]


def _med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r[key] is not None]
    return float(statistics.median(vals)) if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--rate", type=float, default=10000.0, help="CONNECTs per second")
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--brokers", default="lightgate,mosquitto")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--source-ips", type=int, default=0, help="0: one per 25k connections")
    ap.add_argument(
        "--max-pending", type=int, default=256, help="CONNECTs awaiting CONNACK, per worker"
    )
    ap.add_argument("--settle", type=float, default=1.0, help="s between broker start and storm")
    ap.add_argument("--serve-args", default="", help="extra `lightgate serve` arguments")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if args.rate * args.seconds + 100 > hard:
        raise SystemExit(
            f"{args.rate * args.seconds:.0f} connections do not fit the hard fd limit of {hard} "
            "(`ulimit -Hn`), which the brokers inherit: fewer --seconds, or raise it (as root)"
        )
    brokers = args.brokers.split(",")
    out = args.out or ROOT / "bench" / "results" / f"connect-storm-{dt.date.today()}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(args.rounds):
        for k in range(len(brokers)):
            kind = brokers[(k + rnd) % len(brokers)]
            row = run_once(args, kind, rnd)
            rows.append(row)
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print(f"\n{args.rate:g} CONNECTs/s for {args.seconds:g} s; raw lines: {out}\n")
    print("| broker (median of rounds) | " + " | ".join(c[0] for c in COLUMNS) + " |")
    print("|" + "---|" * (len(COLUMNS) + 1))
    for b in brokers:
        rs = [r for r in rows if r["broker"] == b]
        if rs:
            print(f"| {b} ({len(rs)}) | " + " | ".join(f(rs) for _, f in COLUMNS) + " |")


if __name__ == "__main__":
    main()
