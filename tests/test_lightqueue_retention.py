"""Retention trims queues; unheld filters are dropped after a grace period; a log that lost its
tail (OS crash) voids the entries past its end instead of letting them alias new records."""

from __future__ import annotations

import os
import time
from pathlib import Path

from lightqueue_helpers import flushed, msg

from lightqueue.keys import KIND_DROPPED, KIND_FILTER, P_ENTRY, block_count, entry_prefix
from lightqueue.queues import LightQueueConfig, LightQueues
from store import MqttMessage, Store, StoreConfig

NOW = int(time.time() * 1000)


async def open_small(data: Path, **cfg: object) -> tuple[Store, LightQueues]:
    conf = StoreConfig(default_partitions=1, fsync="never", segment_bytes=2048,
                       retention_ms=30 * 60_000)  # fmt: skip
    store = await Store.open(data, conf)
    return store, LightQueues.open(data, store, LightQueueConfig(**cfg))  # type: ignore[arg-type]


def entries_below(lq: LightQueues, queue: str, seq: int) -> int:
    """Entries stored in blocks that end at or below `seq` (the block holding `seq` stays)."""
    q = lq.qdb.queues[queue]
    n = 0
    for k, v in lq.qdb.db.iterator(prefix=entry_prefix(q.qid)):
        if int.from_bytes(k[5:], "big") + block_count(v) <= seq:
            n += block_count(v)
    return n


async def test_retention_trims_queues(tmp_path: Path) -> None:
    store, lq = await open_small(tmp_path)
    await lq.start()
    old = [MqttMessage(f"r/{i % 2}", b"old%d" % i, 1, "c", timestamp_ms=NOW - 3_600_000)
           for i in range(200)]  # fmt: skip
    for i in range(0, 200, 20):  # small appends: many small segments (and entry blocks)
        store.append_mqtt(old[i : i + 20])
        await flushed(store)
        lq.dispatcher.catch_up()
    new = [MqttMessage(f"r/{i % 2}", b"new%d" % i, 1, "c") for i in range(40)]
    store.append_mqtt(new)
    await flushed(store)
    lq.dispatcher.catch_up()
    lq.acquire_filter("r/+")
    assert lq.info("r/0")[1:] == (0, 120)  # type: ignore[index]
    assert store.enforce_retention() > 0
    log_start = store.log_start_offset("r", 0)
    assert 0 < log_start <= 200
    # A read before the queue start says so, and returns the first valid sequence...
    res = lq.read("r/0", 0, 1000)
    assert res.start_seq > 0 and res.first_seq == res.start_seq
    msgs = lq.resolve(res.entries)
    assert all(m is not None for m in msgs)
    assert msgs[0] is not None and msgs[0].offset >= log_start
    # ... before and after the maintenance task persisted the trim.
    assert lq.trim() == 2  # both exact queues (the filter queue was empty)
    assert lq.info("r/0")[1] == res.start_seq  # type: ignore[index]
    assert lq.read("r/0", 3, 10).start_seq == res.start_seq
    # Trimmed entries are purged from disk.
    assert entries_below(lq, "r/0", res.start_seq) > 0
    lq.purge(10**6)
    assert entries_below(lq, "r/0", res.start_seq) == 0
    # Entries still valid resolve to exactly the surviving messages, in order.
    r0 = [m.payload for m in lq.resolve(lq.read("r/0", 0, 1000).entries) if m]
    assert r0[-20:] == [b"new%d" % i for i in range(0, 40, 2)]
    await lq.close()
    await store.close()


async def test_trim_reads_only_the_topics_whose_start_moved(tmp_path: Path, monkeypatch) -> None:
    """A moved log start trims the exact queues of that log topic (and the filter queues), in
    slices; another topic's queues are not read at all, whatever their number: a queue of `k/`
    whose blocks would make the walk fail shows that none of its blocks was opened."""
    import lightqueue.maintenance as maint

    monkeypatch.setattr(maint, "TRIM_SLICE", 3)
    store, lq = await open_small(tmp_path)
    await lq.start()
    for i in range(0, 200, 20):
        store.append_mqtt([MqttMessage(f"r/{j % 5}", b"o", 1, "c", timestamp_ms=NOW - 3_600_000)
                           for j in range(i, i + 20)])  # fmt: skip
        store.append_mqtt([msg(f"k/{j % 7}") for j in range(i, i + 20)])
        await flushed(store)
        lq.dispatcher.catch_up()
    store.append_mqtt([msg(f"r/{j % 5}") for j in range(10)])
    await flushed(store)
    lq.dispatcher.catch_up()
    lq.trim()  # the first look: nothing moved from 0 yet
    assert store.enforce_retention() > 0
    assert store.log_start_offset("k", 0) == 0 < store.log_start_offset("r", 0)
    seen: list[int] = []
    real = maint.block_start
    monkeypatch.setattr(
        maint, "block_start", lambda db, qid, seq: seen.append(qid) or real(db, qid, seq)
    )
    assert lq.trim() == 5  # r/0..r/4, in slices of 3 queues
    k_qids = {lq.qdb.queues[f"k/{j}"].qid for j in range(7)}
    assert seen and not k_qids & set(seen)
    assert all(lq.info(f"r/{j}")[1] > 0 for j in range(5))  # type: ignore[index]
    assert all(lq.info(f"k/{j}")[1] == 0 for j in range(7))  # type: ignore[index]
    await lq.close()
    await store.close()


