"""The housekeeping of `LightQueues` (queues.py), run by its maintenance task every
`maintenance_interval_s`: drop filter queues nobody held for `filter_grace_s` (a tombstone keeps
their next sequence), move queue starts past entries whose records retention deleted, and
delete the entries below a queue's start in the background, a bounded number per tick."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from lightqueue.db import Queue, QueueDB
from lightqueue.dispatcher import Dispatcher
from lightqueue.keys import (
    KIND_DROPPED,
    KIND_EXACT,
    P_FILTER,
    block_count,
    block_entries,
    block_start,
    entry_key,
    entry_key_seq,
    entry_prefix,
)
from lightqueue.topic_trie import FilterTrie
from store import UnknownTopicOrPartitionError
from store.backend import LogBackend
from store.mapping import TopicMappingError, log_topic_for

if TYPE_CHECKING:
    from lightqueue.backfill import Backfill
    from lightqueue.queues import LightQueueConfig

log = logging.getLogger("lightgate.lightqueue")

TRIM_SLICE = 20_000  # queues per slice of a trim pass, the loop free between slices


class QueueMaintenance:
    """The housekeeping `LightQueues` delegates to. It works on the queues' state (shared
    objects and dicts LightQueues mutates in place): the queue DB, the filter trie, the
    dispatcher (its partitions, and to re-plan after a drop), the live filter queues and the
    backfills; it keeps what only it uses: the log starts last seen and the purge work."""

    def __init__(
        self,
        qdb: QueueDB,
        store: LogBackend,
        config: LightQueueConfig,
        trie: FilterTrie[Queue],
        dispatcher: Dispatcher,
        filters: dict[str, Queue],
        backfills: dict[str, Backfill],
    ) -> None:
        self.qdb = qdb
        self.store = store
        self.config = config
        self.trie = trie
        self.dispatcher = dispatcher
        self._filters = filters
        self._backfills = backfills
        self._log_starts: dict[tuple[str, int], int] = {}
        self._purge: dict[int, int] = {}  # qid → entries below this sequence are garbage
        self._scrub_pos = 0

    def forget_topic(self, topic: str) -> None:
        """A deleted log topic: its log starts are no longer known."""
        for tp in [tp for tp in self._log_starts if tp[0] == topic]:
            del self._log_starts[tp]

    async def run(self) -> None:
        """The maintenance task: `maintain` every `maintenance_interval_s`, a trim over many
        queues in slices with the loop free between them."""
        while True:
            await asyncio.sleep(self.config.maintenance_interval_s)
            try:
                self.gc()
                for _ in self._trim_steps(False):
                    await asyncio.sleep(0)
                self.purge(self.config.purge_per_tick)
            except Exception:
                log.exception("light-queue maintenance failed")

    def maintain(self, now: float | None = None) -> None:
        """GC unheld filters, trim queues behind moved log starts, purge garbage entries."""
        self.gc(now)
        self.trim()
        self.purge(self.config.purge_per_tick)

    def gc(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        grace = self.config.filter_grace_s
        gone = [q for q in self._filters.values() if q.refs == 0 and now - q.released_at >= grace]
        for q in gone:
            self._drop(q)
        return len(gone)

    def trim(self, force: bool = False) -> int:
        """Advance queue starts past entries whose records retention deleted; returns queues."""
        return sum(self._trim_steps(force))

    def _trim_steps(self, force: bool) -> Iterator[int]:
        """`trim` in slices of TRIM_SLICE queues, yielding how many each moved. Only the log
        topics whose start moved are looked at: an exact queue of another topic is skipped
        without a read (with a million topics, a pass over every queue's blocks held the loop
        for seconds at each retention step, and at every start)."""
        starts = {tp: log_start(self.store, *tp) for tp in self.dispatcher.hwm}
        old = self._log_starts
        if starts == old and not force:
            return
        self._log_starts = starts
        moved = {tp[0] for tp, s in starts.items() if force or s != old.get(tp, 0)}
        if not moved:
            return
        db = self.qdb.db
        names = self.qdb.topic_names
        n = 0
        wb = db.write_batch()
        for i, q in enumerate(list(self.qdb.queues.values()), 1):
            if i % TRIM_SLICE == 0:
                wb.write()
                yield n
                n = 0
                db = self.qdb.db
                wb = db.write_batch()
            if q.kind == KIND_DROPPED or q.start >= q.next:
                continue
            if q.kind == KIND_EXACT and _log_topic_of(q.name) not in moved:
                continue
            new = q.start
            blocks = db.iterator(start=block_start(db, q.qid, q.start),
                                 stop=entry_key(q.qid, q.next))  # fmt: skip
            for k, v in blocks:
                seq = entry_key_seq(k)
                live = False
                for j, e in enumerate(block_entries(v)):
                    if seq + j < new:
                        continue
                    if e is not None and e[2] >= starts.get((names[e[0]], e[1]), 0):
                        live = True
                        break
                    new = seq + j + 1
                if live:
                    break
            if new != q.start:
                q.start = new
                wb.put(q.mkey, q.meta())
                self._purge[q.qid] = new
                n += 1
        wb.write()
        yield n

    def purge(self, budget: int) -> int:
        """Delete up to `budget` entries below their queue's start (trimmed or dropped)."""
        db = self.qdb.db
        done = 0
        self._scrub(256)
        for qid, upto in list(self._purge.items()):
            wb = db.write_batch()
            n = 0
            for k, v in db.iterator(start=entry_prefix(qid), stop=entry_key(qid, upto)):
                if entry_key_seq(k) + block_count(v) > upto:
                    break  # holds the start: stays (readers begin at the start)
                wb.delete(k)
                n += block_count(v)
                if done + n >= budget:
                    break
            wb.write()
            done += n
            if done >= budget:
                break
            del self._purge[qid]
        return done

    def _scrub(self, count: int) -> None:
        """Find garbage left by a crash between a start move and its purge (a few queues/tick)."""
        qs = list(self.qdb.by_qid.values())
        if not qs:
            return
        db = self.qdb.db
        for _ in range(min(count, len(qs))):
            q = qs[self._scrub_pos % len(qs)]
            self._scrub_pos += 1
            if q.start > 0 and q.qid not in self._purge:
                it = db.iterator(start=entry_prefix(q.qid), stop=entry_key(q.qid, q.start))
                oldest = next(it, None)
                if (
                    oldest is not None
                    and entry_key_seq(oldest[0]) + block_count(oldest[1]) <= q.start
                ):
                    self._purge[q.qid] = q.start

    def _drop(self, q: Queue) -> None:
        """Tombstone a filter/replay queue: out of the trie, entries purged in the background."""
        qdb = self.qdb
        if q.filter is not None:
            self.trie.remove(q.filter, q)  # the filter's other queues stay fed
        q.live = False
        self.dispatcher.invalidate()
        q.kind = KIND_DROPPED
        q.start = q.next
        wb = qdb.db.write_batch()
        wb.put(q.mkey, q.meta())
        wb.delete(P_FILTER + q.name.encode("utf-8"))
        wb.write()
        qdb.filters.pop(q.name, None)
        self._filters.pop(q.name, None)
        self._backfills.pop(q.name, None)
        self._purge[q.qid] = q.start
        log.info("dropped unheld filter queue %s (next seq %d kept)", q.name, q.next)


def _log_topic_of(mqtt_topic: str) -> str | None:
    """The log topic an exact queue's entries are in (None: unknown, so it is looked at)."""
    try:
        return log_topic_for(mqtt_topic)
    except TopicMappingError:
        return None


def log_start(store: LogBackend, t: str, p: int) -> int:
    """The partition's log start; far beyond any offset for a partition that is gone."""
    try:
        return int(store.log_start_offset(t, p))
    except UnknownTopicOrPartitionError:
        return 1 << 62
