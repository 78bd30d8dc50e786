"""`LightQueues`: the light-queue service the MQTT proxy uses (see docs/light-queues.md).

Derived data: the queues index the commitlog and are rebuilt from it by `rebuild_queues`; only
sessions, retained messages and the filter records (which filters exist, since when) are state.

Queues, by name:
- exact `a/b/c`: one per MQTT topic, created by the dispatcher on the topic's first record (or by
  a subscription that comes first); never dropped, trimmed by retention.
- filter `a/+/c`, `a/#`: created by the first `acquire_filter`, live from the dispatcher's
  position at that moment; ref-counted, dropped `filter_grace_s` after the last release.
- replay `$replay/<since>/<filter>`: history from `since`, then live (backfill.py); ref-counted.

Positions are dense sequence numbers. A dropped queue leaves a tombstone (its next sequence), so
a re-created queue never reuses a sequence number. Event-loop-only unless stated.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lightqueue import codec
from lightqueue.backfill import Backfill, relevant_topics, start_vector
from lightqueue.db import LIGHTQUEUE_DIR, Queue, QueueDB
from lightqueue.dispatcher import Dispatcher, EventSink, WatchSink
from lightqueue.keys import (
    KIND_DROPPED,
    KIND_EXACT,
    KIND_FILTER,
    KIND_REPLAY,
    P_FILTER,
    block_start,
    entry_key,
    read_entries_py,
)
from lightqueue.maintenance import QueueMaintenance, log_start
from lightqueue.model import Position, ReadResult, StoredMessage
from lightqueue.rebuild import recover_dirs
from lightqueue.resolver import Resolver
from lightqueue.retained import RetainedStore
from lightqueue.session_store import BridgePositions, SessionStore
from lightqueue.topic_trie import FilterError, FilterTrie, is_wildcard, validate_filter
from store.backend import LogBackend
from store.twins import twin

if TYPE_CHECKING:
    pass

log = logging.getLogger("lightgate.lightqueue")

REPLAY_PREFIX = "$replay/"

_read_entries = twin(
    read_entries_py,
    "lightqueue._cblocks",
    "read_entries",
    what="a light queue's entries from its blocks",
)


@dataclass(slots=True)
class LightQueueConfig:
    dispatch_batch_records: int = 20_000  # records per dispatch WriteBatch (round)
    dispatch_read_bytes: int = 1 << 20  # Store.read size while dispatching
    filter_grace_s: float = 60.0  # an unheld filter queue is dropped after this
    maintenance_interval_s: float = 1.0  # GC, retention trimming, purging
    resolve_cache_records: int = 100_000
    purge_per_tick: int = 50_000  # trimmed/dropped entries deleted per maintenance tick
    backfill_step_records: int = 20_000  # records scanned per replay backfill WriteBatch

    @classmethod
    def from_object(cls, obj: Any) -> LightQueueConfig:
        return cls(**{f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)})


class Acquired(NamedTuple):
    queue: str  # the light queue to read
    start_seq: int  # where a new subscription starts (live end; history start for a replay)


def replay_queue_name(filt: str, since_ms: int | None = None,
                      offsets: dict[tuple[str, int], int] | None = None) -> str:  # fmt: skip
    """`$replay/<since_ms>/<filter>`, or `$replay/@<digest of the offsets>/<filter>`."""
    if offsets is not None:
        canon = ",".join(f"{t}:{p}:{o}" for (t, p), o in sorted(offsets.items()))
        return f"{REPLAY_PREFIX}@{hashlib.sha1(canon.encode()).hexdigest()[:16]}/{filt}"
    return f"{REPLAY_PREFIX}{int(since_ms or 0)}/{filt}"


class LightQueues:
    """Dispatcher + queues + read/resolve + sessions + retained over one LevelDB; its
    housekeeping (GC, retention trimming, purging) is its `QueueMaintenance`."""

    def __init__(self, qdb: QueueDB, store: LogBackend, config: LightQueueConfig,
                 sink: EventSink | None) -> None:  # fmt: skip
        self.qdb = qdb
        self.store = store
        self.config = config
        self.trie: FilterTrie[Queue] = FilterTrie()
        self.dispatcher = Dispatcher(
            qdb, store, self.trie, sink, config.dispatch_batch_records, config.dispatch_read_bytes
        )
        self.resolver = Resolver(store, config.resolve_cache_records)
        self.sessions = SessionStore(qdb.db)
        self.bridges = BridgePositions(qdb.db)
        self.retained = RetainedStore(qdb.db)
        if getattr(store, "remote_reads", False):
            # A cluster log is shared by several nodes: each derives retained messages from
            # the records it indexes, so every node serves the same (docs/deployment.md).
            self.dispatcher.retained = self.retained
        self._filters: dict[str, Queue] = {}  # filter and replay queues that are not dropped
        self._backfills: dict[str, Backfill] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self.dispatch_task: asyncio.Task[None] | None = None
        self.maintenance = QueueMaintenance(
            qdb, store, config, self.trie, self.dispatcher, self._filters, self._backfills
        )
        for name, rec in qdb.filters.items():
            q = qdb.queues[name]
            self._filters[name] = q
            if rec.get("state", "live") == "live":
                self._make_live(q, invalidate=False)
            else:
                self._backfills[name] = Backfill(self, q, rec)

    @classmethod
    def open(cls, data_dir: Path, store: LogBackend, config: LightQueueConfig | None = None,
             sink: EventSink | None = None) -> LightQueues:  # fmt: skip
        """Open (or create) DATA/lightqueue. Call `start()` on the loop to begin dispatching."""
        recover_dirs(Path(data_dir))  # an interrupted rebuild-queues
        return cls(QueueDB(Path(data_dir) / LIGHTQUEUE_DIR), store, config or LightQueueConfig(),
                   sink)  # fmt: skip

    @property
    def sink(self) -> EventSink | None:
        return self.dispatcher.sink

    def set_sink(self, sink: EventSink | None) -> None:
        """Where `(queue, last_seq)` events go after each dispatch batch (e.g. notifier.publish)."""
        self.dispatcher.sink = sink

    def set_watch_sink(self, sink: WatchSink | None) -> None:
        """Where watched queues' new entries go after each dispatch round (before the events)."""
        self.dispatcher.watch_sink = sink

    def watch(self, queue: str) -> bool:
        """Push this queue's new entries to the watch sink from now on (one per `unwatch`).
        False if the queue does not exist (nothing to watch; reads still work)."""
        q = self.qdb.queues.get(queue)
        if q is None:
            return False
        q.watchers += 1
        if q.watch is None:
            q.watch = []
        return True

    def unwatch(self, queue: str) -> None:
        q = self.qdb.queues.get(queue)
        if q is None or q.watchers == 0:
            return
        q.watchers -= 1
        if q.watchers == 0:
            q.watch = None

    async def start(self) -> None:
        """Repair checkpoints, begin tailing the store, resume backfills, start maintenance."""
        d = self.dispatcher
        d.refresh()
        d.repair()
        self.store.add_append_listener(d.on_append)
        if hasattr(self.store, "add_topic_listener"):
            self.store.add_topic_listener(self.on_topic_event)
        loop = asyncio.get_running_loop()
        self.start_dispatch()
        self._tasks.append(loop.create_task(self.maintenance.run(), name="lightqueue-maintenance"))
        self._tasks[-1].add_done_callback(_task_ended)
        for bf in self._backfills.values():
            self._tasks.append(loop.create_task(bf.run(), name=f"backfill {bf.q.name}"))

    def start_dispatch(self) -> bool:
        """Start the dispatcher task unless it runs; True if started. The gateway's health says
        503 while it is not running (`dispatch_running`)."""
        if self.dispatch_running:
            return False
        task = asyncio.get_running_loop().create_task(
            self.dispatcher.run(), name="lightqueue-dispatch"
        )
        task.add_done_callback(_task_ended)
        self.dispatch_task = task
        self._tasks.append(task)
        self.dispatcher._wake.set()
        return True

    @property
    def dispatch_running(self) -> bool:
        t = self.dispatch_task
        return t is not None and not t.done() and self.dispatcher.failed is None

    async def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.store.remove_append_listener(self.dispatcher.on_append)
        remove = getattr(self.store, "remove_topic_listener", None)  # the local log has topics
        if remove is not None:
            with contextlib.suppress(ValueError):
                remove(self.on_topic_event)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        self.qdb.close(clean=self.dispatcher.failed is None)

    # -- housekeeping (QueueMaintenance does it) ---------------------------------------------

    def maintain(self, now: float | None = None) -> None:
        """GC unheld filters, trim queues behind moved log starts, purge garbage entries."""
        self.maintenance.maintain(now)

    def gc(self, now: float | None = None) -> int:
        return self.maintenance.gc(now)

    def trim(self, force: bool = False) -> int:
        return self.maintenance.trim(force)

    def purge(self, budget: int) -> int:
        return self.maintenance.purge(budget)

    def on_topic_event(self, event: str, topic: str) -> None:
        """Store topic listener. A moved log start trims the queues at once. A deleted log topic
        leaves nothing behind that points into it:
        entries read as void (they are skipped like records retention deleted), checkpoints and
        retained messages in it go, in one WriteBatch; queues and subscriptions stay."""
        if event == "start":  # DeleteRecords moved a log start: queues skip to it now
            self.trim()
            return
        if event != "deleted":
            return
        wb = self.qdb.db.write_batch()
        self.qdb.forget_topic(topic, wb)
        dropped = self.retained.delete_log_topic(topic, wb)
        wb.write()
        self.dispatcher.forget(topic)
        self.resolver.forget(topic)
        self.maintenance.forget_topic(topic)
        for bf in self._backfills.values():
            for tp in [tp for tp in bf.cursor if tp[0] == topic]:
                del bf.cursor[tp]
        log.info(
            "log topic %s deleted: light-queue entries void, %d retained dropped", topic, dropped
        )

    # -- subscriptions -----------------------------------------------------------------------
    def acquire_filter(self, filt: str, since_ms: int | None = None,
                       offsets: dict[tuple[str, int], int] | None = None) -> Acquired:  # fmt: skip
        """Hold the queue a subscription to `filt` reads, creating it if needed.

        Plain filter: a new subscription starts at the queue's next sequence (exact topics are
        not ref-counted). With `since_ms` or `offsets`: the replay queue, starting at its first
        history entry. A replay queue *name* (`$replay/...`, as stored in a session) holds that
        queue again. Each acquire of a filter/replay queue needs one `release_filter`.
        """
        if filt.startswith(REPLAY_PREFIX) and since_ms is None and offsets is None:
            return self._acquire_replay_name(filt)
        validate_filter(filt)
        if since_ms is None and offsets is None:
            if not is_wildcard(filt):
                q = self.qdb.queues.get(filt)
                if q is None:
                    wb = self.qdb.db.write_batch()
                    q = self.qdb.new_queue(filt, KIND_EXACT, wb)
                    wb.write()
                    self.dispatcher.invalidate()
                return Acquired(filt, q.next)
            q = self._filters.get(filt)
            if q is None:
                q = self._create(filt, filt, KIND_FILTER, None)
            self._hold(q)
            return Acquired(filt, q.next)
        name = replay_queue_name(filt, since_ms, offsets)
        q = self._filters.get(name)
        if q is None:
            vec = dict(offsets) if offsets is not None else None
            if vec is None:
                assert since_ms is not None
                vec = start_vector(self.store, filt, since_ms)
            q = self._create(name, filt, KIND_REPLAY, vec, since_ms)
        self._hold(q)
        return Acquired(name, q.start)

    def needs_prepare(self, items: Sequence[tuple[str, int | None]]) -> bool:
        """Whether `prepare_acquire` must run before these acquires (a replay on the cluster)."""
        return self.remote_reads and any(
            since is not None or filt.startswith(REPLAY_PREFIX) for filt, since in items
        )

    async def prepare_acquire(self, items: Sequence[tuple[str, int | None]]) -> None:
        """Before `acquire_filter` of these (filter or replay name, since_ms) on the cluster log:
        ask it where each new replay starts (`LogBackend.prefetch_times`), so that the
        synchronous acquire starts at since_ms rather than at the log start."""
        if not self.remote_reads:
            return
        wants: list[tuple[str, int, int]] = []
        for filt, since in items:
            if since is None:  # a replay queue's name (a session's): re-created if gone
                parts = filt.split("/", 2)
                if not filt.startswith(REPLAY_PREFIX) or filt in self._filters:
                    continue
                if len(parts) != 3 or not parts[1].isdigit():
                    continue
                filt, since = parts[2], int(parts[1])
            elif replay_queue_name(filt, since) in self._filters:
                continue
            for t in relevant_topics(self.store, filt):
                wants.extend((t, p, since) for p in range(self.store.topics()[t]))
        if wants:
            await self.store.prefetch_times(wants)

    def _acquire_replay_name(self, name: str) -> Acquired:
        q = self._filters.get(name)
        if q is not None:
            self._hold(q)
            return Acquired(name, q.start)
        parts = name.split("/", 2)
        if len(parts) == 3 and parts[1].isdigit():
            return self.acquire_filter(parts[2], since_ms=int(parts[1]))
        raise FilterError(f"replay queue {name!r} is gone and cannot be re-created from its name")

    def release_filter(self, queue: str) -> None:
        """Undo one `acquire_filter` (by queue name or plain filter); exact queues: no-op."""
        q = self._filters.get(queue)
        if q is None or q.refs == 0:
            return
        q.refs -= 1
        if q.refs == 0:
            q.released_at = time.monotonic()

    def _hold(self, q: Queue) -> None:
        q.refs += 1

    def _create(self, name: str, filt: str, kind: int,
                vec: dict[tuple[str, int], int] | None, since_ms: int | None = None) -> Queue:  # fmt: skip
        qdb = self.qdb
        wb = qdb.db.write_batch()
        q = qdb.new_queue(name, kind, wb)
        q.filter = filt
        if kind == KIND_FILTER:
            # Live from the dispatcher's position: rebuild gates the queue there.
            frm = [[qdb.topic_id(t, wb), p, o] for (t, p), o in sorted(qdb.checkpoints.items())]
            rec: dict[str, Any] = {"v": 1, "kind": "filter", "filter": filt, "from": frm,
                                   "created_ms": int(time.time() * 1000), "state": "live"}  # fmt: skip
        else:
            assert vec is not None
            frm = [[qdb.topic_id(t, wb), p, o] for (t, p), o in sorted(vec.items())]
            rec = {"v": 1, "kind": "replay", "filter": filt, "from": frm, "cursor": frm,
                   "since_ms": since_ms, "created_ms": int(time.time() * 1000),
                   "state": "backfill"}  # fmt: skip
        wb.put(P_FILTER + name.encode("utf-8"), codec.encode(rec))
        wb.write()
        qdb.filters[name] = rec
        self._filters[name] = q
        if kind == KIND_FILTER:
            self._make_live(q)
        else:
            bf = self._backfills[name] = Backfill(self, q, rec)
            if not bf.step():  # small histories go live at once, synchronously
                self._tasks.append(asyncio.get_running_loop().create_task(bf.run()))
        return q

    def _make_live(self, q: Queue, invalidate: bool = True) -> None:
        assert q.filter is not None
        q.live = True
        self.trie.add(q.filter, q)
        self._backfills.pop(q.name, None)
        if invalidate:
            self.dispatcher.invalidate()

    # -- reading -----------------------------------------------------------------------------
    def read(self, queue: str, from_seq: int, max_n: int) -> ReadResult:
        """Up to `max_n` entries from `max(from_seq, start)`; see ReadResult.

        Entries whose record retention already deleted are trimmed from the front here too, so
        `start_seq` moves past them before the maintenance task gets to it.
        """
        q = self.qdb.queues.get(queue)
        if q is None:
            return ReadResult([], 0, 0, max(from_seq, 0))
        start, nxt = q.start, q.next
        first = max(from_seq, start)
        end = min(nxt, first + max_n)
        if first >= end:
            return ReadResult([], start, nxt, first)
        db = self.qdb.db
        it = db.iterator(start=block_start(db, q.qid, first), stop=entry_key(q.qid, end))
        entries = _read_entries(it, first, end, self.qdb.topic_names)
        # Leading entries that are dead (void, or retention deleted the record): the queue
        # effectively starts after them; the maintenance task will persist that.
        skip = 0
        starts: dict[tuple[str, int], int] = {}
        for ent in entries:
            if ent is not None:
                ls = starts.get((ent[0], ent[1]))
                if ls is None:
                    ls = starts[(ent[0], ent[1])] = log_start(self.store, ent[0], ent[1])
                if ent[2] >= ls:
                    break
            skip += 1
        if skip:
            return ReadResult(entries[skip:], first + skip, nxt, first + skip)
        return ReadResult(entries, start, nxt, first)

    @property
    def remote_reads(self) -> bool:
        """The log answers reads from memory and the network (store.backend): `prefetch`
        before `resolve`, or records not fetched yet resolve to None."""
        return bool(getattr(self.store, "remote_reads", False))

    async def prefetch(self, entries: Sequence[Position | None]) -> None:
        """Bring the records of `entries` into memory (cluster log), batched per partition."""
        missing = self.resolver.uncached(entries)
        if missing:
            await self.store.prefetch(missing)

    def resolve(self, entries: Sequence[Position | None]) -> list[StoredMessage | None]:
        """Messages for `entries` (aligned; None for void or deleted records)."""
        return self.resolver.resolve(entries)

    def last_seq(self, queue: str) -> int | None:
        """Last sequence of `queue` (-1: empty), None if unknown. Notify's `last_seq_of`."""
        q = self.qdb.queues.get(queue)
        return None if q is None else q.next - 1

    def info(self, queue: str) -> tuple[int, int, int] | None:
        """(kind, start_seq, next_seq) or None."""
        q = self.qdb.queues.get(queue)
        return None if q is None else (q.kind, q.start, q.next)

    def stats(self) -> dict[str, int]:
        """Gauges and totals for /metrics."""
        d = self.dispatcher
        return {
            "lightqueue_queues": len(self.qdb.queues),
            "lightqueue_filters": len(self._filters),
            "lightqueue_backfills": len(self._backfills),
            "lightqueue_dispatched_records": d.records,
            "lightqueue_dispatch_lag_records": d.behind(),
            "lightqueue_corrupt_batches": d.corrupt_batches,
        }

    def queue_names(self) -> list[str]:
        return [n for n, q in self.qdb.queues.items() if q.kind != KIND_DROPPED]

    def held(self, queue: str) -> int:
        q = self._filters.get(queue)
        return 0 if q is None else q.refs

    async def wait_live(self, queue: str) -> None:
        """Wait until a replay queue has caught up with the dispatcher (tests, tools)."""
        bf = self._backfills.get(queue)
        if bf is not None:
            await bf.done.wait()


def open_light_queues(data_dir: Path, store: LogBackend, sink: EventSink | None = None,
                      config: LightQueueConfig | None = None) -> LightQueues:  # fmt: skip
    """Convenience for wiring: `LightQueues.open`."""
    return LightQueues.open(data_dir, store, config, sink)


def _task_ended(task: asyncio.Task[Any]) -> None:
    """A background task must not die unseen: dispatch stopping stops all MQTT delivery."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("light-queue task %s stopped: %r", task.get_name(), task.exception())
