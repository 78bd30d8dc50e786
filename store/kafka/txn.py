"""Transaction coordinator: transactional ids, epochs, commit/abort markers, transactional offsets.

Theory of operation
-------------------
Each transactional id maps to a producer id and an epoch. InitProducerId bumps the epoch (after
aborting a transaction left open), so a zombie still using the old epoch is fenced: every
transactional request (AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn, Produce)
names its producer id and epoch and is refused unless both are current. States, as Kafka's
`TransactionState`::

    EMPTY / COMPLETE_* --AddPartitions/AddOffsets--> ONGOING
    ONGOING --EndTxn(commit)--> PREPARE_COMMIT --markers durable--> COMPLETE_COMMIT
    ONGOING --EndTxn(abort) / timeout / re-init--> PREPARE_ABORT --markers durable--> COMPLETE_ABORT

Ending a transaction writes one control batch (key `0 | type`, value `0 | coordinator epoch 0`)
into every partition the transaction added, waits until they are durable under the topic's fsync
policy, and only then, for a commit, makes its TxnOffsetCommit offsets the group's committed offsets.

Durability: `DATA/kafka/transactions.json` (tmp + fsync + rename) holds every id's producer id,
epoch, state and, in PREPARE_COMMIT, the partitions and pending offsets. It is written before an
epoch is handed out, before any marker is written, and (the completed state) before EndTxn is
answered, so PREPARE_* on disk means the producer has not started another transaction since. The store's transaction index (derived from
the log) knows which partitions hold batches of a transaction without a marker. At start
(`recover`), with that:
1. PREPARE_COMMIT: the decision was taken; commit markers go where data is still open, the pending
   offsets are committed.
2. ONGOING or PREPARE_ABORT, or open data in the log: abort markers, and the epoch is bumped so the
   producer, if it outlived us, is fenced instead of continuing a half-aborted transaction.
3. Open data of a producer id no transactional id owns (the state file was lost): abort markers.
So no transaction open at a crash is ever half visible. Event-loop-only.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as E

from store.config import StoreError, UnknownTopicOrPartitionError
from store.record_batch import CONTROL_MASK, TRANSACTIONAL_MASK, build_batch, parse_header
from store.txn_index import ABORT, COMMIT

from .offsets import CommittedOffset, OffsetStore
from .producers import ProducerStateManager

__all__ = ["TransactionCoordinator", "TxnState", "control_batch"]

if TYPE_CHECKING:
    from store.store import Store

log = logging.getLogger("lightgate.kafka.txn")

MAX_TIMEOUT_MS = 900_000  # [transaction.max.timeout.ms]
_MAX_EPOCH = 32_766
_KEY = struct.Struct(">hh")
_VALUE = struct.Struct(">hi")

TP = tuple[str, int]


class TxnState(enum.Enum):
    EMPTY = "Empty"
    ONGOING = "Ongoing"
    PREPARE_COMMIT = "PrepareCommit"
    PREPARE_ABORT = "PrepareAbort"
    COMPLETE_COMMIT = "CompleteCommit"
    COMPLETE_ABORT = "CompleteAbort"


_PREPARING = (TxnState.PREPARE_COMMIT, TxnState.PREPARE_ABORT)


@dataclass(slots=True)
class TxnMeta:
    tid: str
    pid: int
    epoch: int
    timeout_ms: int
    state: TxnState = TxnState.EMPTY
    partitions: set[TP] = field(default_factory=set)
    pending: dict[str, dict[TP, CommittedOffset]] = field(default_factory=dict)  # by group
    started: float = 0.0  # monotonic seconds when ONGOING began


def control_batch(pid: int, epoch: int, kind: int, now_ms: int) -> bytes:
    """A commit/abort marker as Kafka writes it (`EndTransactionMarker`)."""
    return bytes(
        build_batch(
            [(now_ms, _KEY.pack(0, kind), _VALUE.pack(0, 0), [])],
            producer_id=pid,
            producer_epoch=epoch,
            attributes=CONTROL_MASK | TRANSACTIONAL_MASK,
        )
    )


class TransactionCoordinator:
    def __init__(
        self,
        directory: Path,
        store: Store,
        producers: ProducerStateManager,
        offsets: OffsetStore,
        note_durable: Callable[[str, int, asyncio.Future[None]], None],
    ) -> None:
        self._path = directory / "transactions.json"
        self.store = store
        self.producers = producers
        self.offsets = offsets
        self._note_durable = note_durable
        self.txns: dict[str, TxnMeta] = {}
        self._by_pid: dict[int, TxnMeta] = {}
        self._seq = 0
        self._written = -1
        self._lock = threading.Lock()
        self._load()

    # --- validation ---------------------------------------------------------------------------

    def check(self, tid: str, pid: int, epoch: int, fenced: int = E.producer_fenced) -> int:
        """The error for a request naming (tid, pid, epoch); E.none if current and not ending."""
        m = self.txns.get(tid)
        if m is None or m.pid != pid:
            return E.invalid_producer_id_mapping
        if epoch != m.epoch:
            return fenced
        if m.state in _PREPARING:
            return E.concurrent_transactions
        return E.none

    def check_produce(self, tid: str, pid: int, epoch: int, tp: TP) -> int:
        err = self.check(tid, pid, epoch, E.invalid_producer_epoch)
        if err:
            return err
        m = self.txns[tid]
        if m.state is not TxnState.ONGOING or tp not in m.partitions:
            return E.invalid_txn_state
        return E.none

    def _begin(self, m: TxnMeta) -> None:
        if m.state is not TxnState.ONGOING:
            m.state = TxnState.ONGOING
            m.partitions = set()
            m.pending = {}
            m.started = time.monotonic()

    # --- requests -----------------------------------------------------------------------------

    async def init_producer(
        self, tid: str, timeout_ms: int, pid: int = -1, epoch: int = -1
    ) -> tuple[int, int, int]:
        """InitProducerId with a transactional id: (error, producer id, epoch)."""
        if not 0 < timeout_ms <= MAX_TIMEOUT_MS:
            return E.invalid_transaction_timeout, -1, -1
        m = self.txns.get(tid)
        if m is None:
            m = TxnMeta(tid, self.producers.new_producer_id(), 0, timeout_ms)
            self.txns[tid] = m
            self._by_pid[m.pid] = m
        else:
            if m.state in _PREPARING:
                return E.concurrent_transactions, -1, -1
            if pid >= 0 and (pid, epoch) != (m.pid, m.epoch):  # KIP-360 bump by an old producer
                return E.producer_fenced, -1, -1
            if m.state is TxnState.ONGOING:  # a previous incarnation left it open
                await self.end(m, commit=False)
            self._bump(m)
            m.timeout_ms = timeout_ms
            m.state = TxnState.EMPTY
        await self.persist()
        return E.none, m.pid, m.epoch

    def _bump(self, m: TxnMeta) -> None:
        if m.epoch >= _MAX_EPOCH:  # as Kafka: a new producer id once the epoch would overflow
            del self._by_pid[m.pid]
            m.pid, m.epoch = self.producers.new_producer_id(), 0
            self._by_pid[m.pid] = m
        else:
            m.epoch += 1

    def add_partitions(self, tid: str, pid: int, epoch: int, tps: list[TP], fenced: int) -> int:
        err = self.check(tid, pid, epoch, fenced)
        if err:
            return err
        m = self.txns[tid]
        self._begin(m)
        m.partitions.update(tps)
        return E.none

    def add_offsets(self, tid: str, pid: int, epoch: int, group: str, fenced: int) -> int:
        err = self.check(tid, pid, epoch, fenced)
        if err:
            return err
        m = self.txns[tid]
        self._begin(m)
        m.pending.setdefault(group, {})
        return E.none

    def txn_offsets(
        self, tid: str, pid: int, epoch: int, group: str, items: list[tuple[TP, CommittedOffset]],
        fenced: int,
    ) -> int:  # fmt: skip
        """TxnOffsetCommit: offsets held back until the transaction commits."""
        err = self.check(tid, pid, epoch, fenced)
        if err:
            return err
        m = self.txns[tid]
        if m.state is not TxnState.ONGOING or group not in m.pending:
            return E.invalid_txn_state  # AddOffsetsToTxn must come first
        m.pending[group].update(items)
        return E.none

    def pending_offset(self, group: str, tp: TP) -> bool:
        """An open transaction will change this committed offset (OffsetFetch require_stable)."""
        return any(
            tp in m.pending.get(group, ())
            for m in self.txns.values()
            if m.state is not TxnState.EMPTY
        )

    async def end_txn(self, tid: str, pid: int, epoch: int, commit: bool, fenced: int) -> int:
        m = self.txns.get(tid)
        if m is not None and m.pid == pid and m.epoch == epoch:
            done = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
            if m.state is done or m.state is TxnState.EMPTY:  # a retry, or nothing was added
                return E.none
            if m.state in (TxnState.COMPLETE_COMMIT, TxnState.COMPLETE_ABORT):
                return E.invalid_txn_state
        err = self.check(tid, pid, epoch, fenced)
        if err:
            return err
        assert m is not None
        return await self.end(m, commit)

    # --- ending -------------------------------------------------------------------------------

    async def end(self, m: TxnMeta, commit: bool, parts: set[TP] | None = None) -> int:
        """Prepare (durably), write a marker into each partition, then complete."""
        m.state = TxnState.PREPARE_COMMIT if commit else TxnState.PREPARE_ABORT
        await self.persist()
        err = await self.write_markers(m.pid, m.epoch, COMMIT if commit else ABORT,
                                       m.partitions if parts is None else parts)  # fmt: skip
        if err:  # stay in PREPARE_*: a restart finishes it; the client sees a storage error
            return err
        if commit:
            for group, offsets in m.pending.items():
                await self.offsets.commit(group, [(t, p, c) for (t, p), c in offsets.items()])
        m.state = TxnState.COMPLETE_COMMIT if commit else TxnState.COMPLETE_ABORT
        m.partitions, m.pending = set(), {}
        # Durable before EndTxn is answered, so before the producer can start its next
        # transaction: a crash that left PREPARE_COMMIT on disk while the next transaction's
        # data was already in the log made recovery commit that data (recovery case 1 marks all
        # open data of the producer id). Now PREPARE_* on disk means no later data exists.
        await self.persist()
        return E.none

    async def write_markers(self, pid: int, epoch: int, kind: int, parts: set[TP]) -> int:
        batch = control_batch(pid, epoch, kind, int(time.time() * 1000))
        waits = []
        for t, p in sorted(parts):
            try:
                r = self.store.append_batch(t, p, batch)
            except UnknownTopicOrPartitionError:
                continue  # the topic was deleted with the transaction's data
            except StoreError:
                log.exception("cannot write a transaction marker into %s-%d", t, p)
                return E.kafka_storage_error
            assert r.runs is not None
            self.producers.record(t, p, parse_header(batch), r.runs[0][2])
            self._note_durable(t, p, r.durable)
            waits.append(r.durable)
        if waits:
            await asyncio.wait(waits)
            if any(f.cancelled() or f.exception() is not None for f in waits):
                return E.kafka_storage_error
        return E.none

    async def expire(self) -> int:
        """Abort transactions open longer than their timeout, bumping the epoch (as Kafka)."""
        now = time.monotonic()
        n = 0
        for m in list(self.txns.values()):
            if m.state is TxnState.ONGOING and now - m.started > m.timeout_ms / 1000.0:
                log.info("transaction of %r timed out; aborting", m.tid)
                self._bump(m)
                await self.end(m, commit=False)
                n += 1
        return n

    async def recover(self) -> int:
        """Finish what a crash left open (module docstring, cases 1-3); returns markers' txns."""
        open_parts: dict[int, set[TP]] = {}
        for tp, pids in self.store.txn_index.open_transactions().items():
            for pid in pids:
                open_parts.setdefault(pid, set()).add(tp)
        n = 0
        for m in list(self.txns.values()):
            parts = open_parts.pop(m.pid, set())
            if m.state is TxnState.PREPARE_COMMIT:
                await self.end(m, commit=True, parts=parts)
            elif m.state in (TxnState.ONGOING, TxnState.PREPARE_ABORT) or parts:
                self._bump(m)
                await self.end(m, commit=False, parts=parts)
            else:
                continue
            log.warning("transaction of %r open at the last stop: %s", m.tid, m.state.value)
            n += 1
        for pid, parts in open_parts.items():
            log.warning("aborting an open transaction of unknown producer id %d", pid)
            await self.write_markers(pid, 0, ABORT, parts)
            n += 1
        return n

    # --- persistence --------------------------------------------------------------------------

    def _load(self) -> None:
        (self._path.parent / (self._path.name + ".tmp")).unlink(missing_ok=True)
        try:
            doc = json.loads(self._path.read_text())
        except FileNotFoundError:
            return
        now = time.monotonic()
        for e in doc["txns"]:
            m = TxnMeta(e["tid"], e["pid"], e["epoch"], e["timeout_ms"], TxnState(e["state"]),
                        {(t, p) for t, p in e["partitions"]}, started=now)  # fmt: skip
            for group, rows in e["pending"].items():
                m.pending[group] = {(t, p): CommittedOffset(o, le, md) for t, p, o, le, md in rows}
            self.txns[m.tid] = m
            self._by_pid[m.pid] = m

    def _export(self) -> dict[str, Any]:
        self._seq += 1
        txns = [
            {"tid": m.tid, "pid": m.pid, "epoch": m.epoch, "timeout_ms": m.timeout_ms,
             "state": m.state.value, "partitions": sorted(m.partitions),
             "pending": {g: [[t, p, c.offset, c.leader_epoch, c.metadata]
                             for (t, p), c in offs.items()] for g, offs in m.pending.items()}}
            for m in self.txns.values()
        ]  # fmt: skip
        return {"seq": self._seq, "txns": txns}

    def _write(self, doc: dict[str, Any]) -> None:
        with self._lock:
            if doc["seq"] <= self._written:
                return
            tmp = self._path.parent / (self._path.name + ".tmp")
            with tmp.open("w") as f:
                json.dump(doc, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path)
            self._written = doc["seq"]

    async def persist(self) -> None:
        """Write the state durably (off the loop); returns once it is on disk."""
        doc = self._export()
        await asyncio.get_running_loop().run_in_executor(None, self._write, doc)

    async def close(self) -> None:
        """Write the final state."""
        self._write(self._export())
