"""Read-only, lock-free view of a Lightgate data dir: topics, partitions, segments, complete batches.

Spark executors run in other processes than the gateway and never take `DATA/LOCK`; they open
`.log` files read-only while the gateway appends (docs/architecture.md, "Data directory layout").
The one rule that makes this safe: a partition's readable data ends at the first batch whose declared
length runs past the end of the file or whose CRC-32C does not check -- such a batch is being written.
We never skip over it, so offsets are never lost, only seen later.

Batch header: Kafka RecordBatch v2, 61 bytes, big-endian; the struct and the field offsets are
`store.record_batch`'s (its docstring has the spec), so this reader cannot drift from the writer.
Headers unpack to plain tuples in that field order, indexed with `store.record_batch`'s `BH_*`
positions (a named BatchHeader would copy each one). The CRC covers attributes..end.

Listing and plain reads go through `store.segment_reader` (the store's own lock-free reader, which
also seeks sealed segments with their `.index`). What this module adds is resuming *at a file
position*: the active segment's index lives only in the writer's memory, so without a position a
reader re-walks the whole active segment to find an offset. `PartitionTail` remembers where each
high watermark sits, so a streaming trigger costs O(new data): measured 0.26 ms vs 42 ms for
`segment_reader.high_watermark` on a 1M-record (107 MB) active segment (bench/RESULTS.md).
"""

from __future__ import annotations

import bisect
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import crc32c

from store import segment_reader
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
    COMPRESSION_MASK,
    CONTROL_MASK,
    HEADER,
    HEADER_SIZE,
    LENGTH_OFFSET,
    LOG_OVERHEAD,
    MAGIC_V2,
    TIMESTAMP_TYPE_MASK,
    TRANSACTIONAL_MASK,
)
from store.record_batch import PRODUCER_ID_OFFSET as PRODUCER_ID_OFFSET  # for arrow_decode
from store.txn_index import PartitionTxns

CRC_START = ATTRIBUTES_OFFSET  # the CRC covers attributes .. end of batch
# The names arrow_decode reads the attributes with, bound to the writer's masks.
ATTR_COMPRESSION = COMPRESSION_MASK
ATTR_LOG_APPEND_TIME = TIMESTAMP_TYPE_MASK
ATTR_TRANSACTIONAL = TRANSACTIONAL_MASK
ATTR_CONTROL = CONTROL_MASK
READ_CHUNK = 8 << 20  # bytes per pread while streaming through a segment
HINT_EVERY = 1 << 20  # PartitionTail keeps one read hint per this many bytes of log


class LogDirError(Exception):
    """The data dir is missing, empty or not a Lightgate data dir."""


class CorruptBatchError(Exception):
    """A complete batch (length within file, CRC ok) that does not decode: never a race."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One complete batch: header fields plus its bytes (a memoryview into a read chunk)."""

    base_offset: int
    last_offset: int
    attributes: int
    first_timestamp: int
    max_timestamp: int
    record_count: int
    position: int  # file position of the batch in its segment
    data: memoryview  # the whole batch, header included


def log_dir(data_dir: str | os.PathLike[str]) -> Path:
    """`DATA/log`, with errors that say what is wrong (these reach notebook users verbatim)."""
    root = Path(data_dir)
    if not root.exists():
        raise LogDirError(f"data dir {root} does not exist")
    if not root.is_dir():
        raise LogDirError(f"data dir {root} is not a directory")
    log = root / "log"
    if not log.is_dir():
        raise LogDirError(f"{root} is not a Lightgate data dir (no log/ inside); is it empty?")
    return log


def list_topics(log: Path) -> dict[str, int]:
    """Topic name -> partition count, from topics.json and the partition directories.

    topics.json is replaced atomically by the gateway, so a plain read sees the old or the new
    version. Directories cover a topic created after we read the file.
    """
    try:
        topics = dict(segment_reader.list_topics(log.parent))
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise LogDirError(f"cannot read {log / 'topics.json'}: {exc}") from exc
    for name, part in segment_reader.list_partitions(log.parent):
        topics[name] = max(topics.get(name, 0), part + 1)
    return topics


def list_segments(log: Path, topic: str, partition: int) -> list[tuple[int, Path]]:
    """(base offset, path) of every `.log` segment, oldest first; temp suffixes are ignored."""
    return [
        (s.base_offset, s.path) for s in segment_reader.list_segments(log.parent, topic, partition)
    ]


def _pread(path: Path, pos: int, size: int) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:  # deleted by retention between listing and reading
        return b""
    try:
        return os.pread(fd, size, pos)
    finally:
        os.close(fd)


