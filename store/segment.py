"""LogSegment, OffsetIndex, TimeIndex: one `.log` file of RecordBatch v2 bytes and its indexes.

The `.log` file is the truth. `.index` and `.timeindex` are derived data: kept in memory while the
segment is active, written when it is sealed (roll, clean close), checked when loaded and rebuilt
from the `.log` whenever missing, short, or inconsistent. Nothing trusts them blindly.

File formats (big-endian, as Kafka's):
- `.index`: entries of (relative offset u32, file position u32), one per `index_interval_bytes`
  of log, keyed by the *base* offset of the batch starting at that position.
- `.timeindex`: entries of (timestamp i64, relative offset u32): the largest timestamp seen so far
  and the base offset of the batch where it was reached; strictly increasing timestamps.

Not thread-safe: a segment belongs to its `Log`, used from the event loop. The only call made from
a worker thread is `os.fsync` on `fd`, which the Log never closes while a sync is pending.
"""

from __future__ import annotations

import bisect
import os
import struct
import sys
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import crc32c

from store.record_batch import (
    ATTRIBUTES_OFFSET,
    BH_BASE_OFFSET,
    BH_BATCH_LENGTH,
    BH_CRC,
    BH_LAST_OFFSET_DELTA,
    BH_MAGIC,
    BH_MAX_TIMESTAMP,
    BH_RECORD_COUNT,
    HEADER,
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC_V2,
)

_OFF_ENTRY = struct.Struct(">II")
_TIME_ENTRY = struct.Struct(">qI")
SCAN_CHUNK = 1 << 16  # header walks read this much at a time (one pread covers many small batches)
RECOVER_CHUNK = 8 << 20
MAX_U32 = (1 << 32) - 1


def segment_name(base_offset: int) -> str:
    return f"{base_offset:020d}"


class BatchMeta(NamedTuple):
    """What the log needs to know about one batch without decoding its records."""

    position: int
    size: int
    base_offset: int
    last_offset: int
    max_timestamp: int


class OffsetIndex:
    """Sparse map relative offset → file position (floor lookups). Derived data."""

    __slots__ = ("rel", "pos")

    def __init__(self) -> None:
        self.rel = array("I")
        self.pos = array("I")

    def __len__(self) -> int:
        return len(self.rel)

    def append(self, rel_offset: int, position: int) -> None:
        self.rel.append(rel_offset)
        self.pos.append(position)

    def lookup(self, rel_offset: int) -> int:
        """Position of the last indexed batch whose base offset ≤ rel_offset (0 if none)."""
        i = bisect.bisect_right(self.rel, rel_offset) - 1
        return self.pos[i] if i >= 0 else 0

    def truncate_to_position(self, position: int) -> None:
        i = bisect.bisect_left(self.pos, position)
        del self.rel[i:], self.pos[i:]

    def to_bytes(self) -> bytes:
        out = array("I", bytes(8 * len(self.rel)))
        out[0::2] = self.rel
        out[1::2] = self.pos
        if sys.byteorder == "little":
            out.byteswap()
        return out.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, log_size: int) -> OffsetIndex | None:
        """Parse and sanity-check; None when the file cannot be trusted (then we rebuild)."""
        if len(data) % _OFF_ENTRY.size:
            return None
        idx = cls()
        last_r = last_p = -1
        for r, p in _OFF_ENTRY.iter_unpack(data):
            if r <= last_r or p <= last_p or p >= log_size:
                return None
            idx.rel.append(r)
            idx.pos.append(p)
            last_r, last_p = r, p
        if idx.pos and idx.pos[0] != 0:
            return None
        return idx


