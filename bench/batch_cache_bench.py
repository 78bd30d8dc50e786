"""What one fetched batch costs the cluster log's BatchCache once the cache is full.

    .venv/bin/python bench/batch_cache_bench.py [--mib 64] [--records 1] [--tree PATH]

A gateway on `log = "kafka"` caches what it fetches; at low rates every message is its own
batch, so a full 64 MiB cache holds ~500k of them and each insert evicts one. `--tree` runs
another checkout's store/cluster/batch_cache.py (a before/after of a change).
"""

from __future__ import annotations

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="cache size (the default cache_bytes)")
    ap.add_argument("--records", type=int, default=1, help="records per batch")
    ap.add_argument("--inserts", type=int, default=20000, help="timed inserts once full")
    ap.add_argument("--tree", default=None, help="import store/ from this checkout")
    a = ap.parse_args()
    if a.tree:
        sys.path.insert(0, a.tree)
    from store.cluster.batch_cache import BatchCache
    from store.record_batch import build_batch, set_base_offset

    proto = build_batch([(0, b"k", b"x" * 64, [])] * a.records, base_offset=0)
    size = len(proto)
    cache = BatchCache(a.mib << 20)
    offset = 0

    def insert() -> None:
        nonlocal offset
        b = bytearray(proto)
        set_base_offset(b, offset)
        cache.insert("t", 0, bytes(b))
        offset += a.records

    for _ in range(cache.max_bytes // size + 1000):  # full, and evicting
        insert()
    t0 = time.perf_counter()
    for _ in range(a.inserts):
        insert()
    us = (time.perf_counter() - t0) / a.inserts * 1e6
    held = len(cache._parts[("t", 0)].batches)
    print(f"{size}-byte batches, {a.mib} MiB cache holding {held:,}: {us:.1f} us per insert")


if __name__ == "__main__":
    main()
