"""store.cluster.batch_cache.BatchCache (the cluster log's fetched batches): what it answers after
evictions, re-fetches of evicted ranges and retention, against a plain model of the same FIFO.

Real RecordBatch v2 bytes (store.record_batch.build_batch), no cluster needed: the cache only
parses batch headers.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from store.cluster.batch_cache import BatchCache
from store.record_batch import build_batch, set_base_offset

PROTO = bytes(build_batch([(0, b"k", b"x" * 64, [])], base_offset=0))
SIZE = len(PROTO)


def _batch(base: int, records: int = 1) -> bytes:
    b = build_batch([(0, b"k", b"x" * 64, [])] * records, base_offset=0)
    set_base_offset(b, base)
    return bytes(b)


def _check(c: BatchCache, model: OrderedDict[int, tuple[int, bytes]], probe: list[int]) -> None:
    part = c._parts.get(("t", 0))
    if part is None:
        assert not model
        return
    live = part.bases[part.head :]
    assert live == sorted(model), "bases[head:] are the cached bases, sorted"
    assert set(part.batches) == set(model)
    assert c.bytes == sum(len(d) for _, d in model.values()) <= c.max_bytes
    for o in probe:
        want = next((b for b, (last, _) in model.items() if b <= o <= last), None)
        assert c.find("t", 0, o) == want, o
        got = c.read("t", 0, o, 1)
        assert got == (None if want is None else model[want][1]), o


def test_a_full_cache_of_small_batches_keeps_answering_in_order() -> None:
    """One-record batches past the budget: the oldest go, reads of the rest are exact, and the
    evicted prefix of `bases` does not grow without bound (it is cut once it is half the list)."""
    c = BatchCache(max_bytes=SIZE * 100)
    model: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
    for o in range(1000):
        data = _batch(o)
        assert c.insert("t", 0, data) == o + 1
        model[o] = (o, data)
        while sum(len(d) for _, d in model.values()) > c.max_bytes:
            model.popitem(last=False)
        if o % 97 == 0:
            _check(c, model, [o - 150, o - 100, o - 99, o - 50, o, o + 1])
    _check(c, model, list(range(880, 1001)))
    part = c._parts[("t", 0)]
    assert len(part.bases) <= 2 * 100 + 64
    # Contiguous batches are read as one run, up to about max_bytes.
    assert c.read("t", 0, 950, 3 * SIZE) == b"".join(model[o][1] for o in range(950, 953))


def test_refetched_ranges_and_retention_against_a_model() -> None:
    """A reader re-fetching an evicted older range inserts below the live bases; evictions then
    come out of offset order; retention drops from the bottom. After every step the cache
    answers what a plain FIFO model of the same inserts holds."""
    for seed in range(20):
        rnd = random.Random(seed)
        c = BatchCache(max_bytes=SIZE * 3 * 40)
        model: OrderedDict[int, tuple[int, bytes]] = OrderedDict()
        head = 0  # the partition's next offset; every batch holds 3 records
        floor = 0  # log start (retention)
        for _step in range(400):
            r = rnd.random()
            if r < 0.7 or head == floor:
                bases = [head]
                head += 3
            elif r < 0.93:  # an older range, maybe evicted: a lagging reader's fetch
                b = floor + 3 * rnd.randrange(max(1, (head - floor) // 3))
                bases = [b, b + 3] if b + 3 < head else [b]
            else:
                floor = min(head, floor + 3 * rnd.randrange(1, 6))
                c.drop_below("t", 0, floor)
                for b in [b for b, (last, _) in model.items() if last < floor]:
                    del model[b]
                _check(c, model, [floor - 1, floor, head - 1])
                continue
            data = b"".join(_batch(b, 3) for b in bases)
            c.insert("t", 0, data)
            for b in bases:
                if b not in model:
                    model[b] = (b + 2, _batch(b, 3))
            while sum(len(d) for _, d in model.values()) > c.max_bytes:
                model.popitem(last=False)
            _check(c, model, [rnd.randrange(0, head + 2) for _ in range(5)])