class TimeIndex:
    """Sparse map max-timestamp-so-far → relative base offset. Derived data."""

    __slots__ = ("ts", "rel")

    def __init__(self) -> None:
        self.ts: list[int] = []
        self.rel = array("I")

    def __len__(self) -> int:
        return len(self.ts)

    def maybe_append(self, ts: int, rel_offset: int) -> None:
        if not self.ts or ts > self.ts[-1]:
            self.ts.append(ts)
            self.rel.append(rel_offset)

    def lookup_before(self, ts: int) -> int:
        """Relative offset of the last entry with timestamp < ts (0 if none): start scanning there."""
        i = bisect.bisect_left(self.ts, ts) - 1
        return self.rel[i] if i >= 0 else 0

    def to_bytes(self) -> bytes:
        flat = [v for pair in zip(self.ts, self.rel, strict=True) for v in pair]
        return struct.pack(">" + "qI" * len(self.ts), *flat)

    @classmethod
    def from_bytes(cls, data: bytes, max_rel: int) -> TimeIndex | None:
        if len(data) % _TIME_ENTRY.size:
            return None
        idx = cls()
        last_t, last_r = -(1 << 63), -1
        for t, r in _TIME_ENTRY.iter_unpack(data):
            if t <= last_t or r < last_r or r > max_rel:
                return None
            idx.ts.append(t)
            idx.rel.append(r)
            last_t, last_r = t, r
        return idx


class RecoveryResult(NamedTuple):
    valid_bytes: int
    truncated_bytes: int
    reason: str  # why the tail was cut ("" when nothing was)
    batches: int