def _check_header(buf: bytes | memoryview, pos: int, avail: int | None = None) -> tuple | None:
    """Unpacked header if the batch at `buf[pos:]` is complete within `avail` bytes (default: the
    rest of `buf`), else None (torn or foreign)."""
    if len(buf) - pos < HEADER_SIZE:
        return None
    h = HEADER.unpack_from(buf, pos)
    length = h[BH_BATCH_LENGTH]
    if h[BH_MAGIC] != MAGIC_V2 or length < HEADER_SIZE - LOG_OVERHEAD:
        return None
    if LOG_OVERHEAD + length > (len(buf) - pos if avail is None else avail):
        return None
    return h


def iter_batches(
    log: Path,
    topic: str,
    partition: int,
    start: int = 0,
    end: int | None = None,
    hint: tuple[int, int] | None = None,
) -> Iterator[Batch]:
    """Complete batches holding offsets in [start, end), in offset order, CRC checked.

    `hint` = (segment base, file position) of a batch boundary at or before `start`, as handed
    out by `PartitionTail.hint_for`; without one, `store.segment_reader` finds the position.
    Stops at the first incomplete batch: the gateway is writing it.
    """
    if hint is None:
        for b in segment_reader.iter_batches(log.parent, topic, partition, start, end):
            yield Batch(
                b.base_offset, b.last_offset, b.attributes, b.first_timestamp, b.max_timestamp,
                b.record_count, -1, b.data,
            )  # fmt: skip
        return
    segs = [s for s in list_segments(log, topic, partition) if s[0] >= hint[0]]
    for base, path in segs:
        if end is not None and base >= end:
            return
        pos = hint[1] if base == hint[0] else 0
        stop = pos
        for batch in _scan_segment(path, pos):
            stop = batch.position + len(batch.data)
            if batch.last_offset < start:
                continue
            if end is not None and batch.base_offset >= end:
                return
            yield batch
        if base == segs[-1][0] or stop < _size(path):
            return  # the tail, or an incomplete batch: never skip offsets


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _scan_segment(path: Path, pos: int) -> Iterator[Batch]:
    """Batches from `pos` to the first incomplete one, reading in large chunks."""
    while True:
        chunk = _pread(path, pos, READ_CHUNK)
        if not chunk:
            return
        mv = memoryview(chunk)
        at = 0
        while True:
            h = _check_header(chunk, at)
            if h is None:
                break
            stop = at + LOG_OVERHEAD + h[BH_BATCH_LENGTH]
            if crc32c.crc32c(mv[at + CRC_START : stop]) != h[BH_CRC]:
                return  # being written (or torn by a crash the gateway will truncate)
            yield Batch(
                h[BH_BASE_OFFSET],
                h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA],
                h[BH_ATTRIBUTES],
                h[BH_FIRST_TIMESTAMP],
                h[BH_MAX_TIMESTAMP],
                h[BH_RECORD_COUNT],
                pos + at,
                mv[at:stop],
            )
            at = stop
        if at == 0:
            # One batch larger than the chunk: read exactly it (if it is all there).
            if len(chunk) < LOG_OVERHEAD:
                return
            need = LOG_OVERHEAD + struct.unpack_from(">i", chunk, LENGTH_OFFSET)[0]
            if need <= len(chunk) or need < HEADER_SIZE:
                return
            big = _pread(path, pos, need)
            h = _check_header(big, 0)
            if h is None or crc32c.crc32c(memoryview(big)[CRC_START:]) != h[BH_CRC]:
                return
            yield Batch(
                h[BH_BASE_OFFSET],
                h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA],
                h[BH_ATTRIBUTES],
                h[BH_FIRST_TIMESTAMP],
                h[BH_MAX_TIMESTAMP],
                h[BH_RECORD_COUNT],
                pos,
                memoryview(big),
            )
            at = need
        pos += at


