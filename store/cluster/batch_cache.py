"""BatchCache: record batches fetched from a Kafka cluster, held in memory by log position.

Derived data: everything here is a copy of the cluster's log, dropped oldest-inserted first
once `max_bytes` are held; a read that misses is answered by fetching again. Batches are kept
whole, exactly as the cluster returned them (RecordBatch v2, base offset set by the cluster),
so the dispatcher and the resolver parse them as they parse the local log's segment bytes.

A partition's batches are disjoint offset ranges; `bases[head:]` holds their base offsets,
sorted for bisection. Eviction goes oldest-inserted first, which in a partition read forward is
its lowest base: that one is dropped by moving `head` (a `del bases[0]` moved the whole list, 213
µs per one-record batch in a full 64 MiB cache of ~500k batches), and the dead prefix is cut
once it is half the list. Event-loop-only.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque

from store.record_batch import BH_BASE_OFFSET, BH_LAST_OFFSET_DELTA, HEADER, iter_batches


class _Part:
    __slots__ = ("bases", "batches", "head")

    def __init__(self) -> None:
        self.bases: list[int] = []  # bases[:head] were evicted: not looked at
        self.head = 0
        self.batches: dict[int, tuple[int, bytes]] = {}  # base offset -> (last offset, bytes)


class BatchCache:
    """Whole batches per (topic, partition), bounded by bytes (FIFO by insertion)."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._parts: dict[tuple[str, int], _Part] = {}
        self._fifo: deque[tuple[tuple[str, int], int, int]] = deque()
        self.hits = 0
        self.misses = 0

    def insert(self, topic: str, partition: int, data: bytes) -> int:
        """Add every complete batch of a fetch response's record set; returns the offset after
        the last complete batch (-1 when there was none). A trailing partial batch (the fetch
        size cut it) is ignored, as Kafka consumers do."""
        tp = (topic, partition)
        part = self._parts.get(tp)
        if part is None:
            part = self._parts[tp] = _Part()
        end = -1
        mv = memoryview(data)
        for pos, size in iter_batches(data):
            h = HEADER.unpack_from(data, pos)
            base, last = h[BH_BASE_OFFSET], h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA]
            end = last + 1
            if base in part.batches:
                continue
            part.batches[base] = (last, bytes(mv[pos : pos + size]))
            insort(part.bases, base, part.head)
            self._fifo.append((tp, base, size))
            self.bytes += size
        while self.bytes > self.max_bytes and self._fifo:
            otp, obase, osize = self._fifo.popleft()
            op = self._parts[otp]
            if op.batches.pop(obase, None) is not None:
                _unlist(op, obase)
                self.bytes -= osize
        return end

    def find(self, topic: str, partition: int, offset: int) -> int | None:
        """Base offset of the cached batch holding `offset`, None if not cached."""
        part = self._parts.get((topic, partition))
        if part is None:
            return None
        i = bisect_right(part.bases, offset, part.head) - 1
        if i < part.head:
            return None
        base = part.bases[i]
        if part.batches[base][0] < offset:
            return None
        return base

    def read(self, topic: str, partition: int, offset: int, max_bytes: int) -> bytes | None:
        """The batch holding `offset` and those right after it (contiguous offsets) up to about
        `max_bytes`; None when the batch holding `offset` is not cached."""
        part = self._parts.get((topic, partition))
        base = self.find(topic, partition, offset)
        if part is None or base is None:
            self.misses += 1
            return None
        self.hits += 1
        i = bisect_right(part.bases, base, part.head) - 1
        out: list[bytes] = []
        n = 0
        nxt = base
        bases, batches = part.bases, part.batches
        while i < len(bases) and bases[i] == nxt and (n == 0 or n < max_bytes):
            last, data = batches[bases[i]]
            out.append(data)
            n += len(data)
            nxt = last + 1
            i += 1
        return out[0] if len(out) == 1 else b"".join(out)

    def drop_below(self, topic: str, partition: int, offset: int) -> None:
        """Forget batches wholly below a new log start (retention on the cluster)."""
        part = self._parts.get((topic, partition))
        if part is None:
            return
        bases = part.bases
        while part.head < len(bases) and part.batches[bases[part.head]][0] < offset:
            base = bases[part.head]
            self.bytes -= len(part.batches.pop(base)[1])
            _unlist(part, base)


def _unlist(part: _Part, base: int) -> None:
    """Take the evicted `base` out of `part.bases[head:]`."""
    bases, head = part.bases, part.head
    if bases[head] == base:  # the lowest: the usual case
        head += 1
        if head > 64 and head * 2 > len(bases):
            del bases[:head]
            head = 0
        part.head = head
    else:  # inserted out of offset order (a reader re-fetching an older range)
        del bases[bisect_right(bases, base, head) - 1]
