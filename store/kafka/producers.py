"""Idempotent-producer state: producer ids, and per (partition, producer) sequence de-duplication.

Mirrors Kafka's `ProducerStateManager`: for each partition and producer id we keep the epoch and the
last five batches (first/last sequence, first/last offset). A batch repeating one of them is a
retry of an appended batch and is answered with the original offset instead of being stored again;
any other batch must continue the sequence (`last_seq + 1`, wrapping at INT32_MAX), or it is
OUT_OF_ORDER_SEQUENCE_NUMBER. A producer we know nothing about may start at any sequence (Kafka
does the same once retention has removed a producer's batches).

Derived data: the truth is the producer fields in the log's batch headers. `producers.json` under
DATA/kafka/ is a snapshot (written tmp + rename) recording, per partition, the offset it covers;
on start the log is replayed from there to the high watermark. Entries at or past the current high
watermark are dropped on load, since a crash may have lost unflushed (hence never acknowledged)
batches that a snapshot already saw — keeping them would turn the producer's retry into a false
duplicate. Producer ids are handed out from blocks whose upper bound is persisted before use, so an
id is never issued twice, even after a crash.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kio.schema.errors import ErrorCode as E

from store.record_batch import BH_BASE_OFFSET, CONTROL_MASK, BatchHeader, BatchWalk

__all__ = ["ProducerStateManager", "last_sequence"]

INT32_MAX = 2**31 - 1
_KEEP_BATCHES = 5
_MAX_PRODUCERS_PER_PARTITION = 50_000
_PID_BLOCK = 1000


def last_sequence(h: BatchHeader) -> int:
    return (h.base_sequence + h.last_offset_delta) % (INT32_MAX + 1)


def _in_sequence(last_seq: int, next_seq: int) -> bool:
    return next_seq == last_seq + 1 or (next_seq == 0 and last_seq == INT32_MAX)


@dataclass(slots=True)
class _Producer:
    epoch: int
    batches: deque[tuple[int, int, int, int]]  # (first seq, last seq, first offset, last offset)


class ProducerStateManager:
    """Event-loop-only. `check` then `record` must run in the same synchronous step as the append."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._path = self.dir / "producers.json"
        self._partitions: dict[tuple[str, int], OrderedDict[int, _Producer]] = {}
        self._covered: dict[tuple[str, int], int] = {}  # next offset the state reflects
        self._next_pid = 0
        self._pid_limit = 0
        self.dirty = False
        self._seq = 0  # export order: an older export never overwrites a newer one
        self._written = -1
        self._write_lock = threading.Lock()
        self._load()

    # --- producer ids -------------------------------------------------------------------

    def new_producer_id(self) -> int:
        if self._next_pid >= self._pid_limit:
            self._pid_limit = self._next_pid + _PID_BLOCK
            self.snapshot()  # persist the block's bound before any id from it is used
        pid = self._next_pid
        self._next_pid += 1
        return pid

    # --- sequence checks ----------------------------------------------------------------

    def check(self, topic: str, partition: int, h: BatchHeader) -> tuple[int, int | None]:
        """Validate an idempotent batch: (error, base offset of the original if a duplicate)."""
        if h.producer_id < 0:
            return E.none, None
        producers = self._partitions.get((topic, partition))
        p = producers.get(h.producer_id) if producers is not None else None
        if p is None:
            return E.none, None
        if h.producer_epoch < p.epoch:
            return E.invalid_producer_epoch, None
        if h.producer_epoch > p.epoch:
            return (E.none if h.base_sequence == 0 else E.out_of_order_sequence_number), None
        last_seq = last_sequence(h)
        for first, last, first_off, _ in p.batches:
            if first == h.base_sequence and last == last_seq:
                return E.none, first_off
        if p.batches and not _in_sequence(p.batches[-1][1], h.base_sequence):
            return E.out_of_order_sequence_number, None
        return E.none, None

    def record(self, topic: str, partition: int, h: BatchHeader, base_offset: int) -> None:
        """Note an appended batch (`base_offset` as assigned by the log)."""
        key = (topic, partition)
        self._covered[key] = base_offset + h.last_offset_delta + 1
        if h.producer_id < 0 or h.attributes & CONTROL_MASK:  # markers carry no sequence
            return
        producers = self._partitions.setdefault(key, OrderedDict())
        p = producers.get(h.producer_id)
        if p is None or h.producer_epoch != p.epoch:
            p = producers[h.producer_id] = _Producer(h.producer_epoch, deque(maxlen=_KEEP_BATCHES))
        producers.move_to_end(h.producer_id)
        p.batches.append(
            (h.base_sequence, last_sequence(h), base_offset, base_offset + h.last_offset_delta)
        )
        if len(producers) > _MAX_PRODUCERS_PER_PARTITION:
            producers.popitem(last=False)  # least recently active
        if h.producer_id >= self._next_pid:  # only after a lost snapshot, or a foreign id
            self._next_pid = h.producer_id + 1
            self._pid_limit = max(self._pid_limit, self._next_pid)
        self.dirty = True

    def advance(self, topic: str, partition: int, hwm: int) -> None:
        """Every append reached the log through `record` or carries no producer id (MQTT), so
        the state covers the log up to `hwm`: a restart need not re-read it."""
        key = (topic, partition)
        if self._covered.get(key, 0) < hwm:
            self._covered[key] = hwm
            self.dirty = True

    def forget_topic(self, topic: str) -> None:
        """A deleted topic: its partitions' producer state goes (a new topic starts clean)."""
        for key in [k for k in self._partitions if k[0] == topic]:
            del self._partitions[key]
        for key in [k for k in self._covered if k[0] == topic]:
            del self._covered[key]
        self.dirty = True

    # --- recovery -----------------------------------------------------------------------

    def recover(
        self,
        partitions: dict[str, int],
        high_watermark: Callable[[str, int], int],
        log_start: Callable[[str, int], int],
        read: Callable[[str, int, int, int], bytes],
        chunk: int = 4 << 20,
    ) -> int:
        """Bring the state up to each partition's high watermark from the log; returns batches read."""
        seen = 0
        for topic, count in partitions.items():
            for partition in range(count):
                key = (topic, partition)
                hwm = high_watermark(topic, partition)
                self._drop_at_or_after(key, hwm)
                offset = max(self._covered.get(key, 0), log_start(topic, partition))
                while offset < hwm:
                    data = read(topic, partition, offset, chunk)
                    walk = BatchWalk(data, offset)
                    for h, _pos, _size in walk:
                        self.record(topic, partition, BatchHeader._make(h), h[BH_BASE_OFFSET])
                        seen += 1
                    if walk.next_offset == offset:
                        break
                    offset = walk.next_offset
                self._covered[key] = max(offset, self._covered.get(key, 0))
        return seen

    def _drop_at_or_after(self, key: tuple[str, int], hwm: int) -> None:
        if self._covered.get(key, 0) <= hwm:
            return
        self._covered[key] = hwm
        producers: OrderedDict[int, _Producer] = self._partitions.get(key, OrderedDict())
        for pid in list(producers):
            p = producers[pid]
            kept = [b for b in p.batches if b[3] < hwm]
            if kept:
                p.batches = deque(kept, maxlen=_KEEP_BATCHES)
            else:
                del producers[pid]

    # --- persistence --------------------------------------------------------------------

    def _load(self) -> None:
        (self.dir / "producers.json.tmp").unlink(missing_ok=True)
        if not self._path.exists():
            return
        doc = json.loads(self._path.read_text())
        self._next_pid = self._pid_limit = doc["pid_limit"]  # ids below may have been issued
        for entry in doc["partitions"]:
            key = (entry["topic"], entry["partition"])
            self._covered[key] = entry["covered"]
            producers: OrderedDict[int, _Producer] = OrderedDict()
            for pid, epoch, batches in entry["producers"]:
                producers[pid] = _Producer(
                    epoch, deque((tuple(b) for b in batches), maxlen=_KEEP_BATCHES)
                )
            self._partitions[key] = producers

    def snapshot(self) -> None:
        """Write the state (tmp + fsync + rename). Blocking; called rarely."""
        self.write_snapshot(self.export())

    def export(self) -> dict:
        """The state as JSON-ready data; cheap enough for the loop, then written off it."""
        self.dirty = False
        self._seq += 1
        keys = set(self._covered) | set(self._partitions)
        doc = {
            "seq": self._seq,
            "pid_limit": self._pid_limit,
            "partitions": [
                {
                    "topic": t,
                    "partition": p,
                    "covered": self._covered.get((t, p), 0),
                    "producers": [
                        [pid, s.epoch, [list(b) for b in s.batches]]
                        for pid, s in self._partitions.get((t, p), {}).items()
                    ],
                }
                for t, p in sorted(keys)
            ],
        }
        return doc

    def write_snapshot(self, doc: dict) -> None:
        """Thread-safe given `doc` from `export()`."""
        with self._write_lock:
            if doc["seq"] <= self._written:
                return
            tmp = self.dir / "producers.json.tmp"
            with tmp.open("w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
            self._written = doc["seq"]