@dataclass(slots=True)
class PartitionTail:
    """Incremental scan of a partition's tail: the high watermark without re-reading the log.

    Kept by the driver between micro-batches; `advance()` CRC-checks only batches it has not
    seen, and keeps a sparse in-memory index (one entry per ~1 MiB of log, plus every high
    watermark) of where batches start, so a micro-batch starting at any offset -- including one
    cut by `maxRecordsPerTrigger` -- reads at most ~1 MiB before its first record.
    """

    log: Path
    topic: str
    partition: int
    segment: int = -1
    position: int = 0
    next_offset: int = 0  # the high watermark: one past the last complete batch
    start_offset: int = 0
    hints: list[tuple[int, int, int]] = field(default_factory=list)  # (base offset, seg, pos)
    # Kafka transactions seen so far: the last stable offset and the aborted ones
    txns: PartitionTxns = field(default_factory=PartitionTxns)
    fed: int = 0  # next offset `txns` has seen (a rescan after retention must not re-feed)

    def advance(self) -> int:
        segs = list_segments(self.log, self.topic, self.partition)
        if not segs:
            return self.next_offset
        self.start_offset = segment_reader.log_start_offset(
            self.log.parent, self.topic, self.partition
        )
        if self.segment not in {b for b, _ in segs}:
            self.segment, self.position = segs[0][0], 0
            self.next_offset = max(self.next_offset, segs[0][0])
            self.hints = [h for h in self.hints if h[1] >= self.segment]
        for base, path in segs:
            if base < self.segment:
                continue
            if base > self.segment:
                self.segment, self.position = base, 0
                self.next_offset = max(self.next_offset, base)
            for batch in _scan_segment(path, self.position):
                if batch.attributes & (ATTR_TRANSACTIONAL | ATTR_CONTROL) and (
                    batch.base_offset >= self.fed
                ):
                    self.txns.feed(batch.data)
                self.fed = max(self.fed, batch.last_offset + 1)
                self._note(batch.base_offset, batch.position)
                self.position += len(batch.data)
                self.next_offset = batch.last_offset + 1
            if base != segs[-1][0] and self.position < _size(path):
                break  # incomplete batch in a rolled segment: wait, never skip offsets
        self._note(self.next_offset, self.position, force=True)
        return self.next_offset

    def stable(self) -> int:
        """The last stable offset (after `advance`): readers stop here, as Kafka's
        read_committed consumers, so a transaction's records are read once it has ended."""
        return self.txns.stable(self.next_offset)

    def aborted(self, start: int, end: int) -> tuple[tuple[int, int, int], ...]:
        """Aborted transactions overlapping [start, end): their records are skipped."""
        return tuple(self.txns.aborted_between(start, end))

    def _note(self, base_offset: int, position: int, force: bool = False) -> None:
        last = self.hints[-1] if self.hints else None
        if last is not None and last[0] == base_offset:
            return
        if force or last is None or last[1] != self.segment or position - last[2] >= HINT_EVERY:
            self.hints.append((base_offset, self.segment, position))

    def hint_for(self, offset: int) -> tuple[int, int] | None:
        """(segment, position) of a batch boundary at or before `offset`, None if unknown."""
        i = bisect.bisect_right(self.hints, (offset, 1 << 62, 1 << 62)) - 1
        if i < 0 or self.hints[i][1] < self.start_offset:
            return None
        return self.hints[i][1], self.hints[i][2]


def walk_headers(path: Path, pos: int = 0) -> Iterator[tuple[int, tuple]]:
    """(position, header) of each batch whose length fits in the file, reading headers only.

    One 61-byte pread per batch and no CRC: for planning (finding a time, counting records), not
    for reading data -- whoever reads the batch checks its CRC.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        while pos + HEADER_SIZE <= size:
            h = _check_header(os.pread(fd, HEADER_SIZE, pos), 0, size - pos)
            if h is None:
                return
            yield pos, h
            pos += LOG_OVERHEAD + h[BH_BATCH_LENGTH]
    finally:
        os.close(fd)


def offset_for_timestamp(log: Path, topic: str, partition: int, ts_ms: int) -> int | None:
    """First offset whose record timestamp >= ts_ms (Kafka's offsetsForTimes), None if none.

    Headers are walked (maxTimestamp) so that only the first candidate batch is read and decoded.
    """
    from spark_analytics.arrow_decode import record_timestamps

    for base, path in list_segments(log, topic, partition):
        for pos, h in walk_headers(path):
            if h[BH_MAX_TIMESTAMP] < ts_ms or h[BH_ATTRIBUTES] & ATTR_CONTROL:
                continue
            for batch in iter_batches(log, topic, partition, h[BH_BASE_OFFSET], None, (base, pos)):
                for off, ts in record_timestamps(batch):
                    if ts >= ts_ms:
                        return off
                if batch.max_timestamp >= ts_ms:
                    break  # max timestamp not matched by a record: keep walking headers
            else:
                return None  # the candidate is not complete yet (being written)
    return None


def approx_records(log: Path, topic: str, partition: int) -> int:
    """Records in a partition from batch headers (no CRC): for progress messages and checks."""
    segs = list_segments(log, topic, partition)
    if not segs:
        return 0
    last = segs[-1][0] - 1
    for _, h in walk_headers(segs[-1][1]):
        last = h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA]
    return max(0, last + 1 - segs[0][0])
