"""Kafka transactions on the cluster log: which transactional batches were aborted.

The local log keeps a transaction index (store.txn_index); the cluster log learns the same from
the batches it fetches. Fetches are read_committed (isolation_level 1), so the cluster returns
only records below its last stable offset: every transaction there is decided, and its marker
(a control batch, ABORT or COMMIT) is in the log after its records. `ClusterTxns` reads the
markers in every fetched chunk and remembers which offset ranges it has seen; a transactional
batch of producer P at offset B is decided once P's first marker at or after B has been seen
with nothing unseen in between. `KafkaLog.read` hands out only decided batches (it fetches
further, for the marker, when the first one is not), so `is_aborted` always knows.

The Fetch response's aborted_transactions list is not used: Tansu leaves it empty
(docs/deployment.md), the markers say the same on every broker.
"""

from __future__ import annotations

import bisect

from store.record_batch import (
    BH_ATTRIBUTES,
    BH_BASE_OFFSET,
    BH_LAST_OFFSET_DELTA,
    BH_PRODUCER_ID,
    CONTROL_MASK,
    TRANSACTIONAL_MASK,
    BatchWalk,
)
from store.txn_index import ABORT, control_type

MAX_MARKERS = 20_000  # per partition; older ones are forgotten (and their span with them)
MAX_SPANS = 1_000  # disjoint seen ranges per partition (readers of old records add some)


class _Part:
    __slots__ = ("spans", "markers", "count")

    def __init__(self) -> None:
        self.spans: list[list[int]] = []  # disjoint [lo, hi) offset ranges seen, sorted
        self.markers: dict[int, list[tuple[int, bool]]] = {}  # pid -> [(offset, aborted)]
        self.count = 0

    def cover(self, lo: int, hi: int) -> None:
        spans = self.spans
        i = bisect.bisect_left(spans, [lo])
        if i and spans[i - 1][1] >= lo:
            i -= 1
        j = i
        while j < len(spans) and spans[j][0] <= hi:
            lo, hi = min(lo, spans[j][0]), max(hi, spans[j][1])
            j += 1
        spans[i:j] = [[lo, hi]]

    def span_of(self, offset: int) -> list[int] | None:
        i = bisect.bisect_right(self.spans, [offset, 1 << 62]) - 1
        if i >= 0 and self.spans[i][0] <= offset < self.spans[i][1]:
            return self.spans[i]
        return None

    def forget_below(self, offset: int) -> None:
        for pid in list(self.markers):
            ms = [m for m in self.markers[pid] if m[0] >= offset]
            if ms:
                self.markers[pid] = ms
            else:
                del self.markers[pid]
        self.count = sum(len(m) for m in self.markers.values())
        self.spans = [[max(lo, offset), hi] for lo, hi in self.spans if hi > offset]


class ClusterTxns:
    """Markers and seen ranges per partition; `is_aborted` as store.txn_index.TxnIndex has it."""

    def __init__(self) -> None:
        self._parts: dict[tuple[str, int], _Part] = {}
        self._txn: set[tuple[str, int]] = set()  # partitions with transactional batches seen

    def scan(self, tp: tuple[str, int], data: bytes) -> None:
        """A fetched chunk (whole batches): its markers, and the range it covers."""
        lo = hi = -1
        part = self._parts.get(tp)
        for h, pos, size in BatchWalk(data):
            base, last = h[BH_BASE_OFFSET], h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA]
            if lo < 0:
                lo = base
            hi = last + 1
            if h[BH_ATTRIBUTES] & TRANSACTIONAL_MASK:
                self._txn.add(tp)
            if h[BH_ATTRIBUTES] & CONTROL_MASK:
                kind = control_type(data, pos, size)
                if kind is None:
                    continue
                if part is None:
                    part = self._parts[tp] = _Part()
                ms = part.markers.setdefault(h[BH_PRODUCER_ID], [])
                k = bisect.bisect_left(ms, (base, False))
                if k == len(ms) or ms[k][0] != base:
                    ms.insert(k, (base, kind == ABORT))
                    part.count += 1
        if lo < 0 or tp not in self._txn:
            return  # a partition without transactions: nothing to remember
        if part is None:
            part = self._parts[tp] = _Part()
        part.cover(lo, hi)
        if part.count > MAX_MARKERS or len(part.spans) > MAX_SPANS:
            # Forgotten spans heal: an undecided batch is fetched and scanned again.
            newest = sorted(m[0] for ms in part.markers.values() for m in ms) or [hi]
            part.forget_below(max(newest[len(newest) // 2], part.spans[len(part.spans) // 2][0]))

    def decided(self, tp: tuple[str, int], pid: int, offset: int) -> bool | None:
        """Aborted (True), committed (False), or not known yet (None) for the transactional
        batch of `pid` at `offset`: its first marker after it, with no gap seen between."""
        part = self._parts.get(tp)
        if part is None:
            return None
        ms = part.markers.get(pid)
        if not ms:
            return None
        k = bisect.bisect_left(ms, (offset, False))
        if k == len(ms):
            return None
        span = part.span_of(offset)
        if span is None or span[1] <= ms[k][0]:
            return None
        return ms[k][1]

    def is_aborted(self, topic: str, partition: int, pid: int, offset: int) -> bool:
        return self.decided((topic, partition), pid, offset) is True

    def decided_prefix(self, tp: tuple[str, int], data: bytes, offset: int) -> tuple[bytes, int]:
        """The leading batches of `data` (from the one holding `offset`) whose transactions are
        decided, and where to fetch for the first undecided one's marker (-1: all decided)."""
        if tp not in self._txn:
            return data, -1  # no transactions seen here: nothing to decide
        start = -1
        for h, pos, _size in BatchWalk(data, offset):
            if start < 0:
                start = pos
            attrs = h[BH_ATTRIBUTES]
            if (
                attrs & TRANSACTIONAL_MASK
                and not attrs & CONTROL_MASK
                and self.decided(tp, h[BH_PRODUCER_ID], max(h[BH_BASE_OFFSET], offset)) is None
            ):
                part = self._parts.get(tp)
                span = part.span_of(h[BH_BASE_OFFSET]) if part is not None else None
                return data[start:pos], span[1] if span is not None else h[BH_BASE_OFFSET]
        return (data if start <= 0 else data[start:]), -1

    def forget_topic(self, topic: str) -> None:
        for tp in [tp for tp in self._parts if tp[0] == topic]:
            del self._parts[tp]
        self._txn = {tp for tp in self._txn if tp[0] != topic}


__all__ = ["ClusterTxns"]
