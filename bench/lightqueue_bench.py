"""Light-queue benchmark: dispatch rate, read rate, storage per message, state encoding.

    .venv/bin/python bench/lightqueue_bench.py [--records 200000] [--quick]

Everything runs in this one process on one core, on a real Store (fsync never) and a real
LevelDB in a temp dir. Dispatch is timed as `Dispatcher.catch_up()` over records appended
beforehand, so it measures indexing alone (read + decode + match + WriteBatch), not the producer.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightqueue import codec  # noqa: E402
from lightqueue.keys import ENTRY_SIZE, P_ENTRY  # noqa: E402
from lightqueue.queues import LightQueueConfig, LightQueues  # noqa: E402
from store import MqttMessage, Store, StoreConfig  # noqa: E402

SITES, DEVS = 500, 20


HOT = "plant/hot/line/temp"


def topic_of(i: int) -> str:
    """20,000 topics under one first level, i.e. one log topic (4 partitions), plus one hot
    topic with every 10th record (the exact-queue read test)."""
    if i % 10 == 0:
        return HOT
    return f"plant/site{i % SITES}/dev{(i // SITES) % DEVS}/{'temp' if i % 3 else 'hum'}"


def filters(n: int) -> list[str]:
    """n distinct wildcard filters; each record matches ~1-3 of them at every n."""
    base = ["plant/+/+/temp", "plant/site1/#"]
    per_dev = (f"plant/site{s}/dev{d}/+" for s in range(SITES) for d in range(DEVS))
    per_site = (f"plant/site{s}/+/hum" for s in range(SITES))
    out = base + list(itertools.islice(itertools.chain(per_site, per_dev), max(0, n - 2)))
    return out[:n]


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != "LOG")


async def fill(store: Store, n: int, payload: bytes = b"x" * 64, topic=topic_of) -> None:  # type: ignore[no-untyped-def]
    for i in range(0, n, 2000):
        store.append_mqtt(
            [MqttMessage(topic(i + j), payload, 1, "dev") for j in range(min(2000, n - i))]
        )
        await asyncio.sleep(0)
    await asyncio.sleep(0.01)


async def bench_dispatch(records: int, nfilters: int) -> dict[str, float]:
    d = Path(tempfile.mkdtemp(prefix="lqbench"))
    try:
        store = await Store.open(d, StoreConfig(default_partitions=4, fsync="never"))
        await fill(store, records)
        lq = LightQueues.open(d, store, LightQueueConfig())
        for f in filters(nfilters):
            lq.acquire_filter(f)
        lq.dispatcher.refresh()
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        n = lq.dispatcher.catch_up()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - cpu0  # all threads: includes LevelDB's compaction thread
        assert lq.dispatcher.records == records, (n, records)
        entries = sum(q.next for q in lq.qdb.queues.values())
        # Read rate: one exact queue and one filter queue, 100 entries per read, resolved.
        res = {}
        for name in ("plant/+/+/temp", HOT):
            info = lq.info(name)
            if info is None:
                continue
            total, seq = 0, info[1]
            lq.resolver.clear()
            t1 = time.process_time()
            while seq < info[2]:
                r = lq.read(name, seq, 100)
                msgs = lq.resolve(r.entries)
                total += sum(1 for m in msgs if m is not None)
                seq = r.first_seq + len(r.entries)
            res["read_" + ("filter" if "+" in name else "exact")] = total / (
                time.process_time() - t1
            )
        await lq.close()
        await store.close()
        return {
            "rate": records / dt,
            "cpu_rate": records / cpu,
            "entries_per_rec": entries / records,
            **res,
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def bench_storage(messages: int, nfilters: int, same_filter_subs: int) -> dict[str, float]:
    """Index bytes per message when `nfilters` distinct filters (or `same_filter_subs`
    subscribers of one filter) match every message; commitlog bytes for comparison."""
    d = Path(tempfile.mkdtemp(prefix="lqstore"))
    try:
        store = await Store.open(d, StoreConfig(default_partitions=1, fsync="never"))
        lq = LightQueues.open(d, store, LightQueueConfig())
        depth = 14
        levels = [f"l{i}" for i in range(depth)]
        topic = "/".join(levels)
        fs = []
        for bits in range(1 << depth):
            if len(fs) >= nfilters:
                break
            f = "/".join("+" if bits >> i & 1 else lv for i, lv in enumerate(levels))
            if f != topic:
                fs.append(f)
        for f in fs:
            lq.acquire_filter(f)
        for _ in range(same_filter_subs - 1):
            lq.acquire_filter(fs[0])  # more subscribers of the same filter: same queue
        base = dir_bytes(d / "lightqueue")
        await fill(store, messages, topic=lambda i: topic)
        lq.dispatcher.refresh()
        lq.dispatcher.catch_up()
        n_entries = sum(len(v) // ENTRY_SIZE for _, v in lq.qdb.db.iterator(prefix=P_ENTRY))
        lq.qdb.db.compact_range()
        index = dir_bytes(d / "lightqueue") - base
        log_bytes = dir_bytes(d / "log")
        await lq.close()
        await store.close()
        return {
            "entries_per_msg": n_entries / messages,
            "index_per_msg": index / messages,
            "index_per_entry": index / n_entries,
            "log_per_msg": log_bytes / messages,
        }
    finally:
        shutil.rmtree(d, ignore_errors=True)


def bench_state_encoding() -> dict[str, float]:
    state = {
        "client_id": "sensor-0042", "expiry": 3600, "version": 5, "disconnected_at": 1764000000.5,
        "next_pid": 17, "qos2_in": [3, 9],
        "subs": [{"raw": f"site{i}/+/temp", "filter": f"site{i}/+/temp", "group": None, "qos": 1,
                  "nl": False, "rap": False, "rh": 0, "sid": None, "pos": 123456 + i,
                  "local": False} for i in range(5)],
        "inflight": [[p, "site1/+/temp", 1000 + p, 1, b"\x32" + os.urandom(60), False,
                      "site1/+/temp"] for p in range(1, 11)],
        "will": {"topic": "w/x", "payload": b"bye", "qos": 1, "retain": False, "delay": 0,
                 "props": None},
    }  # fmt: skip

    def hexify(o: object) -> object:
        return o.hex() if isinstance(o, bytes) else o

    js = json.dumps(state, default=hexify).encode()
    cb = codec.encode(state)
    n = 5000
    t = time.perf_counter()
    for _ in range(n):
        codec.decode(codec.encode(state))
    c_us = (time.perf_counter() - t) / n * 1e6
    t = time.perf_counter()
    for _ in range(n):
        json.loads(json.dumps(state, default=hexify))
    j_us = (time.perf_counter() - t) / n * 1e6
    return {"codec_bytes": len(cb), "json_bytes": len(js), "codec_us": c_us, "json_us": j_us}


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--default-gc", action="store_true", help="keep CPython's GC thresholds (serve tunes them)"
    )
    ap.add_argument(
        "--gc-gen0", type=int, default=None, help="the young threshold to tune (default: serve's)"
    )
    args = ap.parse_args()
    if not args.default_gc:
        from lightgate.cli import tune_gc

        if args.gc_gen0 is None:
            tune_gc()  # as `lightgate serve` runs
        else:
            tune_gc(args.gc_gen0)
    recs = 20_000 if args.quick else args.records
    random.seed(1)
    print(f"## dispatch ({recs} records, 4 partitions, 20,000 topics, one core)")
    print("| active wildcard filters | records/s (wall) | records/s (CPU time) | entries/record |"
          " exact read msg/s (CPU) | filter read msg/s (CPU) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for nf in (1, 100, 10_000):
        r = await bench_dispatch(recs, nf)
        print(f"| {nf:,} | {r['rate']:,.0f} | {r['cpu_rate']:,.0f} | {r['entries_per_rec']:.2f} |"
              f" {r.get('read_exact', 0):,.0f} | {r.get('read_filter', 0):,.0f} |")  # fmt: skip
    msgs = 200 if args.quick else 1000
    print(f"\n## storage ({msgs} messages of 64 B payload on one 14-level topic)")
    print(
        "| case | entries/message | index bytes/message | index bytes/entry | log bytes/message |"
    )
    print("|---|---|---|---|---|")
    for label, nf, subs in (
        ("1 subscriber, 1 filter", 1, 1),
        ("10,000 subscribers, same filter", 1, 10_000),
        ("10,000 subscribers, 10,000 distinct filters", 10_000, 1),
    ):
        r = await bench_storage(msgs, nf, subs)
        print(f"| {label} | {r['entries_per_msg']:,.0f} | {r['index_per_msg']:,.1f} |"
              f" {r['index_per_entry']:.1f} | {r['log_per_msg']:.1f} |")  # fmt: skip
    e = bench_state_encoding()
    print("\n## session state encoding (5 subscriptions, 10 in-flight QoS 1 messages)")
    print("| format | bytes | encode+decode us |")
    print("|---|---|---|")
    print(f"| lightqueue.codec | {e['codec_bytes']:.0f} | {e['codec_us']:.1f} |")
    print(f"| JSON (bytes as hex) | {e['json_bytes']:.0f} | {e['json_us']:.1f} |")


if __name__ == "__main__":
    asyncio.run(main())
