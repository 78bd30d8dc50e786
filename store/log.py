"""Log: one partition: a directory of segments; append, read, recovery, retention.

Offsets: `log_start_offset` ≤ every readable offset < `high_watermark`. Offsets are assigned when a
batch is staged (`stage`) and become visible when the staged bytes are written to the file
(`write_pending`, once per event-loop tick): the high watermark is the next offset after the last
batch in the file, so a `kill -9` after the write cannot lose visible data (it is in the page
cache). Durability on power loss comes from fsync, which the Store runs in a thread.

Recovery (`load`), in numbered passes (Kafka's LogLoader in miniature):
  1. delete crash leftovers: `*.deleted`, `*.tmp`, index files whose `.log` is gone;
  2. open segments in base-offset order;
  3. segments wholly below the recovery point are trusted: their indexes load lazily and are
     rebuilt if missing or inconsistent (derived data);
  4. from the segment holding the recovery point on (every segment after an unclean shutdown
     that the recovery point does not cover), scan every batch: length, magic, offsets, CRC-32C;
     truncate at the first bad one, delete any later segment, log what was cut;
  5. make sure an active segment exists;
  6. the log start offset is the first segment's base, or the floor DeleteRecords set
     (`log-start-offset`, written atomically before the segments below it are deleted).
After a clean shutdown pass 4 is skipped; the last segment's loaded index is checked with a
header walk from its last entry.

Event-loop-only, except `load`, which the Store runs in a worker thread before the loop uses the log.
The crash-safe file operations (atomic small files, deleting and sealing segments) are in
store/durable_files.py.
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store.durable_files import RECOVERY_POINT_FILE
from store.mapping import SYSTEM_TOPIC_PREFIX
from store.record_batch import (
    ATTRIBUTES_OFFSET,
    BASE_OFFSET_OFFSET,
    BH_BASE_OFFSET,
    BH_LAST_OFFSET_DELTA,
    HEADER,
    HEADER_SIZE,
    LENGTH_OFFSET,
    LOG_OVERHEAD,
    TIMESTAMP_TYPE_MASK,
    iter_batches,
    iter_records,
)
from store.segment import BatchMeta, LogSegment, segment_name

log = logging.getLogger("lightgate.store")

LOG_START_FILE = "log-start-offset"  # DeleteRecords' floor (Kafka's log-start-offset-checkpoint)
MAX_REL_OFFSET = (1 << 31) - 1
_LENGTH = struct.Struct(">i")


class OffsetOutOfRangeError(Exception):
    """Offset below the log start offset or above the high watermark."""

    def __init__(self, topic: str, partition: int, offset: int, start: int, hwm: int) -> None:
        super().__init__(
            f"offset {offset} out of range for {topic}-{partition} (log start {start}, hwm {hwm})"
        )
        self.offset, self.log_start_offset, self.high_watermark = offset, start, hwm


FRESH_MAX_BYTES = 2 << 20  # per partition, batches kept for Log.read_fresh (two MQTT ticks' worth)


class Log:
    __slots__ = (
        "dir", "topic", "partition", "segment_bytes", "segment_ms", "index_interval",
        "segments", "_bases", "next_offset", "hwm", "_pending", "_pending_meta", "_pending_size",
        "_pending_idx", "_fresh", "_fresh_bytes", "_fresh_ok",
        "failed", "sync_waiters", "syncing", "dir_dirty", "recovery_point",
        "changed", "start_floor",
    )  # fmt: skip

    def __init__(
        self,
        directory: Path,
        topic: str,
        partition: int,
        segment_bytes: int = 256 << 20,
        segment_ms: int = 7 * 24 * 3600 * 1000,
        index_interval: int = 4096,
    ) -> None:
        self.dir = directory
        self.topic = topic
        self.partition = partition
        self.segment_bytes = segment_bytes
        self.segment_ms = segment_ms
        self.index_interval = index_interval
        self.segments: list[LogSegment] = []
        self._bases: list[int] = []
        self.next_offset = 0  # next offset to assign (staged batches included)
        self.hwm = 0  # next offset after the last batch written to the file
        self._pending: list[bytes | bytearray | memoryview] = []
        self._pending_idx: list[int] = []  # index in _pending of each staged batch's first chunk
        self._pending_meta: list[BatchMeta] = []
        self._pending_size = 0
        # Batches written lately that were one bytearray each (MQTT appends), not read past yet:
        # base offset -> (segment, position, the bytes written, next offset), oldest first
        # (`read_fresh`).
        self._fresh: dict[int, tuple[LogSegment, int, bytearray, int]] = {}
        self._fresh_bytes = 0
        self._fresh_ok = not topic.startswith(SYSTEM_TOPIC_PREFIX)  # nothing dispatches those
        self.failed: BaseException | None = None  # a failed fsync poisons the partition
        self.sync_waiters: list[Any] = []  # written, waiting for the next fsync (Store's)
        self.syncing = 0  # fsync rounds in flight (store.commit)
        self.dir_dirty = False  # a new segment file needs its directory entry fsynced
        self.recovery_point = 0
        self.changed = False  # written or rolled since load (close must seal it)
        self.start_floor = 0  # DeleteRecords: no offset below this is readable

    @property
    def name(self) -> str:
        return f"{self.topic}-{self.partition}"

    @property
    def active(self) -> LogSegment:
        return self.segments[-1]

    @property
    def log_start_offset(self) -> int:
        base = self.segments[0].base_offset
        return base if base >= self.start_floor else self.start_floor

    def size_bytes(self) -> int:
        return sum(s.size for s in self.segments)

    def unsynced(self) -> list[LogSegment]:
        """Segments written since their last fsync, oldest first, without looking at the rest.

        They are the end of the list: only the active segment takes writes and segments leave
        from the front. The case to allow for: an empty active segment rolled after a dirty one
        that stayed (`delete_records_below` keeps a segment with an fsync in flight). Looking at
        every segment cost each fsync round 13 us per 1,000 segments
        (docs/performance-history.md)."""
        segs = self.segments
        last = len(segs) - 1
        out: list[LogSegment] = []
        for i in range(last, -1, -1):
            s = segs[i]
            if s.dirty:
                out.append(s)
            elif out or i < last:
                break
        out.reverse()
        return out

    # --- recovery (worker thread, before use) -------------------------------------------------

    def load(self, clean: bool, progress: Callable[[int], None] | None = None) -> int:
        """Open and recover the partition; returns bytes truncated. See the module docstring."""
        self.dir.mkdir(parents=True, exist_ok=True)
        # Pass 1: crash leftovers.
        names = os.listdir(self.dir)
        logs = {n[:-4] for n in names if n.endswith(".log")}
        for n in names:
            stem, _, ext = n.partition(".")
            if n.endswith((".deleted", ".tmp")) or (
                ext in ("index", "timeindex") and stem not in logs
            ):
                log.info("removing leftover %s/%s", self.name, n)
                os.unlink(self.dir / n)
        try:
            rp_text = (self.dir / RECOVERY_POINT_FILE).read_text().strip()
            self.recovery_point = int(rp_text)
        except (FileNotFoundError, ValueError):
            self.recovery_point = 0
        try:
            self.start_floor = int((self.dir / LOG_START_FILE).read_text().strip())
        except (FileNotFoundError, ValueError):
            self.start_floor = 0
        # Pass 2: segments in order.
        for stem in sorted(logs, key=int):
            seg = LogSegment(self.dir, int(stem), self.index_interval)
            seg.open()
            self.segments.append(seg)
        cut = 0
        # Pass 3 + 4.
        nseg = len(self.segments)
        for i, seg in enumerate(self.segments):
            nxt = self.segments[i + 1].base_offset if i + 1 < nseg else None
            if nxt is not None and (clean or nxt <= self.recovery_point):
                seg.next_offset = nxt
                seg.defer_indexes()
                continue
            if clean and nxt is None and seg.load_indexes() and self._tail_ok(seg):
                continue
            res = seg.recover(check_crc=True)
            if progress is not None:
                progress(res.valid_bytes)
            if res.truncated_bytes:
                cut += res.truncated_bytes
                log.warning(
                    "recovery of %s: truncated %d bytes of segment %s at position %d: %s",
                    self.name, res.truncated_bytes, segment_name(seg.base_offset),
                    res.valid_bytes, res.reason,
                )  # fmt: skip
            later = self.segments[i + 1 :]
            if later and (res.truncated_bytes or later[0].base_offset < seg.next_offset):
                for dead in later:
                    cut += dead.size
                    log.warning(
                        "recovery of %s: deleting segment %s (%d bytes) after a cut or overlap",
                        self.name, segment_name(dead.base_offset), dead.size,
                    )  # fmt: skip
                    dead.close()
                    for p in (dead.log_path, dead.index_path, dead.timeindex_path):
                        p.unlink(missing_ok=True)
                del self.segments[i + 1 :]
                break
        # Pass 5: an active segment always exists.
        if not self.segments:
            self._new_segment(max(self.recovery_point if clean else 0, self.start_floor))
        self._bases = [s.base_offset for s in self.segments]
        self.next_offset = self.hwm = self.active.next_offset
        self.recovery_point = min(self.recovery_point, self.hwm)
        # Pass 6: a floor above what recovery kept (its records were cut) is the log end.
        self.start_floor = min(self.start_floor, self.hwm)
        self.changed = self.changed or not clean  # the active segment's indexes need writing
        return cut

    def _tail_ok(self, seg: LogSegment) -> bool:
        """After a clean close: walk headers from the last index entry to the end of the file."""
        start = seg.index.pos[-1] if len(seg.index) else 0
        end = start
        last = None
        for m in seg.batches_from(start):
            end = m.position + m.size
            last = m
            if m.max_timestamp > seg.max_timestamp:
                seg.max_timestamp = m.max_timestamp
        if end != seg.size:
            return False
        seg.next_offset = last.last_offset + 1 if last is not None else seg.base_offset
        return True

    def _new_segment(self, base: int) -> LogSegment:
        seg = LogSegment(self.dir, base, self.index_interval)
        seg.open(create=True)
        if seg.size:  # a leftover file with this name would break offset order
            seg.truncate_to(0)
        self.segments.append(seg)
        self._bases.append(base)
        self.dir_dirty = True
        self.changed = True
        return seg

    # --- append (event loop) ------------------------------------------------------------------

    def stage(self, buf: bytearray, record_count: int, max_timestamp: int) -> int:
        """Assign offsets to a batch (rewriting its base offset) and queue it for this tick's write."""
        base = self.next_offset
        buf[BASE_OFFSET_OFFSET:LENGTH_OFFSET] = base.to_bytes(8, "big", signed=True)
        last = base + record_count - 1
        self.next_offset = last + 1
        size = len(buf)
        self._pending_idx.append(len(self._pending))
        self._pending.append(buf)
        self._pending_meta.append(BatchMeta(self._pending_size, size, base, last, max_timestamp))
        self._pending_size += size
        return base

    def stage_view(
        self, data: bytes, pos: int, size: int, record_count: int, max_timestamp: int
    ) -> int:
        """`stage` without copying immutable producer bytes: writev gets a fresh 8-byte base offset
        and a view of the rest (measured: a 64 KiB batch costs 27 us to copy, 1 us this way)."""
        base = self.next_offset
        last = base + record_count - 1
        self.next_offset = last + 1
        view = memoryview(data)[pos + LENGTH_OFFSET : pos + size]  # all but the base offset
        self._pending_idx.append(len(self._pending))
        self._pending.append(base.to_bytes(8, "big", signed=True))
        self._pending.append(view)
        self._pending_meta.append(BatchMeta(self._pending_size, size, base, last, max_timestamp))
        self._pending_size += size
        return base

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    def write_pending(self, now_ms: int | None = None) -> list[LogSegment]:
        """Write staged batches (one writev per segment); returns segments sealed by a roll.

        On a write error the staged offsets are given back (they were never visible), the file
        is cut back to its last whole batch and the error propagates.
        """
        self.changed = True
        chunks, metas, cidx = self._pending, self._pending_meta, self._pending_idx
        self._pending, self._pending_meta, self._pending_size, self._pending_idx = [], [], 0, []
        cidx.append(len(chunks))
        sealed: list[LogSegment] = []
        seg = self.active
        if now_ms is None:
            now_ms = int(time.time() * 1000)
        start = 0
        try:
            i = 0
            while i < len(metas):
                # Batches [start, i) go to `seg`; roll when the next one would overflow it.
                m = metas[i]
                fill = m.position + m.size - metas[start].position
                over = (
                    seg.size + fill > self.segment_bytes
                    or m.last_offset - seg.base_offset > MAX_REL_OFFSET
                )
                aged = seg.size and now_ms - seg.created_ms >= self.segment_ms
                if (over or aged) and (seg.size or i > start):
                    if i > start:
                        self._write_run(seg, chunks, cidx, metas, start, i)
                        start = i
                    if seg.size:
                        sealed.append(seg)
                        seg = self._new_segment(m.base_offset)
                        continue
                i += 1
            if start < len(metas):
                self._write_run(seg, chunks, cidx, metas, start, len(metas))
        except OSError:
            self.next_offset = self.hwm
            raise
        return sealed

    def _write_run(
        self,
        seg: LogSegment,
        chunks: list[bytes | bytearray | memoryview],
        cidx: list[int],
        metas: list[BatchMeta],
        a: int,
        b: int,
    ) -> None:
        p0 = metas[a].position
        rel = [m._replace(position=m.position - p0) for m in metas[a:b]] if p0 else metas[a:b]
        before = seg.size
        try:
            seg.append(chunks[cidx[a] : cidx[b]], rel)
        except OSError:
            try:
                seg.truncate_to(before)
            except OSError:
                log.exception("%s: cannot cut back a failed write", self.name)
            raise
        if not before:
            seg.created_ms = int(time.time() * 1000)
        self.hwm = seg.next_offset
        if not self._fresh_ok:
            return
        fresh = self._fresh
        for k in range(a, b):
            c = chunks[cidx[k]]
            if cidx[k + 1] - cidx[k] == 1 and type(c) is bytearray:
                m = metas[k]
                old = fresh.pop(m.base_offset, None)  # offsets given back after a failure
                if old is not None:
                    self._fresh_bytes -= len(old[2])
                fresh[m.base_offset] = (seg, before + m.position - p0, c, m.last_offset + 1)
                self._fresh_bytes += len(c)
        while self._fresh_bytes > FRESH_MAX_BYTES:  # nobody read them back (no dispatcher)
            self._fresh_bytes -= len(fresh.pop(next(iter(fresh)))[2])

    # --- read (event loop) --------------------------------------------------------------------

    def read_fresh(self, offset: int) -> bytearray | None:
        """The batch holding `offset` as a recent write wrote it (no pread, no copy), else None.
        For the dispatcher, which reads each batch back right after its write (~3 % of fan-in
        went to that pread), moving forward: batches it has read past are dropped. Only whole
        batches that were one bytearray (MQTT appends), never changed after their write, at
        most FRESH_MAX_BYTES of them; the segment's read hint moves past the batch as `read`
        would move it."""
        fresh = self._fresh
        while fresh:
            base = next(iter(fresh))
            seg, pos, buf, nxt = fresh[base]
            if nxt > offset:
                break
            del fresh[base]
            self._fresh_bytes -= len(buf)
        else:
            return None
        if base > offset or offset < self.log_start_offset:
            return None
        if pos + len(buf) > seg.size:  # cut back since (a failed write)
            return None
        seg.hint = (nxt, pos + len(buf))
        return buf

    def read(self, offset: int, max_bytes: int) -> bytes:
        """Whole batches starting with the one that holds `offset`, up to `max_bytes`.

        At least one whole batch is returned even if larger than `max_bytes` (as Kafka, KIP-74).
        `offset == high_watermark` returns b""; outside [log start, hwm] raises OffsetOutOfRangeError.
        Data comes from one segment per call.
        """
        if offset < self.log_start_offset or offset > self.hwm:
            raise OffsetOutOfRangeError(
                self.topic, self.partition, offset, self.log_start_offset, self.hwm
            )
        i = bisect.bisect_right(self._bases, offset) - 1
        for seg in self.segments[max(i, 0) :]:
            hint = seg.hint
            if hint is not None and hint[0] == offset and hint[1] < seg.size:
                # Sequential reader (dispatcher, tailing fetch): the batch holding `offset`
                # starts where the last read ended, so one pread, no header walk (measured: 2
                # preads + the walk cost ~9 us of a 16 KB read's ~13 us).
                pos = hint[1]
                data = seg.pread(min(seg.size - pos, max(max_bytes, HEADER_SIZE)), pos)
                first = LOG_OVERHEAD + _LENGTH.unpack_from(data, LENGTH_OFFSET)[0]
                if first > len(data):  # KIP-74: at least the whole first batch
                    data = seg.pread(first, pos)
            else:
                pos, meta = seg.find_position(offset)
                if meta is None:
                    continue
                want = max(meta.size, min(max_bytes, seg.size - pos))
                data = seg.pread(want, pos)
            end = last = 0
            for p, size in iter_batches(data):
                last, end = p, p + size
            if end:
                h = HEADER.unpack_from(data, last)
                seg.hint = (h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA] + 1, pos + end)
            return data if end == len(data) else data[:end]
        return b""

    def max_timestamp(self) -> int:
        """The largest record timestamp in the log (-1 when empty): ListOffsets' MAX_TIMESTAMP."""
        return max((s.largest_timestamp() for s in self.segments if s.size), default=-1)

    def offset_for_timestamp(self, ts_ms: int) -> int | None:
        """First offset whose record timestamp ≥ ts_ms, or None if every record is older; never
        below the log start (a DeleteRecords floor may cut a batch in two)."""
        start = self.log_start_offset
        for seg in self.segments:
            if seg.largest_timestamp() < ts_ms:
                continue
            rel = seg.time_index.lookup_before(ts_ms)
            pos = seg.index.lookup(rel)
            for m in seg.batches_from(pos):
                if m.max_timestamp < ts_ms or m.last_offset < start:
                    continue
                batch = seg.pread(m.size, m.position)
                attrs = int.from_bytes(batch[ATTRIBUTES_OFFSET : ATTRIBUTES_OFFSET + 2], "big")
                if attrs & TIMESTAMP_TYPE_MASK:
                    return max(m.base_offset, start)
                for r in iter_records(batch):
                    if r.timestamp >= ts_ms and r.offset >= start:
                        return r.offset
        return None

    # --- retention (event loop decides, Store's worker deletes) --------------------------------

    def expired_segments(
        self, now_ms: int, retention_ms: int, retention_bytes: int
    ) -> list[LogSegment]:
        """Leading segments to delete by time (largest timestamp older than retention) and size.

        The active segment is rolled first when it has expired too, so a quiet topic still ages out.
        Segments with an fsync in flight wait for the next round.
        """
        if self._pending:
            return []
        doomed: list[LogSegment] = []
        total = self.size_bytes()
        for seg in self.segments:
            if seg.sync_pending:
                break
            by_time = (
                retention_ms >= 0 and seg.size and seg.largest_timestamp() < now_ms - retention_ms
            )
            by_size = retention_bytes >= 0 and total - seg.size >= retention_bytes and seg.size
            if not (by_time or by_size):
                break
            if seg is self.active:
                self._new_segment(self.next_offset)
            doomed.append(seg)
            total -= seg.size
        if doomed:
            del self.segments[: len(doomed)]
            del self._bases[: len(doomed)]
        return doomed

    def delete_records_below(self, offset: int) -> list[LogSegment]:
        """DeleteRecords: make `offset` (log start ≤ offset ≤ hwm) the log start; returns the
        leading segments now wholly below it, for the caller to delete after it persisted
        `start_floor` (so a crash between the two keeps the floor). Rolls the active segment when
        the whole log goes, as retention does."""
        if self._pending:
            raise RuntimeError("delete_records_below with staged batches")
        self.start_floor = max(self.start_floor, offset)
        if offset >= self.hwm and self.active.size:
            self._new_segment(self.next_offset)
        doomed: list[LogSegment] = []
        for seg in self.segments[:-1]:
            if seg.next_offset > offset or seg.sync_pending:
                break
            doomed.append(seg)
        if doomed:
            del self.segments[: len(doomed)]
            del self._bases[: len(doomed)]
        return doomed

    # --- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        for seg in self.segments:
            seg.close()
