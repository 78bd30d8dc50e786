"""Recovery: torn tails at every byte, corruption in the middle, lost indexes, crash leftovers."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from store import MqttMessage, Store, StoreConfig
from store.record_batch import build_batch, iter_batches, iter_records

CFG = StoreConfig(default_partitions=1)


def seg_files(data: Path, topic: str = "t") -> list[Path]:
    return sorted((data / "log" / f"{topic}-0").glob("*.log"))


def crash(data: Path) -> None:
    """What a crash leaves: no clean-shutdown marker (the files are as a kill -9 leaves them)."""
    (data / "log" / "clean-shutdown").unlink(missing_ok=True)


def values(store: Store, topic: str = "t") -> list[bytes | None]:
    out, off = [], store.log_start_offset(topic, 0)
    while off < store.high_watermark(topic, 0):
        data = store.read(topic, 0, off, 1 << 20)
        recs = [r for p, n in iter_batches(data) for r in iter_records(data[p : p + n])]
        out += [r.value for r in recs if r.offset >= off]
        off = recs[-1].offset + 1
    return out


async def make_log(data: Path, batches: int, cfg: StoreConfig = CFG) -> list[int]:
    """Append `batches` producer batches of 3 records; returns each batch's end position."""
    store = await Store.open(data, cfg)
    for i in range(batches):
        recs = [(1000 + i, None, b"b%d-%d" % (i, j), [("h", b"x")]) for j in range(3)]
        await store.append_batch("t", 0, bytes(build_batch(recs))).durable
    await store.close()
    ends, pos = [], 0
    raw = b"".join(p.read_bytes() for p in seg_files(data))
    for p, n in iter_batches(raw):
        pos = p + n
        ends.append(pos)
    return ends


async def test_truncate_last_batch_at_every_byte(tmp_path: Path) -> None:
    base = tmp_path / "base"
    ends = await make_log(base, 3)
    for cut in range(ends[1], ends[2]):
        data = tmp_path / f"cut{cut}"
        shutil.copytree(base, data)
        crash(data)
        with open(seg_files(data)[0], "r+b") as f:
            f.truncate(cut)
        store = await Store.open(data, CFG)
        assert store.high_watermark("t", 0) == 6, cut
        assert values(store)[-1] == b"b1-2"
        res = store.append_batch("t", 0, bytes(build_batch([(5, None, b"new", [])])))
        assert res.offsets == [("t", 0, 6)]
        await res.durable
        await store.close()
        assert seg_files(data)[0].stat().st_size == ends[1] + (
            len(build_batch([(5, None, b"new", [])]))
        )
        shutil.rmtree(data)


async def test_corrupt_middle_batch_truncates_and_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ends = await make_log(tmp_path, 5)
    crash(tmp_path)
    seg = seg_files(tmp_path)[0]
    raw = bytearray(seg.read_bytes())
    raw[ends[1] + 70] ^= 0xFF  # inside the records of the third batch
    seg.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="lightgate.store"):
        store = await Store.open(tmp_path, CFG)
    assert store.high_watermark("t", 0) == 6
    assert any(
        "CRC mismatch" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records
    )
    assert seg.stat().st_size == ends[1]
    await store.close()


async def test_corruption_in_an_earlier_segment_drops_later_ones(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=300)
    await make_log(tmp_path, 8, cfg)
    segs = seg_files(tmp_path)
    assert len(segs) >= 4
    crash(tmp_path)
    (tmp_path / "log" / "t-0" / "recovery-point").unlink()  # nothing known flushed: scan all
    victim = segs[1]
    raw = bytearray(victim.read_bytes())
    raw[70] ^= 1  # in the records of its first batch
    victim.write_bytes(raw)
    store = await Store.open(tmp_path, cfg)
    hwm = store.high_watermark("t", 0)
    assert hwm == int(victim.stem)  # the bad batch and everything after it are gone
    assert seg_files(tmp_path) == segs[:2]
    assert len(values(store)) == hwm
    await store.close()


async def test_unclean_shutdown_keeps_everything_written(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=400)
    await make_log(tmp_path, 6, cfg)
    crash(tmp_path)
    store = await Store.open(tmp_path, cfg)
    assert store.high_watermark("t", 0) == 18 and len(values(store)) == 18
    await store.close()


async def test_missing_and_corrupt_indexes_are_rebuilt(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=250, index_interval_bytes=1)
    await make_log(tmp_path, 10, cfg)
    d = tmp_path / "log" / "t-0"
    idx = sorted(d.glob("*.index"))
    assert len(idx) >= 3
    good = idx[1].read_bytes()
    idx[0].unlink()
    idx[1].write_bytes(good[:-3])  # torn
    tix = sorted(d.glob("*.timeindex"))
    tix[2].write_bytes(b"\xff" * 12)  # nonsense
    store = await Store.open(tmp_path, cfg)
    assert len(values(store)) == 30
    for i in range(10):
        assert store.offset_for_timestamp("t", 0, 1000 + i) == 3 * i
        data = store.read("t", 0, 3 * i + 1, 1)
        assert int.from_bytes(data[:8], "big") == 3 * i
    assert idx[0].exists() and idx[1].read_bytes() == good  # written back once rebuilt
    await store.close()


async def test_crash_leftovers_are_cleaned(tmp_path: Path) -> None:
    cfg = StoreConfig(default_partitions=1, segment_bytes=300)
    await make_log(tmp_path, 4, cfg)
    d = tmp_path / "log" / "t-0"
    # Crash points: during retention (renamed to .deleted), during an atomic write (.tmp),
    # and an index whose .log is already gone.
    first, second = seg_files(tmp_path)[:2]
    first.rename(str(first) + ".deleted")
    (d / "recovery-point.tmp").write_text("999")
    (d / "00000000000000099999.index").write_bytes(b"")
    crash(tmp_path)
    store = await Store.open(tmp_path, cfg)
    names = sorted(p.name for p in d.iterdir())
    assert not [
        n for n in names if n.endswith((".deleted", ".tmp")) or n.startswith("000000000000000999")
    ]
    assert store.log_start_offset("t", 0) == int(second.stem) > 0
    assert store.high_watermark("t", 0) == 12
    await store.close()


async def test_mqtt_append_after_recovery_continues_offsets(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, CFG)
    await store.append_mqtt([MqttMessage("t/a", b"1", 1, "c")] * 5).durable
    await store.close()
    crash(tmp_path)
    store = await Store.open(tmp_path, CFG)
    res = store.append_mqtt([MqttMessage("t/a", b"2", 1, "c")])
    assert res.offsets == [("t", 0, 5)]
    await res.durable
    assert values(store) == [b"1"] * 5 + [b"2"]
    await store.close()
