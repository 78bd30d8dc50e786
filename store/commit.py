"""Group commit: per-tick writes and the per-partition fsync pipeline.

Theory of operation. Appends stage their batches on the partition's `Log` and register a
`_Durable` waiter here (`enqueue`). One `call_soon` callback per tick (`flush`) writes each touched
partition's staged batches with one writev: the high watermark moves, the waiters resolve (or
queue for fsync), and then the append listeners run for every partition written.
Under fsync `always` the partition then enters its pipeline: an fdatasync in a worker thread, so
the loop keeps going, covering everything written before it started (group commit). Up to
`SYNC_DEPTH` run at once per partition: what is written while one has run for `OVERLAP_AFTER_S`
starts the next right away rather than after it (a PUBACK then waits for one fsync, not for the
rest of a slow one and then its own); rounds resolve in the order they started. Under
`interval_ms` waiters resolve after the write and a timer fsyncs dirty partitions; under `never`
only the OS (and close) sync.

Known cost: the writev itself runs on the loop. On this machine's ext4 disk, with fsyncs running,
a writev took 154-297 us on average and up to 100 ms (the kernel makes writes that extend a file
wait for the journal commit). Holding a partition's writes back while its own fsync runs did not
help (measured: same averages), because the wait comes from the shared journal; moving writes to
the I/O thread is the next step if loop stalls matter more than visibility-on-return.

A failed fsync poisons the partition (`Log.failed`): its page cache can no longer be trusted, so
its waiters fail and later appends are refused until a restart recovers from disk.
Event-loop-only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store.config import StoreError
from store.durable_files import fsync_dir
from store.latency import LatencyHistogram
from store.log import Log
from store.segment import LogSegment
from store.twins import twin

log = logging.getLogger("lightgate.store")
# Compiled fsync threads for SyncWorkers; None: its Python threads.
_FsyncPool: Callable[[int], Any] | None = twin(
    None,
    "store._fsync",
    "FsyncPool",
    what="group commit's fsync threads: pthreads that never take the GIL, completions through an eventfd",
    fallback="store.commit.SyncWorkers' Python threads",
)


class _Durable:
    """Counts down the partitions an append touched; resolves its future at zero."""

    __slots__ = ("fut", "remaining")

    def __init__(self, fut: asyncio.Future[None], remaining: int) -> None:
        self.fut = fut
        self.remaining = remaining

    def done_one(self) -> None:
        self.remaining -= 1
        if self.remaining <= 0 and not self.fut.done():
            self.fut.set_result(None)

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(exc)
            self.fut.exception()  # we log the cause; don't warn "never retrieved" too


SYNC_DEPTH = 2  # fsync rounds in flight per partition
# A second round starts only once the newest has run this long. Overlapping every round cost
# 20 % more fsyncs and ~4 points of a core at 1k QoS 1 msg/s (rounds of ~0.5 ms as the loop sees
# them, most over before the next message); under load rounds take 2 ms and more.
OVERLAP_AFTER_S = 0.001


class _Round:
    """One fsync of a partition in flight and the waiters it makes durable."""

    __slots__ = ("waiters", "done", "started")

    def __init__(self, waiters: list[_Durable], started: float) -> None:
        self.waiters = waiters
        self.done = False
        self.started = started


def _fsync_fds(fds: list[int], directory: Path | None) -> None:
    # fdatasync: appends change the size, which it flushes; it skips the mtime-only update.
    for fd in fds:
        os.fdatasync(fd)
    if directory is not None:
        fsync_dir(directory)


class SyncWorkers:
    """Threads that fsync: a job's completion is handed to the event loop in one hop.

    `run_in_executor` took two loop iterations to get a finished fsync back (the executor
    future's state copied into an asyncio future by one callback, whose own callbacks then ran
    in the next iteration), and the loop of a busy gateway iterates every 1-2 ms: measured in a
    QoS 1 fan-in, 2.2 ms on average from an fsync's end to its callback, the largest part of
    what a PUBACK waits for (docs/performance-history.md).

    Compiled (`store._fsync.FsyncPool`, the default): pthreads that never take the GIL, whose
    completions the loop reads from an eventfd and runs itself. Python threads needed the GIL
    after every fsync, which on 2 cores cost the loop's thread ~1,000 forced switches a second
    at 5k QoS 1 msg/s. The Python threads below are the fallback and the tests' fault injector
    (they call `os.fdatasync` through this module)."""

    def __init__(self, n: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._n, self._name = n, name
        self._threads: list[threading.Thread] = []  # started on the first job
        self._pool = None if _FsyncPool is None else _FsyncPool(n)
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, Any]] = {}
        self._next_id = 0
        self._reader: asyncio.AbstractEventLoop | None = None  # the loop watching the eventfd
        _all_workers.add(self)

    def forked(self) -> None:
        """In a fork child: no thread came along; the next job starts threads of its own."""
        self._threads, self._jobs = [], queue.SimpleQueue()
        self._pending.clear()
        self._reader = None
        if self._pool is not None:
            self._pool.forked()

    def submit(
        self,
        loop: asyncio.AbstractEventLoop,
        fds: list[int],
        directory: Path | None,
        done: Callable[[BaseException | None], None],
    ) -> None:
        """fsync `fds` (and `directory`), then `done(error or None)` on `loop`."""
        pool = self._pool
        if pool is not None:
            if self._reader is not loop:
                self._watch(loop)
            self._next_id += 1
            self._pending[self._next_id] = (loop, done)
            pool.submit(self._next_id, fds, None if directory is None else os.fsencode(directory))
            return
        if not self._threads:
            for i in range(self._n):
                t = threading.Thread(target=self._work, name=f"{self._name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        self._jobs.put((loop, fds, directory, done))

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self._pool is not None
        old, self._reader = self._reader, loop
        if old is not None and not old.is_closed():
            old.remove_reader(self._pool.fileno())
        loop.add_reader(self._pool.fileno(), self._completed)

    def _completed(self, reader: asyncio.AbstractEventLoop | None = None) -> None:
        """The eventfd is readable: run the callbacks of every finished job."""
        assert self._pool is not None
        pending, reader = self._pending, reader or self._reader
        for job_id, err in self._pool.take_done():
            loop, done = pending.pop(job_id)
            exc = None if not err else OSError(err, os.strerror(err))
            if loop is not reader:  # submitted from a loop we no longer watch
                with contextlib.suppress(RuntimeError):  # closed: nobody waits any more
                    loop.call_soon_threadsafe(done, exc)
                continue
            try:
                done(exc)
            except Exception:
                log.exception("fsync completion failed")

    def _work(self) -> None:
        jobs = self._jobs
        while True:
            job = jobs.get()
            if job is None:
                return
            loop, fds, directory, done = job
            exc: BaseException | None = None
            try:
                _fsync_fds(fds, directory)
            except BaseException as e:  # noqa: BLE001 - handed to the loop, which fails the waiters
                exc = e
            try:
                loop.call_soon_threadsafe(done, exc)
            except RuntimeError:  # the loop is closed: nobody waits any more
                pass

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()  # finishes the queued jobs
            reader, self._reader = self._reader, None
            if reader is not None and not reader.is_closed():
                reader.remove_reader(self._pool.fileno())  # the loop no longer keeps us alive
                if self._pending:
                    self._completed(reader)  # the jobs that finished since the last read
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for t in threads:
            t.join()


_all_workers: weakref.WeakSet[SyncWorkers] = weakref.WeakSet()


def _forked() -> None:
    for w in list(_all_workers):
        w.forked()


os.register_at_fork(after_in_child=_forked)


class GroupCommit:
    def __init__(
        self,
        policy: Callable[[Log], str],
        seal: Callable[[Log, LogSegment], None],
        listeners: list[Callable[[str, int, int], None]],
    ) -> None:
        self._policy = policy
        self._seal = seal
        self._listeners = listeners
        self._dirty: list[Log] = []
        self._tick_waiters: dict[Log, list[_Durable]] = {}
        self._flush_handle: asyncio.Handle | None = None  # the tick's scheduled `flush`
        self.interval_dirty: set[Log] = set()
        self._syncs: set[asyncio.Future[None]] = set()
        self._rounds: dict[Log, collections.deque[_Round]] = {}  # in flight, oldest first
        self._io = SyncWorkers(4, "store-fsync")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fsync_latency = LatencyHistogram()  # one observation per fsync round of a partition

    def enqueue(self, logs: dict[Log, Any], sync: bool = True) -> asyncio.Future[None]:
        """Register a waiter for an append that staged data on `logs`; schedule the tick's flush.

        `sync=False` (nobody will wait: MQTT QoS 0, Kafka acks=0): the data is written this tick
        like any other, but it starts no fsync of its own; under `always` the interval timer
        syncs it (within `fsync_interval_ms`), or an acknowledged append's fsync covers it first.
        """
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if not logs:  # an empty append is trivially durable
            fut.set_result(None)
            return fut
        w = _Durable(fut, len(logs)) if sync else None
        if w is None:
            fut.set_result(None)
        tw = self._tick_waiters
        for lg in logs:
            ws = tw.get(lg)
            if ws is None:
                tw[lg] = ws = []
                self._dirty.append(lg)
            if w is not None:
                ws.append(w)
        if self._flush_handle is None:
            self._flush_handle = loop.call_soon(self.flush)
        return fut

    def flush_now(self) -> None:
        """`flush` at once if one is scheduled (and no more later)."""
        h = self._flush_handle
        if h is not None:
            h.cancel()
            self.flush()

    def flush(self) -> None:
        """End of tick: one writev per touched partition, then fsync or resolve; listeners last.

        The append listeners run after every partition of the tick has resolved (or queued for
        fsync) its waiters, so the callbacks of those waiters (acks, Kafka produce responses) are
        scheduled ahead of whatever the listeners wake (a light-queue dispatch round, long-polling
        fetches) and go out first. The one exception: the MQTT proxy's own small write, whose
        dispatch round runs right after this flush (`Dispatcher.index_write`), ahead of its acks.
        """
        self._flush_handle = None
        dirty, tw = self._dirty, self._tick_waiters
        self._dirty, self._tick_waiters = [], {}
        written = [lg for lg in dirty if self._write(lg, tw.get(lg, []), self._policy(lg))]
        for lg in written:
            for cb in self._listeners:
                try:
                    cb(lg.topic, lg.partition, lg.hwm)
                except Exception:
                    log.exception("append listener failed")

    def _write(self, lg: Log, ws: list[_Durable], policy: str) -> bool:
        """Write `lg`'s staged batches and hand its waiters on; True if bytes were written."""
        wrote = lg.has_pending
        if wrote:
            try:
                sealed = lg.write_pending()
            except OSError as e:
                log.error("write to %s failed: %s", lg.name, e)
                err = StoreError(f"write to {lg.name} failed: {e}")
                for w in ws:
                    w.fail(err)
                return False
            for seg in sealed:
                self._seal(lg, seg)
        if policy == "always":
            if not ws:  # only unacknowledged data: leave it to the interval timer
                self.interval_dirty.add(lg)
                return wrote
            lg.sync_waiters.extend(ws)
            if self._may_start(lg):
                self.start_sync(lg)
        else:
            for w in ws:
                w.done_one()
            if policy == "interval_ms":
                self.interval_dirty.add(lg)
        return wrote

    def _may_start(self, lg: Log) -> bool:
        """Another fsync round of `lg` may start now (else the next completion starts it)."""
        if not lg.syncing:
            return True
        if lg.syncing >= SYNC_DEPTH:
            return False
        loop = self._loop or asyncio.get_running_loop()
        return loop.time() - self._rounds[lg][-1].started >= OVERLAP_AFTER_S

    def start_sync(self, lg: Log) -> None:
        segs = lg.unsynced()
        for s in segs:
            s.dirty = False
            s.sync_pending += 1
        directory = lg.dir if lg.dir_dirty else None
        lg.dir_dirty = False
        loop = self._loop or asyncio.get_running_loop()
        t0 = loop.time()
        rnd = _Round(lg.sync_waiters, t0)
        lg.sync_waiters = []
        lg.syncing += 1
        rounds = self._rounds.get(lg)
        if rounds is None:
            rounds = self._rounds[lg] = collections.deque()
        rounds.append(rnd)
        fut: asyncio.Future[None] = loop.create_future()  # for `drain`
        self._syncs.add(fut)
        self._io.submit(loop, [s.fd for s in segs], directory,
                        lambda exc: self._sync_done(lg, segs, rnd, fut, t0, exc))  # fmt: skip

    def _sync_done(
        self,
        lg: Log,
        segs: list[LogSegment],
        rnd: _Round,
        fut: asyncio.Future[None],
        t0: float,
        exc: BaseException | None,
    ) -> None:
        self._syncs.discard(fut)
        if not fut.done():
            fut.set_result(None)
        self.fsync_latency.observe((self._loop or asyncio.get_running_loop()).time() - t0)
        lg.syncing -= 1
        for s in segs:
            s.sync_pending -= 1
        rounds = self._rounds[lg]
        if exc is not None:
            if lg.failed is None:
                lg.failed = exc
                log.critical(
                    "fsync of %s failed, partition offline until restart: %s", lg.name, exc
                )
            # Conservative: an earlier round still in flight may succeed, but nothing after a
            # failed fsync can be called durable, and the partition is offline anyway.
            err = StoreError(f"fsync of {lg.name} failed: {exc}")
            for r in rounds:
                for w in r.waiters:
                    w.fail(err)
                r.waiters = []
            for w in lg.sync_waiters:
                w.fail(err)
            lg.sync_waiters = []
        rnd.done = True
        # In order: a round's data is durable once it and every round started before it ended
        # (an earlier round may carry the directory entry of the segment a later one synced).
        while rounds and rounds[0].done:
            for w in rounds.popleft().waiters:
                w.done_one()
        if not rounds:
            del self._rounds[lg]
        if lg.sync_waiters and lg.failed is None and self._may_start(lg):
            self.start_sync(lg)

    def interval_tick(self) -> None:
        """Timer under `interval_ms`: start an fsync of every partition written since the last."""
        dirty, self.interval_dirty = self.interval_dirty, set()
        for lg in dirty:
            if lg.failed is None and self._may_start(lg):
                self.start_sync(lg)
            elif lg.failed is None:
                self.interval_dirty.add(lg)

    async def drain(self) -> None:
        """Write what is staged and wait until no fsync is running (close)."""
        if self._dirty:
            self.flush()
        while self._syncs:
            # Shielded: a caller cancelled while it waits here (a Kafka admin request whose
            # connection closed) must not cancel the fsync that other writers wait for.
            await asyncio.gather(*map(asyncio.shield, list(self._syncs)), return_exceptions=True)

    def shutdown(self) -> None:
        self._io.shutdown()
