"""Transaction index: per partition, the open transactions and the aborted ones (Kafka's `.txnindex`).

Kafka transactions leave two things in a partition: the producer's batches, with the
transactional attribute bit, and one control batch per transaction end (a *marker*: a record whose
key is `version int16 | type int16`, type 0 = ABORT, 1 = COMMIT). From them this index keeps:

- `open`: producer id → first offset of its transaction still without a marker;
- `aborted`: (producer id, first offset, marker offset) of every aborted transaction, in marker order.

The *last stable offset* (LSO) of a partition is the first offset of its earliest open transaction,
else its high watermark: below it every record is decided. `read_committed` readers (Kafka Fetch,
the light-queue dispatcher) stop there and drop the records of aborted transactions, which
`aborted_in` lists for a range as Kafka's Fetch response does.

Derived data: the truth is the log. The store calls `observe` for each transactional batch it
stages; the observation is applied when the high watermark passes it (`advance`, an append
listener), so the index describes exactly the bytes readers can see, and a tail lost in a crash
never left a trace here. `txn-index.json` in the log directory is a snapshot of the applied state
with, per partition, the offset it covers; `recover` replays the log from there to the high
watermark (a partition whose snapshot claims more than the recovered log is rescanned from its
start). Every method is event-loop-only, except `recover` (the store's recovery thread, before the
loop uses the index) and `write_snapshot` (any thread, given `export()`'s data).
"""

from __future__ import annotations

import bisect
import json
import os
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store.record_batch import (
    BH_ATTRIBUTES,
    CONTROL_MASK,
    TRANSACTIONAL_MASK,
    BatchWalk,
    iter_records,
    parse_header,
)

__all__ = ["ABORT", "COMMIT", "PartitionTxns", "TxnIndex", "control_type"]

ABORT, COMMIT = 0, 1
SNAPSHOT = "txn-index.json"
_KEY = struct.Struct(">hh")  # control record key: version, type

Key = tuple[str, int]


def control_type(batch: Any, pos: int = 0, size: int | None = None) -> int | None:
    """ABORT / COMMIT of the control batch at `pos` (None: not a marker we know)."""
    end = len(batch) if size is None else pos + size
    for rec in iter_records(memoryview(batch)[pos:end]):
        if rec.key is not None and len(rec.key) >= 4:
            version, kind = _KEY.unpack_from(rec.key)
            if version == 0 and kind in (ABORT, COMMIT):
                return kind
        return None
    return None


