"""The proxy's view of the layers below: store, light queues, notify, sessions, retained.

One small adapter so the MQTT code names what it needs (positions, holds, retained lookups,
session state) once. Two implementations, one interface:

- `LocalBackend`: the store, light queues and notifier live in this process (`lightgate serve`
  by default). Every call completes before it returns; the callbacks run inside the call.
- `RemoteBackend` (remote.py): they live in the core process, reached over the core link
  (mqtt_proxy.backends.remote_store, mqtt_proxy.backends.remote_queues, and notify through
  mqtt_proxy.backends.remote_notify; docs/architecture.md, "The core link"). Calls that need an answer
  complete later, on the link's reply.

So the proxy code is written in continuation style (`load(..., done)`, `acquire_many(..., done)`)
and is correct either way; callers that must not let other work in between (a SUBSCRIBE and the
packets behind it) block their connection until `done` runs (`MqttConnection.block`).

Messages this proxy appended are kept (`remember`) by log position, so delivery resolves them
without reading the store (a light-queue entry is only (topic, partition, offset)). The cache is
bounded by bytes, not count: a lagging subscriber within `recent_cache_bytes` of the head still
costs no store read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_right
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, cast

from lightqueue.model import Position, ReadResult
from mqtt_proxy.ports import (
    Acquired,
    ClusterPort,
    Entries,
    EntriesSink,
    LoadDone,
    LogPort,
    Message,
    NotifierPort,
    QueuesPort,
    RetainedPageSink,
    RoundSink,
    SessionState,
)
from mqtt_proxy.sessions.topic_filters import FilterSpec
from store.append_result import AppendResult, Run
from store.mapping import MqttMessage
from store.twins import twin

if TYPE_CHECKING:
    from lightqueue.queues import LightQueues
    from mqtt_proxy.backends.remote_notify import LinkNotifier
    from mqtt_proxy.backends.remote_store import RemoteStore
    from notify import InProcessNotifier
    from store import Store

log = logging.getLogger("lightgate.mqtt.backend")

# Bytes a remembered message is counted at besides its record's bytes in the batch. Measured
# (tracemalloc): a message with a 64-byte payload holds 233 bytes in all (object, payload,
# run slots) and its record takes ~130, so 130 + 240 counted errs on the safe side.
RECENT_OVERHEAD = 240
# Past the budget, runs go until this fraction of it is free. Freeing is the messages' own
# deallocation, on the event loop: an eighth of 64 MiB at a time stalled the loop ~8 ms every
# few seconds at 10k msg/s; a 64th, ~1 ms (the same work in all; docs/performance-history.md).
RECENT_EVICT_FRACTION = 64


class Backend:
    """What both backends share: the recent-append cache and the notify side."""

    # With proxies in their own processes, the core's client-id claims and will registry
    # (mqtt_proxy.backends.cluster.ProxyCluster); None in one process.
    cluster: ClusterPort | None = None

    def __init__(
        self, store: LogPort, notifier: NotifierPort, proxy_id: str, recent_bytes: int
    ) -> None:
        self.store = store
        self.notifier = notifier
        self.proxy_id = proxy_id
        # (log topic, partition) -> (base offsets, runs of messages); fifo: every run, oldest first
        self._parts: dict[tuple[str, int], tuple[list[int], list[list[MqttMessage]]]] = {}
        self._fifo: deque[tuple[tuple[str, int], int, int]] = deque()
        self._recent_bytes = 0
        self._recent_count = 0
        self.cache_hits = 0  # light-queue entries resolved from the recent-append runs
        self.cache_misses = 0  # ... and those that needed a store read (per batch, for /metrics)
        self.recent_max = recent_bytes

    async def start(self) -> None:
        """Anything to learn from the layers below before serving clients."""

    def skip_known_events(self, known: Callable[[str, int], bool]) -> None:
        """Only a local backend's rounds push entries before their events (`LocalBackend`)."""

    def publish(
        self,
        msgs: list[MqttMessage],
        retained: list[int],
        acked: Callable[[asyncio.Future[None]], None] | None,
        writes: list[asyncio.Future[bytes]],
    ) -> AppendResult:
        """Append a loop pass's PUBLISHes (`msgs`, every connection's; `retained`: the indexes
        of the retain=1 ones) and see them on: `acked(durable)` runs once they are durable
        (None: QoS 0 only, no fsync of their own); a retained-message write the acks must wait
        for goes into `writes`. `LocalBackend.publish` is the whole round in one process."""
        raise NotImplementedError

    def _staged(
        self,
        msgs: list[MqttMessage],
        retained: list[int],
        res: AppendResult,
        writes: list[asyncio.Future[bytes]],
    ) -> None:
        """An append whose offsets came later (through the core link, or from a cluster log's
        answer): remember its runs and set its retained messages, before any entry that names
        them is read. A retained write the acks must wait for goes into `writes`."""
        assert res.runs is not None  # staged: the runs are known
        self.remember(msgs, res.runs)
        offsets = res.offsets if retained else None
        if offsets is not None:
            for i in retained:
                w = self.retain(msgs[i], offsets[i])
                if w is not None:
                    writes.append(w)

    # -- the recent-append cache -----------------------------------------------------------
    def remember(self, msgs: list[MqttMessage], runs: list[Run]) -> None:
        """Keep what this proxy just appended, for `_from_recent`. The MqttMessage itself
        serves: it has every field delivery reads (timestamp set at receipt).

        Stored as runs, one per batch (`AppendResult.runs`: base offset + the messages in
        offset order), so remembering costs nothing per message; oldest runs go first once
        `recent_max` bytes are held (each batch's size, plus RECENT_OVERHEAD
        per message)."""
        parts = self._parts
        fifo = self._fifo
        for topic, part, base, idxs, nbytes in runs:
            run = msgs if len(idxs) == len(msgs) else [msgs[i] for i in idxs]
            key = (topic, part)
            p = parts.get(key)
            if p is None:
                p = parts[key] = ([], [])
            p[0].append(base)
            p[1].append(run)
            cost = nbytes + RECENT_OVERHEAD * len(run)
            fifo.append((key, cost, len(run)))
            self._recent_bytes += cost
            self._recent_count += len(run)
        if self._recent_bytes > self.recent_max:
            target = self.recent_max - self.recent_max // RECENT_EVICT_FRACTION
            drop: dict[tuple[str, int], int] = {}
            while self._recent_bytes > target and fifo:
                key, cost, n = fifo.popleft()
                drop[key] = drop.get(key, 0) + 1
                self._recent_bytes -= cost
                self._recent_count -= n
            for key, k in drop.items():
                # A partition's runs are appended in offset order, so its oldest k go; one
                # slice per partition (a `del bases[0]` per run moved the whole list each time:
                # thousands of runs, 19 % of a QoS 1 fan-in's append stage).
                bases, rs = parts[key]
                del bases[:k]
                del rs[:k]
                if not bases:
                    del parts[key]

    def _from_recent(self, entries: Entries) -> tuple[list[Message | None], list[int]]:
        """Messages found in the recent runs, and the indexes of the entries that were not."""
        parts = self._parts
        out: list[Message | None] = [None] * len(entries)
        missing: list[int]
        last = entries[-1] if entries else None
        if last is not None:
            part = parts.get((last[0], last[1]))
            if part is not None and part[0] and last[2] < part[0][0]:
                # A reader behind the runs: its newest entry is older than every run of its
                # partition, so (oldest runs go first) the others are gone too; at worst one
                # more is read from the log. Saves the lookups per entry (a lagging QoS 1
                # reader of a fan-in: ~4 % of the loop).
                missing = [i for i, e in enumerate(entries) if e is not None]
                self.cache_misses += len(missing)
                return out, missing
        missing = _from_recent_runs(entries if type(entries) is list else list(entries), parts, out)
        self.cache_misses += len(missing)
        self.cache_hits += len(entries) - len(missing)
        return out, missing

    @property
    def recent_count(self) -> int:
        return self._recent_count

    @property
    def recent_bytes(self) -> int:
        return self._recent_bytes

    # -- notify and pushed entries ---------------------------------------------------------
    def set_interest(self, queue: str, on: bool) -> None:
        """Delivery reads `queue` (or stopped): its events, and its new entries pushed."""
        self._watch(queue, on)
        if on:
            # announce: the notifier answers with the queue's current last sequence at once.
            self.notifier.register(self.proxy_id, [queue], announce=True)
        else:
            self.notifier.unregister(self.proxy_id, [queue])

    def _watch(self, queue: str, on: bool) -> None:
        raise NotImplementedError

    # Delivery.on_entries: (queue, first sequence, entries) of a watched queue after a round.
    entries_sink: EntriesSink | None = None
    # Delivery.on_round: a round's pushes in one call (in-process rounds only, LocalBackend).
    round_sink: RoundSink | None = None

    async def batches(self) -> AsyncIterator[dict[str, int]]:
        """Coalesced notify events, one dict queue -> last sequence per wake-up."""
        async for batch in self.notifier.batches(self.proxy_id):
            yield batch

    def bound_replay(self, spec: FilterSpec, max_depth_ms: int) -> FilterSpec:
        """Apply `max_replay_depth_ms`: a replay never reaches further back than that."""
        floor = int(time.time() * 1000) - max_depth_ms
        since = spec.replay_since_ms
        if since is not None and since < floor:
            return replace(spec, replay_since_ms=floor)
        return spec

    def close(self) -> None:
        self.notifier.drop(self.proxy_id)

    # -- the interface both implement ------------------------------------------------------
    def load(self, queue: str, from_seq: int, max_n: int, done: LoadDone) -> None:
        """Entries of `queue` from `from_seq` and their messages: `done(read result, msgs)`."""
        raise NotImplementedError

    def load_entries(self, queue: str, from_seq: int, entries: Entries, done: LoadDone) -> None:
        """`load` for entries already known (pushed): only their messages are looked up."""
        self._resolve(queue, ReadResult(entries, 0, from_seq + len(entries), from_seq), done)

    def _resolve(self, queue: str, res: ReadResult, done: LoadDone) -> None:
        """done(res, messages of res.entries): the recent runs first, the store for the rest."""
        raise NotImplementedError

    def acquire_many(self, specs: list[FilterSpec], done: Callable[[list[Acquired]], None]) -> None:
        """Hold the light queue each subscription reads (see LightQueues.acquire_filter)."""
        raise NotImplementedError

    def release(self, queue: str) -> None:
        raise NotImplementedError

    def indexed(self) -> int:
        """Records the dispatcher has indexed since it opened (a monotonic counter)."""
        raise NotImplementedError

    def retain(
        self, msg: MqttMessage, offset: tuple[str, int, int]
    ) -> asyncio.Future[bytes] | None:
        """Set (or, with an empty payload, clear) the retained message of `msg.topic`; None
        when done at once, else the future of the core's answer (written when it resolves)."""
        raise NotImplementedError

    def retained_page(
        self, filt: str, after: bytes | None, limit: int, done: RetainedPageSink
    ) -> None:
        """Up to `limit` unexpired retained messages matching `filt` after the cursor `after`
        (a tree walk, not a scan), then the next cursor."""
        raise NotImplementedError

    async def load_sessions(self) -> list[SessionState]:
        raise NotImplementedError

    def save_sessions(
        self, items: list[tuple[str, SessionState]], done: Callable[[], None] | None = None
    ) -> None:
        """Write session states; `done` runs once they are written (SUBACK waits for it)."""
        raise NotImplementedError

    def delete_session(self, client_id: str) -> None:
        raise NotImplementedError

    async def acquire_all(self, specs: list[FilterSpec]) -> list[Acquired]:
        """`acquire_many` as a coroutine (session restore at start)."""
        fut: asyncio.Future[list[Acquired]] = asyncio.get_running_loop().create_future()
        self.acquire_many(specs, fut.set_result)
        return await fut