async def test_unheld_filter_dropped_after_grace_and_never_reuses_seqs(tmp_path: Path) -> None:
    store, lq = await open_small(tmp_path, filter_grace_s=30.0)
    await lq.start()
    lq.acquire_filter("g/#")
    lq.acquire_filter("g/#")
    store.append_mqtt([msg("g/1") for _ in range(5)])
    await flushed(store)
    lq.dispatcher.catch_up()
    lq.release_filter("g/#")
    assert lq.gc(time.monotonic() + 3600) == 0  # still held once
    lq.release_filter("g/#")
    t0 = time.monotonic()
    assert lq.gc(t0 + 10) == 0  # within the grace period
    assert lq.gc(t0 + 31) == 1
    assert lq.info("g/#") == (KIND_DROPPED, 5, 5)
    store.append_mqtt([msg("g/1")])
    await flushed(store)
    lq.dispatcher.catch_up()
    assert lq.info("g/#") == (KIND_DROPPED, 5, 5)  # no longer fed
    lq.purge(10**6)
    assert entries_below(lq, "g/#", 5) == 0
    # Re-created: continues after the old sequence numbers, starting at the live end.
    assert lq.acquire_filter("g/#") == ("g/#", 5)
    assert lq.info("g/#") == (KIND_FILTER, 5, 5)
    store.append_mqtt([msg("g/2")])
    await flushed(store)
    lq.dispatcher.catch_up()
    res = lq.read("g/#", 0, 10)
    assert (res.start_seq, res.next_seq, len(res.entries)) == (5, 6, 1)
    await lq.close()
    await store.close()
    # After a restart nothing holds the filter: the grace period starts again at open.
    store, lq = await open_small(tmp_path, filter_grace_s=30.0)
    assert lq.gc(time.monotonic() + 1) == 0
    assert lq.gc(time.monotonic() + 31) == 1
    lq.qdb.close()
    await store.close()


async def test_log_tail_lost_voids_entries(tmp_path: Path) -> None:
    conf = StoreConfig(default_partitions=1, fsync="never")
    store = await Store.open(tmp_path, conf)
    lq = LightQueues.open(tmp_path, store)
    await lq.start()
    lq.acquire_filter("t/#")
    for i in range(10):
        store.append_mqtt([msg("t/a", b"first%d" % i)])
        await flushed(store)
    lq.dispatcher.catch_up()
    await lq.close()
    await store.close()
    # An OS crash lost the log's unflushed tail (LevelDB kept its own writes).
    seg = next((tmp_path / "log" / "t-0").glob("*.log"))
    size = seg.stat().st_size
    with open(seg, "r+b") as f:
        f.truncate(size * 6 // 10 + 3)  # mid-batch: recovery cuts it
    os.remove(seg.with_suffix(".index")) if seg.with_suffix(".index").exists() else None
    (tmp_path / "log" / "clean-shutdown").unlink(missing_ok=True)
    store = await Store.open(tmp_path, conf)
    hwm = store.high_watermark("t", 0)
    assert 0 < hwm < 10
    lq = LightQueues.open(tmp_path, store)
    await lq.start()
    assert lq.qdb.checkpoints[("t", 0)] == hwm
    store.append_mqtt([msg("t/a", b"second%d" % i) for i in range(3)])  # reuses offsets
    await flushed(store)
    lq.dispatcher.catch_up()
    for q in ("t/a", "t/#"):
        res = lq.read(q, 0, 100)
        assert (res.start_seq, res.next_seq) == (0, 13)  # dense, nothing renumbered
        got = [m.payload if m else None for m in lq.resolve(res.entries)]
        assert got == [b"first%d" % i for i in range(hwm)] + [None] * (10 - hwm) + [
            b"second0", b"second1", b"second2"]  # fmt: skip
    n_entries = sum(block_count(v) for _, v in lq.qdb.db.iterator(prefix=P_ENTRY))
    assert n_entries == 26
    await lq.close()
    await store.close()