class LogSegment:
    """One segment: `<base>.log` plus its indexes. Positions are byte offsets in the `.log` file."""

    __slots__ = (
        "dir", "base_offset", "fd", "size", "index", "time_index", "next_offset",
        "max_timestamp", "_bytes_since_index", "index_interval", "created_ms", "dirty",
        "sync_pending", "_indexes_loaded", "hint",
    )  # fmt: skip

    def __init__(self, directory: Path, base_offset: int, index_interval: int = 4096) -> None:
        self.dir = directory
        self.base_offset = base_offset
        self.fd = -1
        self.size = 0
        self.index = OffsetIndex()
        self.time_index = TimeIndex()
        self.next_offset = base_offset  # one past the last offset written here
        self.max_timestamp = -1
        self._bytes_since_index = 0
        self.index_interval = index_interval
        self.created_ms = int(time.time() * 1000)
        self.dirty = False  # written since the last fsync
        self.sync_pending = 0  # fsyncs in flight on fd: never close it meanwhile
        self._indexes_loaded = True
        # (first offset, position) of a batch boundary a read just reached: tail readers (the
        # dispatcher, live delivery) start their header walk there instead of at the sparse
        # index entry, which with per-tick batches of ~150 bytes meant ~12 headers per read.
        self.hint: tuple[int, int] | None = None

    # --- paths and files ---
    @property
    def log_path(self) -> Path:
        return self.dir / (segment_name(self.base_offset) + ".log")

    @property
    def index_path(self) -> Path:
        return self.dir / (segment_name(self.base_offset) + ".index")

    @property
    def timeindex_path(self) -> Path:
        return self.dir / (segment_name(self.base_offset) + ".timeindex")

    def open(self, create: bool = False) -> None:
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        self.fd = os.open(self.log_path, flags, 0o644)
        self.size = os.fstat(self.fd).st_size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # --- writing (event loop) ---
    def append(self, chunks: list[bytes | bytearray | memoryview], metas: list[BatchMeta]) -> None:
        """Write whole batches at the end with one writev; positions in `metas` are relative."""
        total = sum(m.size for m in metas)
        _write_all(self.fd, chunks, total)
        start = self.size
        rel_base = self.base_offset
        for m in metas:
            if self._bytes_since_index >= self.index_interval or not self.index.rel:
                self.index.append(m.base_offset - rel_base, start + m.position)
                self._bytes_since_index = 0
            self._bytes_since_index += m.size
            if m.max_timestamp > self.max_timestamp:
                self.max_timestamp = m.max_timestamp
                self.time_index.maybe_append(m.max_timestamp, m.base_offset - rel_base)
        self.size = start + total
        self.next_offset = metas[-1].last_offset + 1
        self.dirty = True

    def truncate_to(self, position: int) -> None:
        """Cut the file at `position` (a batch boundary) and drop index entries past it."""
        os.ftruncate(self.fd, position)
        self.size = position
        self.hint = None
        self.index.truncate_to_position(position)
        self._rebuild_from_scan(check_crc=False)

    def write_indexes(self) -> None:
        for path, data in ((self.index_path, self.index.to_bytes()),
                           (self.timeindex_path, self.time_index.to_bytes())):  # fmt: skip
            try:
                path.write_bytes(data)
            except OSError:
                pass  # rebuilt again on the next load

    def index_bytes(self) -> tuple[bytes, bytes]:
        self.ensure_indexes()
        return self.index.to_bytes(), self.time_index.to_bytes()

    # --- reading ---
    def pread(self, n: int, position: int) -> bytes:
        return os.pread(self.fd, n, position)

    def batches_from(self, position: int, end: int | None = None) -> Iterator[BatchMeta]:
        """Header walk from a batch boundary to `end` (default: written size); stops at a partial."""
        end = self.size if end is None else end
        fd = self.fd
        buf, buf_pos = b"", position
        pos = position
        while end - pos >= HEADER_SIZE:
            off = pos - buf_pos
            if off < 0 or off + HEADER_SIZE > len(buf):
                buf = os.pread(fd, min(SCAN_CHUNK, end - pos), pos)
                buf_pos, off = pos, 0
                if len(buf) < HEADER_SIZE:
                    return
            h = HEADER.unpack_from(buf, off)
            size = h[BH_BATCH_LENGTH] + LOG_OVERHEAD
            if size < HEADER_SIZE or pos + size > end:
                return
            yield BatchMeta(
                pos,
                size,
                h[BH_BASE_OFFSET],
                h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA],
                h[BH_MAX_TIMESTAMP],
            )
            pos += size

    def find_position(self, offset: int) -> tuple[int, BatchMeta | None]:
        """First batch whose last offset ≥ `offset` (the one holding it, if any)."""
        self.ensure_indexes()
        start = self.index.lookup(offset - self.base_offset) if offset > self.base_offset else 0
        h = self.hint
        if h is not None and h[0] <= offset and start < h[1] <= self.size:
            start = h[1]
        for m in self.batches_from(start):
            if m.last_offset >= offset:
                return m.position, m
        return self.size, None

    # --- recovery and index loading ---
    def recover(self, check_crc: bool = True) -> RecoveryResult:
        """Scan every batch; truncate at the first torn, CRC-broken or out-of-order one.

        Rebuilds both indexes from what survives. Returns what was cut and why.
        """
        valid, reason, batches = self._rebuild_from_scan(check_crc)
        cut = self.size - valid
        self.hint = None
        if cut:
            os.ftruncate(self.fd, valid)
            self.size = valid
        return RecoveryResult(valid, cut, reason, batches)

    def _rebuild_from_scan(self, check_crc: bool) -> tuple[int, str, int]:
        """Walk batches from position 0, rebuilding indexes; (valid bytes, why it stopped, count)."""
        self.index = OffsetIndex()
        self.time_index = TimeIndex()
        self.max_timestamp = -1
        self._bytes_since_index = 0
        self._indexes_loaded = True
        fd, size = self.fd, self.size
        pos = cpos = 0
        chunk = b""
        view = memoryview(chunk)
        expect = rel_base = self.base_offset
        reason = ""
        batches = 0
        while pos < size:
            if size - pos < HEADER_SIZE:
                reason = f"torn batch header at position {pos} ({size - pos} bytes)"
                break
            off = pos - cpos
            if off + HEADER_SIZE > len(chunk):
                chunk = os.pread(fd, min(RECOVER_CHUNK, size - pos), pos)
                view, cpos, off = memoryview(chunk), pos, 0
            h = HEADER.unpack_from(chunk, off)
            bsize = h[BH_BATCH_LENGTH] + LOG_OVERHEAD
            if h[BH_MAGIC] != MAGIC_V2:
                reason = f"bad magic {h[BH_MAGIC]} at position {pos}"
                break
            if bsize < HEADER_SIZE:
                reason = f"bad batch length {h[BH_BATCH_LENGTH]} at position {pos}"
                break
            if pos + bsize > size:
                reason = f"torn batch at position {pos} ({size - pos} of {bsize} bytes present)"
                break
            if off + bsize > len(chunk):
                chunk = os.pread(fd, min(max(RECOVER_CHUNK, bsize), size - pos), pos)
                view, cpos, off = memoryview(chunk), pos, 0
            if (
                h[BH_BASE_OFFSET] != expect
                or h[BH_LAST_OFFSET_DELTA] < 0
                or h[BH_RECORD_COUNT] != h[BH_LAST_OFFSET_DELTA] + 1
            ):
                reason = (
                    f"batch at position {pos} has offset {h[BH_BASE_OFFSET]}, expected {expect}"
                )
                break
            if (
                check_crc
                and crc32c.crc32c(view[off + ATTRIBUTES_OFFSET : off + bsize]) != h[BH_CRC]
            ):
                reason = f"CRC mismatch in batch at position {pos} (offset {h[BH_BASE_OFFSET]})"
                break
            if self._bytes_since_index >= self.index_interval or not self.index.rel:
                self.index.append(h[BH_BASE_OFFSET] - rel_base, pos)
                self._bytes_since_index = 0
            self._bytes_since_index += bsize
            if h[BH_MAX_TIMESTAMP] > self.max_timestamp:
                self.max_timestamp = h[BH_MAX_TIMESTAMP]
                self.time_index.maybe_append(h[BH_MAX_TIMESTAMP], h[BH_BASE_OFFSET] - rel_base)
            expect = h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA] + 1
            pos += bsize
            batches += 1
        view.release()
        self.next_offset = expect
        return pos, reason, batches

    def load_indexes(self) -> bool:
        """Load `.index`/`.timeindex` of a sealed segment; False (and rebuild) if untrustworthy."""
        raw_idx: bytes | None
        raw_time: bytes | None
        try:
            raw_idx = self.index_path.read_bytes()
            raw_time = self.timeindex_path.read_bytes()
        except FileNotFoundError:
            raw_idx = raw_time = None
        idx = OffsetIndex.from_bytes(raw_idx, self.size) if raw_idx is not None else None
        tix = None
        if idx is not None and raw_time is not None:
            known = self.next_offset > self.base_offset
            tix = TimeIndex.from_bytes(
                raw_time, self.next_offset - 1 - self.base_offset if known else MAX_U32
            )
        if idx is None or tix is None or (self.size and not len(idx)):
            self._rebuild_from_scan(check_crc=False)
            if self.next_offset > self.base_offset or not self.size:
                self.write_indexes()  # derived data: a torn write is caught and redone next time
            return False
        self.index, self.time_index = idx, tix
        self.max_timestamp = tix.ts[-1] if tix.ts else -1
        self._indexes_loaded = True
        return True

    def defer_indexes(self) -> None:
        """Sealed segment opened without reading its indexes yet (loaded on first use)."""
        self._indexes_loaded = False

    def ensure_indexes(self) -> None:
        if not self._indexes_loaded:
            self.load_indexes()

    def largest_timestamp(self) -> int:
        self.ensure_indexes()
        return self.max_timestamp


def _write_all(fd: int, chunks: list[bytes | bytearray | memoryview], total: int) -> None:
    """writev all chunks (IOV_MAX aware), retrying short writes; raises OSError on failure."""
    if len(chunks) == 1:
        data: memoryview | None = memoryview(chunks[0])
        while data:
            n = os.write(fd, data)
            data = data[n:]
        return
    i = 0
    iov_max = 1024
    while i < len(chunks):
        group = chunks[i : i + iov_max]
        want = sum(len(c) for c in group)
        n = os.writev(fd, group)
        if n < want:  # short write: finish this group with plain writes
            rest = memoryview(b"".join(group))[n:]
            while rest:
                rest = rest[os.write(fd, rest) :]
        i += iov_max