class LocalBackend(Backend):
    """Store, light queues and notifier in this process: every call answers at once."""

    def __init__(
        self,
        store: LogPort,
        queues: LightQueues,
        notifier: NotifierPort,
        proxy_id: str,
        recent_bytes: int,
    ) -> None:
        super().__init__(store, notifier, proxy_id, recent_bytes)
        self.queues = queues
        queues.set_watch_sink(self._pushed)
        self._write_now: Callable[[], None] | None = getattr(store, "write_now", None)  # local log

    def publish(
        self,
        msgs: list[MqttMessage],
        retained: list[int],
        acked: Callable[[asyncio.Future[None]], None] | None,
        writes: list[asyncio.Future[bytes]],
    ) -> AppendResult:
        """One PUBLISH round in one process, end to end: what a loop pass (or, with
        `publish_gather_ms`, a few) read from every connection is written, indexed, delivered and announced within this call, in the pass
        that read it; the PUBACKs follow the fsync (docs/architecture.md, "One PUBLISH, end to
        end"). A big write, or one that finds the dispatch task busy, is indexed by that task
        instead, which hands its rounds to the same delivery through `_pushed`."""
        dispatcher = self.queues.dispatcher
        # 1. What was written: one RecordBatch per partition (offsets in input order), staged
        #    in the log; kept here by log position, so delivery never reads it back.
        res = self.store.append_mqtt(msgs, acked is not None)
        if res.runs is None:
            # A cluster log (log = "kafka"): the offsets come with the cluster's answer, and the
            # node's dispatcher indexes the records as it reads them back (`_pushed` delivers).
            res.when_staged(lambda: self._staged(msgs, retained, res, writes))
            if acked is not None:
                res.durable.add_done_callback(acked)
            return res
        self.remember(msgs, res.runs)
        if retained:
            offsets = res.offsets
            assert offsets is not None
            for i in retained:  # a retain=1 PUBLISH is now its topic's retained message
                self.retain(msgs[i], offsets[i])
        # 5. (set up now) Acks: PUBACK / PUBREC once the fsync below makes them durable.
        if acked is not None:
            res.durable.add_done_callback(acked)
        # 2. Which queues it pushed into: written in this pass (one writev per partition; the
        #    fsync, under `always`, starts in the pool) and indexed in one dispatch round: the
        #    new entries of every light queue this proxy reads, and which queues grew.
        write = self._write_now  # None: a cluster log writes on its own
        rnd = None if write is None else dispatcher.index_write(write)
        if rnd is None:
            return res  # the dispatch task indexes it, and delivers through `_pushed`
        # 3. Who gets it: this process's subscribers of those queues, written to their sockets
        #    now (Delivery.on_round: the cached message encoded once per cohort).
        if rnd.pushed and self.round_sink is not None:
            self.round_sink(rnd.pushed)
        # 4. Who else: readers woken by notify (the queues' event sink: notifier.publish), as
        #    bridges and a reader behind the pushed window; events for entries delivery already
        #    has are dropped (`skip_known_events`).
        announce = self.queues.sink
        if announce is not None:
            announce(rnd.events)
        dispatcher.round_done()  # the held LevelDB batch once due, after the delivery
        return res

    def skip_known_events(self, known: Callable[[str, int], bool]) -> None:
        """Rounds push their entries to this process's delivery before publishing events, so
        most events tell it nothing new: let the notifier drop those (one reader-task wake-up
        per message saved at low rates)."""
        skip = getattr(self.notifier, "skip_known", None)
        if skip is not None:
            skip(self.proxy_id, known)

    def _watch(self, queue: str, on: bool) -> None:
        if on:
            self.queues.watch(queue)
        else:
            self.queues.unwatch(queue)

    def _pushed(self, pushed: Sequence[tuple[str, int, Entries]]) -> None:
        if self.round_sink is not None:
            self.round_sink(pushed)
            return
        sink = self.entries_sink
        if sink is not None:
            for queue, first, entries in pushed:
                sink(queue, first, entries)

    def load(self, queue: str, from_seq: int, max_n: int, done: LoadDone) -> None:
        self._resolve(queue, self.queues.read(queue, from_seq, max_n), done)

    def _resolve(self, queue: str, res: ReadResult, done: LoadDone, fetched: bool = False) -> None:
        msgs, missing = self._from_recent(res.entries)
        if missing:
            entries = res.entries
            every = len(missing) == len(entries)  # a reader behind the recent runs
            want = list(entries) if every else [entries[i] for i in missing]
            if not fetched and self.queues.remote_reads:
                # The log is a Kafka cluster: fetch the records first (one fetch per partition
                # run, store.backend), then resolve in one go; `done` runs later, as remotely.
                def fetched_cb(f: asyncio.Future[None]) -> None:
                    if f.cancelled() or f.exception() is not None:
                        log.warning("fetching %d records from the cluster failed: %r",
                                    len(want), None if f.cancelled() else f.exception())  # fmt: skip
                        done(None, None)
                        return
                    self._resolve(queue, res, done, True)

                asyncio.ensure_future(self.queues.prefetch(want)).add_done_callback(fetched_cb)
                return
            got = self.queues.resolve(want)
            if every:
                msgs = cast("list[Message | None]", got)
            else:
                for i, m in zip(missing, got, strict=True):
                    msgs[i] = m
        done(res, msgs)

    def acquire_many(self, specs: list[FilterSpec], done: Callable[[list[Acquired]], None],
                     prepared: bool = False) -> None:  # fmt: skip
        items = [(spec.filter, spec.replay_since_ms) for spec in specs]
        if not prepared and self.queues.needs_prepare(items):
            # The log is a Kafka cluster: ask it where each replay starts, then acquire.
            def ready(f: asyncio.Future[None]) -> None:
                if not f.cancelled() and f.exception() is not None:
                    log.warning("finding replay starts on the cluster failed: %r", f.exception())
                self.acquire_many(specs, done, True)

            asyncio.ensure_future(self.queues.prepare_acquire(items)).add_done_callback(ready)
            return
        out: list[Acquired] = []
        for spec in specs:
            try:
                a = self.queues.acquire_filter(spec.filter, spec.replay_since_ms)
            except Exception as exc:
                log.warning("cannot hold the queue of %r: %s", spec.raw, exc)
                out.append(f"{type(exc).__name__}: {exc}")
                continue
            out.append((a.queue, a.start_seq))
        done(out)

    def release(self, queue: str) -> None:
        self.queues.release_filter(queue)

    def indexed(self) -> int:
        return int(self.queues.dispatcher.records)

    def retain(
        self, msg: MqttMessage, offset: tuple[str, int, int]
    ) -> asyncio.Future[bytes] | None:
        self.queues.retained.set(
            msg.topic, msg.payload, msg.qos, msg.client_id, msg.properties, msg.timestamp_ms, offset
        )
        return None

    def retained_page(
        self, filt: str, after: bytes | None, limit: int, done: RetainedPageSink
    ) -> None:
        done(*self.queues.retained.page(filt, after, limit))

    async def load_sessions(self) -> list[SessionState]:
        return list(self.queues.sessions.load_all())

    def save_sessions(
        self, items: list[tuple[str, SessionState]], done: Callable[[], None] | None = None
    ) -> None:
        if items:
            self.queues.sessions.put_many(items)
        if done is not None:
            done()

    def delete_session(self, client_id: str) -> None:
        self.queues.sessions.delete(client_id)