class PartitionTxns:
    """One partition's transactions; also kept by readers in other processes (Spark's driver)."""

    __slots__ = ("open", "aborted", "pending", "covered")

    def __init__(self) -> None:
        self.open: dict[int, int] = {}  # producer id -> first offset of its open transaction
        self.aborted: list[tuple[int, int, int]] = []  # (pid, first offset, marker offset)
        self.pending: list[tuple[int, int, int | None]] = []  # staged: (offset, pid, marker)
        self.covered = 0  # next offset the applied state reflects

    def apply(self, offset: int, pid: int, marker: int | None) -> None:
        if marker is None:
            self.open.setdefault(pid, offset)
            return
        first = self.open.pop(pid, None)
        if first is not None and marker == ABORT:
            self.aborted.append((pid, first, offset))

    def feed(self, batch: Any) -> None:
        """Apply one whole batch (any batch: non-transactional ones change nothing)."""
        h = parse_header(batch)
        if not h.attributes & (TRANSACTIONAL_MASK | CONTROL_MASK) or h.producer_id < 0:
            return
        marker = control_type(batch) if h.is_control else None
        if marker is not None or not h.is_control:
            self.apply(h.base_offset, h.producer_id, marker)

    def stable(self, hwm: int) -> int:
        """The last stable offset given the high watermark."""
        return min(hwm, min(self.open.values())) if self.open else hwm

    def aborted_between(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(pid, first offset, marker offset) of the aborted transactions overlapping [start, end)."""
        i = bisect.bisect_left(self.aborted, start, key=lambda a: a[2])  # in marker order
        return [a for a in self.aborted[i:] if a[1] < end]


class TxnIndex:
    def __init__(self, directory: Path) -> None:
        self._path = directory / SNAPSHOT
        self._parts: dict[Key, PartitionTxns] = {}
        self._seq = 0
        self._written = -1
        self._lock = threading.Lock()
        self.dirty = False

    def _part(self, key: Key) -> PartitionTxns:
        p = self._parts.get(key)
        if p is None:
            p = self._parts[key] = PartitionTxns()
        return p

    # --- feeding ----------------------------------------------------------------------------

    def observe(self, topic: str, partition: int, data: Any, pos: int, base_offset: int) -> None:
        """A transactional or control batch at `data[pos:]` was staged at `base_offset`."""
        h = parse_header(data, pos)
        pid = h.producer_id
        if not h.attributes & (TRANSACTIONAL_MASK | CONTROL_MASK) or pid < 0:
            return
        marker = None
        if h.is_control:
            marker = control_type(data, pos, h.size)
            if marker is None:
                return
        self._part((topic, partition)).pending.append((base_offset, pid, marker))

    def advance(self, topic: str, partition: int, hwm: int) -> None:
        """Append listener: bytes below `hwm` are readable; apply what they hold."""
        p = self._parts.get((topic, partition))
        if p is None:
            p = self._parts[(topic, partition)] = PartitionTxns()
        if p.pending:
            n = 0
            for offset, pid, marker in p.pending:
                if offset >= hwm:
                    break
                p.apply(offset, pid, marker)
                n += 1
            del p.pending[:n]
            self.dirty = True
        if hwm > p.covered:
            p.covered = hwm
            self.dirty = True

    def forget_topic(self, topic: str) -> None:
        for key in [k for k in self._parts if k[0] == topic]:
            del self._parts[key]
        self.dirty = True

    # --- queries ----------------------------------------------------------------------------

    def last_stable_offset(self, topic: str, partition: int, hwm: int) -> int:
        p = self._parts.get((topic, partition))
        return hwm if p is None else p.stable(hwm)

    def aborted_in(self, topic: str, partition: int, start: int, end: int) -> list[tuple[int, int]]:
        """(producer id, first offset) of aborted transactions overlapping [start, end)."""
        p = self._parts.get((topic, partition))
        if p is None or not p.aborted:
            return []
        return [(pid, first) for pid, first, _ in p.aborted_between(start, end)]

    def is_aborted(self, topic: str, partition: int, pid: int, offset: int) -> bool:
        """Whether the transactional batch of `pid` at `offset` belongs to an aborted transaction
        (a producer's transactions do not overlap: the first one ending at or after `offset`)."""
        p = self._parts.get((topic, partition))
        if p is None or not p.aborted:
            return False
        aborted = p.aborted
        for i in range(bisect.bisect_left(aborted, offset, key=lambda a: a[2]), len(aborted)):
            a_pid, first, _ = aborted[i]
            if a_pid == pid:
                return first <= offset
        return False

    def open_transactions(self) -> dict[Key, dict[int, int]]:
        """(topic, partition) → {producer id: first offset} of transactions without a marker."""
        return {k: dict(p.open) for k, p in self._parts.items() if p.open}

    # --- recovery and snapshots -------------------------------------------------------------

    def recover(
        self,
        partitions: dict[str, int],
        high_watermark: Callable[[str, int], int],
        log_start: Callable[[str, int], int],
        read: Callable[[str, int, int, int], bytes],
        chunk: int = 4 << 20,
    ) -> int:
        """Load the snapshot and replay each partition's log from it; returns batches replayed."""
        self._load()
        seen = 0
        for key in [k for k in self._parts if partitions.get(k[0], 0) <= k[1]]:
            del self._parts[key]
        for topic, count in partitions.items():
            for partition in range(count):
                hwm, start = high_watermark(topic, partition), log_start(topic, partition)
                p = self._part((topic, partition))
                if p.covered > hwm:  # the log lost a tail the snapshot saw: start over
                    p = self._parts[(topic, partition)] = PartitionTxns()
                offset = max(p.covered, start)
                while offset < hwm:
                    data = read(topic, partition, offset, chunk)
                    walk = BatchWalk(data, offset)
                    for h, pos, size in walk:
                        if h[BH_ATTRIBUTES] & (TRANSACTIONAL_MASK | CONTROL_MASK):
                            p.feed(memoryview(data)[pos : pos + size])
                        seen += 1
                    if walk.next_offset == offset:
                        break
                    offset = walk.next_offset
                p.covered = max(offset, hwm)
                p.aborted = [a for a in p.aborted if a[2] >= start]
        return seen

    def _load(self) -> None:
        (self._path.parent / (SNAPSHOT + ".tmp")).unlink(missing_ok=True)
        try:
            doc = json.loads(self._path.read_text())
        except FileNotFoundError:
            return
        for e in doc["partitions"]:
            p = self._part((e["topic"], e["partition"]))
            p.covered = e["covered"]
            p.open = {int(pid): first for pid, first in e["open"]}
            p.aborted = [tuple(a) for a in e["aborted"]]  # type: ignore[misc]

    def export(self, log_start: Callable[[str, int], int] | None = None) -> dict[str, Any]:
        """The applied state as JSON-ready data (aborted entries below the log start dropped)."""
        self.dirty = False
        self._seq += 1
        parts = []
        for (t, n), p in sorted(self._parts.items()):
            if log_start is not None:
                try:
                    start = log_start(t, n)
                    p.aborted = [a for a in p.aborted if a[2] >= start]
                except Exception:  # noqa: S110 - a partition deleted meanwhile: keep as is
                    pass
            parts.append({"topic": t, "partition": n, "covered": p.covered,
                          "open": sorted(p.open.items()), "aborted": p.aborted})  # fmt: skip
        return {"seq": self._seq, "partitions": parts}

    def write_snapshot(self, doc: dict[str, Any]) -> None:
        """tmp + fsync + rename; an older export never replaces a newer one. Thread-safe."""
        with self._lock:
            if doc["seq"] <= self._written:
                return
            tmp = self._path.parent / (SNAPSHOT + ".tmp")
            with tmp.open("w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
            self._written = doc["seq"]
