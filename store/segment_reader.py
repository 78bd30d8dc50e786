"""Lock-free, read-only access to a data dir's segments, for other processes (Spark) and tools.

No Store object, no DATA/LOCK: plain functions over files that the one writer process appends to.
The rule that makes concurrent reading safe (docs/storage.md): a partition's readable data ends at
the first batch whose declared length runs past the end of its file, or whose CRC-32C does not
check. Such a batch is being written (or was torn by a crash the writer will repair on its next
start); we stop there and never skip over it, so offsets are never lost, only seen later.
The writer never rewrites bytes below its high watermark; retention only unlinks whole segments
(a reader holding the file open keeps reading it; one that finds it gone moves to the next).

Everything here is thread-safe and process-safe: it holds no state between calls.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import NamedTuple

import crc32c

from store.log import LOG_START_FILE
from store.record_batch import (
    ATTRIBUTES_OFFSET,
    BH_ATTRIBUTES,
    BH_BASE_OFFSET,
    BH_BATCH_LENGTH,
    BH_CRC,
    BH_FIRST_TIMESTAMP,
    BH_LAST_OFFSET_DELTA,
    BH_MAGIC,
    BH_MAX_TIMESTAMP,
    BH_RECORD_COUNT,
    CONTROL_MASK,
    HEADER,
    HEADER_SIZE,
    LOG_OVERHEAD,
    MAGIC_V2,
    Record,
    iter_records,
)

READ_CHUNK = 8 << 20  # bytes per pread while streaming a segment
_SEGMENT_RE = re.compile(r"^(\d{20})\.log$")
_PARTITION_RE = re.compile(r"^(.+)-(\d+)$")
_INDEX_ENTRY = struct.Struct(">II")


class SegmentFile(NamedTuple):
    base_offset: int
    path: Path
    size: int


class BatchView(NamedTuple):
    """One complete, CRC-checked batch. `data` is a memoryview of the whole batch (header too)."""

    base_offset: int
    last_offset: int
    first_timestamp: int
    max_timestamp: int
    record_count: int
    attributes: int
    data: memoryview

    @property
    def is_control(self) -> bool:
        return bool(self.attributes & CONTROL_MASK)


def list_topics(data_dir: str | os.PathLike[str]) -> dict[str, int]:
    """Topic → partition count, from `log/topics.json` (the directories if it is missing)."""
    log_dir = Path(data_dir) / "log"
    try:
        meta = json.loads((log_dir / "topics.json").read_text())
        return {name: int(e["partitions"]) for name, e in meta.items()}
    except FileNotFoundError:
        out: dict[str, int] = {}
        for topic, p in list_partitions(data_dir):
            out[topic] = max(out.get(topic, 0), p + 1)
        return out


def list_partitions(data_dir: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """(topic, partition) of every partition directory, sorted."""
    log_dir = Path(data_dir) / "log"
    out = []
    try:
        names = os.listdir(log_dir)
    except FileNotFoundError:
        return []
    for name in names:
        m = _PARTITION_RE.match(name)
        if m and (log_dir / name).is_dir():
            out.append((m.group(1), int(m.group(2))))
    return sorted(out)


def partition_dir(data_dir: str | os.PathLike[str], topic: str, partition: int) -> Path:
    return Path(data_dir) / "log" / f"{topic}-{partition}"


def list_segments(
    data_dir: str | os.PathLike[str], topic: str, partition: int
) -> list[SegmentFile]:
    """Segments of a partition in offset order (sizes as of this call)."""
    d = partition_dir(data_dir, topic, partition)
    out = []
    try:
        names = os.listdir(d)
    except FileNotFoundError:
        return []
    for name in names:
        m = _SEGMENT_RE.match(name)
        if m:
            try:
                size = os.stat(d / name).st_size
            except FileNotFoundError:  # deleted by retention meanwhile
                continue
            out.append(SegmentFile(int(m.group(1)), d / name, size))
    out.sort()
    return out


def log_start_offset(data_dir: str | os.PathLike[str], topic: str, partition: int) -> int:
    """First readable offset: the first segment's base, or DeleteRecords' floor above it."""
    segs = list_segments(data_dir, topic, partition)
    base = segs[0].base_offset if segs else 0
    try:
        floor = int((partition_dir(data_dir, topic, partition) / LOG_START_FILE).read_text())
    except (FileNotFoundError, ValueError):
        floor = 0
    return max(base, floor)


def _index_start(seg: SegmentFile, fd: int, offset: int, size: int) -> int:
    """File position to start walking from for `offset`, via the sparse `.index` if it checks out."""
    try:
        raw = seg.path.with_suffix(".index").read_bytes()
    except FileNotFoundError:
        return 0
    n = len(raw) // _INDEX_ENTRY.size
    lo, hi = 0, n - 1
    best = 0
    rel = offset - seg.base_offset
    while lo <= hi:  # last entry with relative offset <= rel
        mid = (lo + hi) // 2
        r, _p = _INDEX_ENTRY.unpack_from(raw, mid * _INDEX_ENTRY.size)
        if r <= rel:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if n == 0:
        return 0
    r, pos = _INDEX_ENTRY.unpack_from(raw, best * _INDEX_ENTRY.size)
    if pos + HEADER_SIZE > size:
        return 0
    head = os.pread(fd, HEADER_SIZE, pos)
    if len(head) < HEADER_SIZE:
        return 0
    h = HEADER.unpack_from(head)
    # Derived data is never trusted: the entry must point at the batch it names.
    return pos if h[BH_BASE_OFFSET] == seg.base_offset + r and h[BH_MAGIC] == MAGIC_V2 else 0


def iter_batches(
    data_dir: str | os.PathLike[str],
    topic: str,
    partition: int,
    start_offset: int = 0,
    end_offset: int | None = None,
    *,
    check_crc: bool = True,
) -> Iterator[BatchView]:
    """Complete batches holding offsets in [start_offset, end_offset), in offset order.

    The first batch may begin before `start_offset` (it holds it); filter records by offset.
    Stops at the first incomplete or CRC-failing batch (being written), or at `end_offset`.
    Each `data` view is valid until the next item is requested only if you do not keep it:
    copy with `bytes(b.data)` to keep a batch beyond the current chunk.
    """
    segments = list_segments(data_dir, topic, partition)
    first = 0
    for i, seg in enumerate(segments):
        if seg.base_offset <= start_offset:
            first = i
    expected = -1  # base offset the next segment must have: offsets are dense across segments
    for seg in segments[first:]:
        if end_offset is not None and seg.base_offset >= end_offset:
            return
        if expected >= 0 and seg.base_offset != expected:
            # A directory listing taken while segments are created can miss one (readdir is not
            # atomic), and retention can delete one under us: stop at the prefix we have.
            return
        try:
            fd = os.open(seg.path, os.O_RDONLY)
        except FileNotFoundError:
            if expected >= 0:
                return
            continue  # removed by retention after the listing: its data is gone anyway
        try:
            size = os.fstat(fd).st_size
            pos = _index_start(seg, fd, start_offset, size) if start_offset > seg.base_offset else 0
            nxt = yield from _walk(fd, pos, size, start_offset, end_offset, check_crc)
        finally:
            os.close(fd)
        if nxt < 0:
            return
        expected = nxt if nxt > 0 else seg.base_offset


def _walk(
    fd: int, pos: int, size: int, start: int, end: int | None, check_crc: bool
) -> Generator[BatchView, None, int]:
    """Yield batches from `pos`. Returns the offset after the last batch if the segment ended
    exactly on a batch boundary (0 if it held none from `pos`), -1 if we had to stop inside it."""
    unpack = HEADER.unpack_from
    nxt = 0
    crc = crc32c.crc32c
    while pos < size:
        chunk = os.pread(fd, min(READ_CHUNK, size - pos), pos)
        view = memoryview(chunk)
        n = len(chunk)
        off = 0
        while n - off >= HEADER_SIZE:
            h = unpack(chunk, off)
            bsize = h[BH_BATCH_LENGTH] + LOG_OVERHEAD
            if h[BH_MAGIC] != MAGIC_V2 or bsize < HEADER_SIZE or pos + off + bsize > size:
                return -1  # being written (or torn): readable data ends here
            if off + bsize > n:
                if off == 0:  # one batch bigger than the chunk
                    chunk = os.pread(fd, bsize, pos)
                    if len(chunk) < bsize:
                        return -1
                    view, n = memoryview(chunk), len(chunk)
                    continue
                break
            batch = view[off : off + bsize]
            if check_crc and crc(batch[ATTRIBUTES_OFFSET:]) != h[BH_CRC]:
                return -1
            last = h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA]
            if end is not None and h[BH_BASE_OFFSET] >= end:
                return -1
            if last >= start:
                yield BatchView(
                    h[BH_BASE_OFFSET],
                    last,
                    h[BH_FIRST_TIMESTAMP],
                    h[BH_MAX_TIMESTAMP],
                    h[BH_RECORD_COUNT],
                    h[BH_ATTRIBUTES],
                    batch,
                )
            nxt = last + 1
            off += bsize
        if off == 0:
            return -1  # a torn header at the end of the file
        pos += off
    return nxt


def decode_records(
    batch: BatchView | bytes | memoryview, skip_control: bool = True
) -> list[Record]:
    """Records of one batch: (offset, timestamp, key, value, headers); decompresses if needed."""
    if isinstance(batch, BatchView):
        if skip_control and batch.is_control:
            return []
        data = batch.data
    else:
        data = memoryview(batch)
        attrs = data[ATTRIBUTES_OFFSET : ATTRIBUTES_OFFSET + 2]
        if skip_control and int.from_bytes(attrs, "big") & CONTROL_MASK:
            return []
    return list(iter_records(data))


def iter_records_from(
    data_dir: str | os.PathLike[str],
    topic: str,
    partition: int,
    start_offset: int = 0,
    end_offset: int | None = None,
) -> Iterator[Record]:
    """Records with start_offset ≤ offset < end_offset (control records skipped), none below the
    log start."""
    start_offset = max(start_offset, log_start_offset(data_dir, topic, partition))
    for b in iter_batches(data_dir, topic, partition, start_offset, end_offset):
        for r in decode_records(b):
            if r.offset >= start_offset and (end_offset is None or r.offset < end_offset):
                yield r


def high_watermark(data_dir: str | os.PathLike[str], topic: str, partition: int) -> int:
    """Next offset after the last complete batch a reader can see now (walks the last segment)."""
    segs = list_segments(data_dir, topic, partition)
    if not segs:
        return 0
    last = segs[-1].base_offset - 1
    for b in iter_batches(data_dir, topic, partition, segs[-1].base_offset):
        last = b.last_offset
    return last + 1