if TYPE_CHECKING:
    from mqtt_proxy.backends.remote import RemoteBackend

    # The twins behind each seam satisfy the proxy's ports (mqtt_proxy/ports.py); mypy checks it.
    def _twins(
        local: LocalBackend,
        remote: RemoteBackend,
        store: Store,
        remote_store: RemoteStore,
        notifier: InProcessNotifier,
        link_notifier: LinkNotifier,
    ) -> tuple[QueuesPort, QueuesPort, LogPort, LogPort, NotifierPort, NotifierPort]:
        return local, remote, store, remote_store, notifier, link_notifier


def from_recent_py(
    entries: list[Position | None],
    parts: dict[tuple[str, int], tuple[list[int], list[list[MqttMessage]]]],
    out: list[Message | None],
) -> list[int]:
    """out[i] = the message of entries[i] found in the recent runs `parts` ((run base offsets,
    runs) per partition, bases ascending); returns the indexes of the entries not found. The
    compiled twin is `_cbackend.from_recent` (this loop was ~7 % of a QoS 0 fan-in)."""
    missing: list[int] = []
    run: list[MqttMessage] | None = None
    base = 0
    last: tuple[str, int] | None = None
    for i, e in enumerate(entries):
        if e is None:
            continue
        t, p, o = e
        if run is not None and last == (t, p) and 0 <= o - base < len(run):
            out[i] = run[o - base]
            continue
        part = parts.get((t, p))
        if part is not None:
            bases, rs = part
            k = bisect_right(bases, o) - 1
            if k >= 0 and o - bases[k] < len(rs[k]):
                run, base, last = rs[k], bases[k], (t, p)
                out[i] = run[o - base]
                continue
        missing.append(i)
    return missing


_from_recent_runs = twin(
    from_recent_py,
    "mqtt_proxy.backends._cbackend",
    "from_recent",
    what="entries -> the messages this proxy appended lately (its recent runs)",
)
