"""Retention (time, size, per topic), segment roll, index lookups, lock-free reader edge cases."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from store import OffsetOutOfRangeError, Store, StoreConfig
from store import segment_reader as sr
from store.record_batch import build_batch, iter_batches

DAY = 24 * 3600 * 1000


def batch(ts: int, n: int = 2, size: int = 50) -> bytes:
    return bytes(build_batch([(ts + i, None, b"v" * size, []) for i in range(n)]))


async def fill(store: Store, topic: str, stamps: list[int]) -> None:
    for ts in stamps:
        await store.append_batch(topic, 0, batch(ts)).durable


async def wait_files_gone(paths: list[Path]) -> None:
    for _ in range(200):
        if not any(p.exists() for p in paths):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"still there: {[p for p in paths if p.exists()]}")


async def test_time_retention_deletes_whole_old_segments(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=400, retention_ms=DAY)
    store = await Store.open(tmp_path, cfg)
    now = int(time.time() * 1000)
    await fill(store, "t", [now - 3 * DAY] * 6 + [now] * 6)
    d = tmp_path / "log" / "t-0"
    before = sorted(d.glob("*.log"))
    assert len(before) >= 4
    deleted = store.enforce_retention(now)
    assert deleted >= 1
    start = store.log_start_offset("t", 0)
    assert 0 < start <= 12  # only segments wholly older than a day went
    with pytest.raises(OffsetOutOfRangeError):
        store.read("t", 0, start - 1, 100)
    assert int.from_bytes(store.read("t", 0, start, 1)[:8], "big") == start
    await wait_files_gone(before[:deleted])
    assert store.offset_for_timestamp("t", 0, 0) == start
    await store.close()
    store = await Store.open(tmp_path, cfg)
    assert store.log_start_offset("t", 0) == start and store.high_watermark("t", 0) == 24
    await store.close()


async def test_expired_active_segment_is_rolled_then_deleted(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, retention_ms=DAY)
    store = await Store.open(tmp_path, cfg)
    now = int(time.time() * 1000)
    await fill(store, "t", [now - 2 * DAY] * 3)
    assert store.enforce_retention(now) == 1
    assert store.log_start_offset("t", 0) == store.high_watermark("t", 0) == 6
    assert store.read("t", 0, 6, 100) == b""
    res = store.append_batch("t", 0, batch(now))
    assert res.offsets[0][2] == 6
    await res.durable
    await store.close()


async def test_size_retention_and_per_topic_config(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=300, retention_ms=-1)
    store = await Store.open(tmp_path, cfg)
    store.create_topic("small", 1, {"retention_bytes": 700})
    now = int(time.time() * 1000)
    await fill(store, "small", [now] * 12)
    await fill(store, "big", [now] * 12)
    store.enforce_retention(now)
    assert store.log_start_offset("big", 0) == 0
    segs = sr.list_segments(tmp_path, "small", 0)
    sizes = sum(s.size for s in segs if s.base_offset >= store.log_start_offset("small", 0))
    assert store.log_start_offset("small", 0) > 0 and sizes <= 700 + 300
    await store.close()
    store = await Store.open(tmp_path, cfg)
    assert store.topic_config("small").retention_bytes == 700
    assert store.topic_config("big").retention_bytes == -1
    await store.close()


async def test_roll_by_size_and_index_lookups(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=1000, index_interval_bytes=300)
    store = await Store.open(tmp_path, cfg)
    await fill(store, "t", list(range(1000, 1040)))  # 40 batches of 2 records, ~170 B each
    segs = sr.list_segments(tmp_path, "t", 0)
    assert len(segs) > 5 and all(s.size <= 1000 for s in segs)
    for off in range(80):
        data = store.read("t", 0, off, 1)
        assert int.from_bytes(data[:8], "big") == off - off % 2  # the batch holding `off`
    data = store.read("t", 0, 10, 600)
    assert len(list(iter_batches(data))) == 3 and len(data) <= 600
    # Batch k holds offsets 2k, 2k+1 with timestamps 1000+k, 1001+k.
    assert store.offset_for_timestamp("t", 0, 0) == 0
    assert store.offset_for_timestamp("t", 0, 1000) == 0
    for ts in range(1001, 1041):
        assert store.offset_for_timestamp("t", 0, ts) == 2 * (ts - 1000) - 1
    assert store.offset_for_timestamp("t", 0, 1041) is None
    await store.close()
    # Sealed segments carry indexes the lock-free reader uses and checks.
    assert (tmp_path / "log" / "t-0" / (f"{segs[1].base_offset:020d}.index")).stat().st_size > 0
    assert [b.base_offset for b in sr.iter_batches(tmp_path, "t", 0, 33, 40)] == [32, 34, 36, 38]


async def test_read_hint_never_changes_what_a_read_returns(tmp_path: Path) -> None:
    """Reads leave a per-segment hint (where the last read ended); a read at any offset, before
    or after the hint, in any order, returns the batch holding that offset, as without hints."""
    import random

    cfg = StoreConfig(default_partitions=1, segment_bytes=1 << 20, index_interval_bytes=4096)
    store = await Store.open(tmp_path, cfg)
    await fill(store, "h", list(range(1000, 1200)))  # 200 batches of 2 records, one segment
    seg = store._logs[("h", 0)].segments[-1]
    rng = random.Random(7)
    offsets = list(range(400)) + [rng.randrange(400) for _ in range(600)]
    for off in offsets:
        max_bytes = rng.choice((1, 200, 2000))
        hint = seg.hint
        seg.hint = None
        plain = store.read("h", 0, off, max_bytes)  # the header walk from the index, no hint
        seg.hint = hint
        data = store.read("h", 0, off, max_bytes)  # sequential offsets take the hint's shortcut
        assert data == plain, (off, max_bytes, hint)
        assert int.from_bytes(data[:8], "big") == off - off % 2, off
        assert seg.hint is not None and seg.hint[0] > off  # the hint moved past the read
    seg.truncate_to(seg.find_position(100)[0])  # cut at offset 100: the hint must go
    assert seg.hint is None
    await store.close()


def test_reader_stops_at_partial_or_bad_batch(tmp_path: Path) -> None:
    d = tmp_path / "log" / "t-0"
    d.mkdir(parents=True)
    a, b, c = (build_batch([(1, None, b"x%d" % i, [])], base_offset=i) for i in range(3))
    f = d / "00000000000000000000.log"
    f.write_bytes(bytes(a + b + c[:-1]))
    assert [x.base_offset for x in sr.iter_batches(tmp_path, "t", 0)] == [0, 1]
    bad = bytearray(c)
    bad[-1] ^= 1
    f.write_bytes(bytes(a + bad + b))
    assert [x.base_offset for x in sr.iter_batches(tmp_path, "t", 0)] == [0]
    f.write_bytes(bytes(a + b + c + b"\0" * 30))  # torn header
    assert [r.value for r in sr.iter_records_from(tmp_path, "t", 0, 1)] == [b"x1", b"x2"]
    assert sr.high_watermark(tmp_path, "t", 0) == 3
    assert sr.list_partitions(tmp_path) == [("t", 0)] and sr.list_topics(tmp_path) == {"t": 1}
    # A segment missing from a listing (readdir racing a roll, or retention) ends the prefix.
    f.write_bytes(bytes(a))
    (d / "00000000000000000002.log").write_bytes(bytes(c))
    assert [x.base_offset for x in sr.iter_batches(tmp_path, "t", 0)] == [0]
    (d / "00000000000000000001.log").write_bytes(bytes(b))
    assert [x.base_offset for x in sr.iter_batches(tmp_path, "t", 0)] == [0, 1, 2]


async def test_reader_thread_during_appends(tmp_path: Path) -> None:
    """A reader thread polling the files while the loop appends sees a growing, hole-free prefix."""
    store = await Store.open(
        tmp_path, StoreConfig(default_partitions=1, fsync="never", segment_bytes=50_000)
    )
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        last = 0
        while not stop.is_set():
            offs = [r.offset for r in sr.iter_records_from(tmp_path, "t", 0)]
            if offs != list(range(len(offs))) or len(offs) < last:
                errors.append(f"bad prefix {offs[:5]}..{len(offs)}")
            last = len(offs)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for i in range(300):
            store.append_batch("t", 0, batch(i, n=5, size=300))
            await asyncio.sleep(0)
    finally:
        stop.set()
        th.join()
    assert not errors
    assert sr.high_watermark(tmp_path, "t", 0) == store.high_watermark("t", 0) == 1500
    await store.close()


async def test_an_fsync_round_takes_the_segments_written_since_the_last(tmp_path: Path) -> None:
    # Log.unsynced looks only at the end of the segment list; it must find what a scan of
    # every segment finds, through rolls, rounds and DeleteRecords.
    cfg = StoreConfig(default_partitions=1, segment_bytes=400, fsync="never")
    store = await Store.open(tmp_path, cfg)
    now = int(time.time() * 1000)
    await fill(store, "t", [now] * 12)
    lg = store._log("t", 0)

    def scan() -> list[object]:
        return [s for s in lg.segments if s.dirty]

    assert len(lg.segments) >= 4 and lg.unsynced() == scan() == lg.segments
    store._commit.start_sync(lg)
    await store._commit.drain()
    assert lg.unsynced() == scan() == []
    await fill(store, "t", [now])
    assert lg.unsynced() == scan() == [lg.active]
    n = len(lg.segments)
    while len(lg.segments) == n:  # until the log rolls: the old active and the new one
        await fill(store, "t", [now])
    assert lg.unsynced() == scan() == lg.segments[-2:]
    assert await store.delete_records("t", 0, -1) == lg.hwm  # rolls; the dirty ones go
    assert lg.unsynced() == scan() == []
    await fill(store, "t", [now])
    # An fsync of the active segment in flight: DeleteRecords keeps it, behind a new empty one.
    lg.active.sync_pending += 1
    kept = lg.active
    assert lg.delete_records_below(lg.hwm) == []
    assert lg.segments[-2] is kept and not lg.active.size
    assert lg.unsynced() == scan() == [kept]
    kept.sync_pending -= 1
    await store.close()
