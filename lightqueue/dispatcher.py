"""Dispatcher: tails the commitlog and appends one entry per record to every light queue it matches.

Theory of operation
-------------------
The dispatcher's position is a checkpoint per log partition: the next offset to index. A *round*
reads, for every partition behind its high watermark (in sorted order, each up to its share of
the round's record budget), whole batches from the checkpoint on, maps each record to its MQTT
topic (store.mapping: the key if it maps back to this log topic, else the topic's first level),
and appends `(log topic id, partition, offset)` to the topic's exact queue and to every *live*
filter queue whose filter matches (`FilterTrie`). A round is ONE LevelDB WriteBatch: the entries
(plus metadata of queues it created) and the new checkpoints; a queue's next sequence is its last
entry + 1, found at open, so it needs no write per round. So after any crash
LevelDB holds the state after some round, whose checkpoints say exactly where to resume: records
are indexed again from there, into the same sequence numbers, giving no duplicate and no gap.
After the write, one coalesced `(queue, last_seq)` event per grown queue goes to the sink; before
that, a queue someone watches (`LightQueues.watch`: a proxy delivering from it) has the round's
new entries pushed to `watch_sink`, so its reader needs no read back from LevelDB to deliver them.
Rounds run inline for the MQTT proxy's small writes (`index_write`) hand their pushes and events
to the caller instead of the sinks (the proxy's PUBLISH round delivers and announces them), and
hold their batch back for the next ones to join (HOLD_S): their pushes and events go out before
the write, and `QueueDB.db` writes the held
batch before anyone else touches the DB, so readers and other writers see it in order. A crash
loses the held rounds as an OS crash loses LevelDB's unsynced tail: indexed again from the
checkpoint, into the same sequence numbers.

Kafka transactions: a round stops at each partition's last stable offset (records of an open
transaction wait for its marker) and skips control batches and the batches of aborted
transactions (`store.txn_index`), so MQTT subscribers only ever get committed records.

Recovery at open (`repair`, lightqueue.repair) clamps the checkpoints to the log as it is.

Hot path notes (measured in bench/lightqueue_bench.py): targets are cached per (log topic, record
key) as a tuple of `Queue` objects, so a repeated topic costs one dict lookup; the entry value is
the partition's precomputed head + the offset bytes, shared by all targets; uncompressed batches
go straight to aiokafka's Cython reader. Event-loop-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from lightqueue.db import Queue, QueueDB
from lightqueue.dispatch_rules import aborted_check, is_system_topic, mqtt_topic_of
from lightqueue.index_batch import _index_batch, _index_batch_py, put_blocks
from lightqueue.keys import (
    KIND_EXACT,
    checkpoint_key,
    entry_head,
    pack_u64,
)
from lightqueue.repair import repair_checkpoints
from lightqueue.topic_trie import FilterTrie
from store import OffsetOutOfRangeError, UnknownTopicOrPartitionError
from store.backend import FetchPending, LogBackend
from store.latency import LatencyHistogram
from store.mapping import PROBE_TOPIC, mqtt_view
from store.record_batch import (
    BH_ATTRIBUTES,
    BH_BASE_OFFSET,
    BH_LAST_OFFSET_DELTA,
    COMPRESSION_MASK,
    BatchWalk,
    InvalidRecordError,
)

log = logging.getLogger("lightgate.lightqueue.dispatch")

# The gateway's latency probes (lightgate/probe.py) are the one system topic that is dispatched,
# into its exact-topic queues only (never a filter: `#` and `+` subscribers do not see probes).
_TARGET_CACHE_MAX = 200_000

EventSink = Callable[[list[tuple[str, int]]], None]
# (queue, first sequence, entries) for each watched queue that grew in a round
WatchSink = Callable[[list[tuple[str, int, list[tuple[str, int, int]]]]], None]


class InlineRound(NamedTuple):
    """What an inline round (`Dispatcher.index_write`) indexed: the new entries of watched
    queues (queue, first sequence, entries), and one (queue, last sequence) per queue that grew."""

    pushed: list[tuple[str, int, list[tuple[str, int, int]]]]
    events: list[tuple[str, int]]


# An inline append (Dispatcher.index_write) of at most this many records per partition that
# finds the dispatch task idle is indexed right after the write: a lone message's latency.
SYNC_RECORDS = 64
# Inline rounds hold their WriteBatch back for the next ones to join, this long at most (written
# by the first round after it, or by a timer at twice this): one LevelDB write per few messages
# at moderate rates instead of one per message (each ~9 % of the CPU of 100 publishers at 10k
# msg/s; docs/performance-history.md). A crash loses at most that much of the index, which the
# rounds after the restart rebuild from the checkpoint (theory above).
HOLD_S = 0.005


class Dispatcher:
    """Indexes the commitlog into light queues, one WriteBatch per round."""

    def __init__(
        self,
        qdb: QueueDB,
        store: LogBackend,
        trie: FilterTrie[Queue],
        sink: EventSink | None = None,
        batch_records: int = 20_000,
        read_bytes: int = 1 << 20,
    ) -> None:
        self.qdb = qdb
        self.store = store
        # what a recent write just put there, as written (a local log only: Store.read_fresh)
        self._read_fresh: Callable[[str, int, int], Any] | None = getattr(store, "read_fresh", None)
        # open Kafka transactions hold records back (None: a log without them)
        self._lso: Callable[[str, int], int] | None = getattr(store, "last_stable_offset", None)
        self._aborted = aborted_check(store)
        self.trie = trie
        self.sink = sink
        self.watch_sink: WatchSink | None = None
        self.retained: Any = None  # RetainedStore to derive retained messages into (cluster log)
        self.batch_records = batch_records
        self.read_bytes = read_bytes
        self.hwm: dict[tuple[str, int], int] = {}
        # Partitions that may have records to index (an ordered set): a round looks at these
        # only, not at every partition the store has. A round that catches one up takes it
        # out; an append puts it back.
        self._behind: dict[tuple[str, int], None] = {}
        self._targets: dict[str, dict[bytes | None, tuple[Queue, ...]]] = {}
        self._stamp = 0
        self._wake = asyncio.Event()
        self._more = False  # the last round stopped short of some partition's end
        self.idle = False  # the dispatch task waits for an append (on_append may index it)
        self.index_inline = False  # inside `index_write`: small appends are indexed after it
        self._inline_due = False  # an append of that write asked for the round
        self._held: Any = None  # WriteBatch of inline rounds not written yet (HOLD_S)
        self._held_since = 0.0
        self._held_timer: asyncio.TimerHandle | None = None
        self._held_queues: dict[Queue, None] = {}  # queues whose `buf` the held batch owes
        self._held_ckpts: dict[tuple[str, int], int] = {}  # checkpoints it owes
        self._round_waiters: list[asyncio.Future[None]] = []
        self._progress = 0  # what the last `_round` indexed plus positions advanced
        self.gated = False  # some queue has a rebuild gate: use the checked path
        self.records = 0  # records indexed since open
        self.corrupt_batches = 0  # batches skipped because their records do not decode
        self.failed: BaseException | None = None
        self.round_latency = LatencyHistogram()  # one observation per round that indexed

    # -- positions ---------------------------------------------------------------------------
    def position(self, topic: str, partition: int) -> int:
        """Next offset the dispatcher will index in this partition."""
        c = self.qdb.checkpoints.get((topic, partition))
        if c is not None:
            return c
        try:
            return int(self.store.log_start_offset(topic, partition))
        except UnknownTopicOrPartitionError:
            return 0

    def refresh(self) -> None:
        """Learn every partition's high watermark (at open; the listener keeps it current)."""
        for topic, n in self.store.topics().items():
            if is_system_topic(topic):
                continue
            for p in range(n):
                self.hwm[(topic, p)] = self.store.high_watermark(topic, p)
                self._behind[(topic, p)] = None

    def on_append(self, topic: str, partition: int, hwm: int) -> None:
        """Store append listener (event loop, right after the write).

        Inside `index_write` (the MQTT proxy's write of its tick's messages), a small append
        finding the dispatcher idle is indexed and its entries handed back in that call, in the pass
        of the loop that wrote it: a message that arrives alone crossed the loop once more for
        the task's wake-up (docs/performance-history.md). Other appends (Kafka produce: its
        response goes out before the round) and bigger ones wake the task, whose rounds yield
        to the loop between them."""
        if not is_system_topic(topic):
            self.hwm[(topic, partition)] = hwm
            self._behind[(topic, partition)] = None
            # idle and not woken: every other partition is caught up, so the round is small.
            if (
                self.index_inline
                and self.idle
                and not self._wake.is_set()
                and self.failed is None
                and hwm - self.position(topic, partition) <= SYNC_RECORDS
            ):
                self._inline_due = True  # one round once the write has told every partition
                return
            self._wake.set()

    def write_inline(self, write: Callable[[], None]) -> None:
        """`index_write`, its round handed to the sinks (pushes, then events) as the task's are."""
        rnd = self.index_write(write)
        if rnd is not None:
            if rnd.pushed and self.watch_sink is not None:
                self.watch_sink(rnd.pushed)
            if self.sink is not None:
                self.sink(rnd.events)
            self.round_done()

    def index_write(self, write: Callable[[], None]) -> InlineRound | None:
        """Run `write` (a store write ending a tick); then index its small appends in one round
        for every partition it wrote (a round per partition cost a tick of 100 publishers
        ~3 rounds and pumps: docs/performance-history.md) and return what that round pushed into
        which queues, for the caller to deliver and announce before `round_done`. None: nothing
        indexed here (a big write or a busy task: the task indexes it and uses the sinks). A
        failed round is logged; the task sees `failed` and ends, as if its own round failed."""
        self.index_inline = True
        try:
            write()
        finally:
            self.index_inline = False
        if not self._inline_due:
            return None
        self._inline_due = False
        if not self.idle or self._wake.is_set() or self.failed is not None:
            return None  # a bigger append of the same write woke the task: it indexes them all
        try:
            grown = self._round(None, None, True)
        except Exception:
            self._wake.set()
            log.exception("inline dispatch round failed")
            return None
        if self._more:
            self._wake.set()
        if grown is None:
            return None
        if not grown:
            self.round_done()
            return None
        return InlineRound(self._take_pushed(grown), [(q.name, q.next - 1) for q in grown])

    def round_done(self) -> None:
        """After an inline round's pushes and events: write the held rounds once HOLD_S old
        (after the delivery, which went out first), and wake `wait_round`'s waiters."""
        if self._held is not None and time.perf_counter() - self._held_since >= HOLD_S:
            self.write_held()
        waiters, self._round_waiters = self._round_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def behind(self) -> int:
        """Records appended but not indexed yet (lag)."""
        return sum(max(0, h - self.position(t, p)) for (t, p), h in self.hwm.items())

    def behind_by_topic(self) -> dict[str, int]:
        """Lag per log topic: log end minus checkpoint, summed over its partitions."""
        out: dict[str, int] = {}
        for (t, p), h in self.hwm.items():
            out[t] = out.get(t, 0) + max(0, h - self.position(t, p))
        return out

    def forget(self, topic: str) -> None:
        """A deleted log topic: nothing left to index there (checkpoints: `QueueDB.forget_topic`)."""
        for tp in [tp for tp in self.hwm if tp[0] == topic]:
            del self.hwm[tp]
            self._behind.pop(tp, None)
        self._targets.clear()

    def invalidate(self) -> None:
        """Forget cached targets (a filter queue appeared, went live, or was dropped)."""
        self._targets.clear()

    async def wait_round(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._round_waiters.append(fut)
        await fut

    # -- recovery ----------------------------------------------------------------------------
    def repair(self) -> dict[tuple[str, int], tuple[int, int]]:
        """Clamp checkpoints to the log (lightqueue.repair); {(topic, partition): (old, new)}."""
        return repair_checkpoints(self.qdb, self.store)

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Dispatch whenever the store appends; rounds until caught up, yielding between them."""
        while True:
            self.idle = True
            try:
                await self._wake.wait()
            finally:
                self.idle = False
            if self.failed is not None:
                return  # a round in on_append failed (logged there)
            self._wake.clear()
            # Another round only when this one left records behind (its budget, a read that
            # came back short); a caught-up round waits for the next append instead of one more
            # pass of the loop, which a message that arrives alone would pay every time.
            while self.dispatch_round() and self._more:
                await asyncio.sleep(0)

    def catch_up(self, limit: dict[tuple[str, int], int] | None = None) -> int:
        """Dispatch synchronously until nothing is left (tools, tests, rebuild)."""
        total = 0
        while True:
            n = self.dispatch_round(limit=limit)
            if not n:
                return total
            total += n

    def dispatch_round(
        self, limit: dict[tuple[str, int], int] | None = None, wb: Any = None
    ) -> int:
        """One WriteBatch worth of dispatch. Returns records indexed plus positions advanced
        (0 = caught up). `limit` caps each partition (rebuild); `wb` overrides the batch. A
        round of its own batch writes any held one with it, then pushes and announces."""
        grown = self._round(limit, wb, False)
        if grown is None:
            return 0
        if grown:
            if wb is None:
                # Watched queues get their new entries pushed first, then everyone the events,
                # so a reader woken by an event already has what it announces.
                pushed = self._take_pushed(grown)
                if pushed and self.watch_sink is not None:
                    self.watch_sink(pushed)
                if self.sink is not None:
                    self.sink([(q.name, q.next - 1) for q in grown])
            else:
                for q in grown:  # a caller's batch (rebuild): nothing is pushed from it
                    if q.watch:
                        q.watch = []
        waiters, self._round_waiters = self._round_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)
        return self._progress

    @staticmethod
    def _take_pushed(grown: list[Queue]) -> list[tuple[str, int, list[tuple[str, int, int]]]]:
        """The round's new entries of the watched queues among `grown`: (queue, first, entries)."""
        pushed = []
        for q in grown:
            w = q.watch
            if w:
                pushed.append((q.name, q.next - len(w), w))
                q.watch = []
        return pushed

    def _round(
        self, limit: dict[tuple[str, int], int] | None, wb: Any, hold: bool
    ) -> list[Queue] | None:
        """Index one round into `wb` (or the held / a new batch) and return the queues that
        grew (None: nothing to do); `self._progress` is what `dispatch_round` returns. `hold` (inline rounds) keeps
        the batch for the next rounds to join, up to HOLD_S."""
        qdb = self.qdb
        ckpts = qdb.checkpoints
        work = []
        position = self.position
        behind, hwm = self._behind, self.hwm
        # Only the partitions appended to since they were last caught up (rebuild's limited
        # rounds look at all): a store with 256 partitions made a lone message's round 4-6x
        # dearer (docs/performance-history.md).
        for tp in list(behind if limit is None else hwm):
            h = hwm.get(tp)
            c = 0 if h is None else position(*tp)
            if h is None or c >= h:
                behind.pop(tp, None)
                continue
            end = h if limit is None else min(h, limit.get(tp, 0))
            if c < end:
                end = min(end, self._stable(tp))  # an open transaction holds the rest back
                if c < end:
                    work.append((tp, end, c))
        if not work:
            self._more = False
            self._progress = 0
            return None
        t0 = time.perf_counter()
        work.sort()
        self._stamp += 1
        stamp = self._stamp
        grown: list[Queue] = []
        own_wb = wb is None
        if not own_wb and self._held is not None:
            self.write_held()  # a caller's batch (rebuild) comes after the held rounds
        if wb is None:
            wb = self._held if self._held is not None else qdb.raw.write_batch()
        share = max(self.batch_records // len(work), 256)
        progress = 0
        more = False
        advanced: list[tuple[str, int, int]] = []
        fresh = self._read_fresh
        for (t, p), end, c in work:
            c0, n = c, 0
            while n < share and c < end:
                try:
                    data = None if fresh is None else fresh(t, p, c)
                    if data is None:
                        data = self.store.read(t, p, c, self.read_bytes)
                except OffsetOutOfRangeError:
                    start = self.store.log_start_offset(t, p)
                    log.warning("%s-%d: records %d..%d deleted before indexing", t, p, c, start)
                    c = max(c, start)
                    if c >= end:
                        break
                    continue
                except FetchPending:
                    break  # cluster log: the fetch's append-listener call wakes us again
                if not data:
                    break
                c, k = self._index(t, p, data, c, end, share - n, wb, stamp, grown)
                n += k
            if c != c0:
                advanced.append((t, p, c))
                progress += n + 1
            if c < end:
                more = True
        if own_wb and hold:
            # Held: the queues keep gathering entries in `q.buf` and the checkpoints wait, so
            # the rounds of one held batch cost one block per queue and one checkpoint put
            # per partition, as one round would (LevelDB's cost is per key).
            hq, hc = self._held_queues, self._held_ckpts
            for q in grown:
                hq[q] = None  # a dict as an ordered set: a queue already held keeps its place
            for t, p, c in advanced:
                hc[(t, p)] = c
            if self._held is None:
                self._held, self._held_since = wb, t0
                qdb.pending_write = self.write_held
                loop = asyncio.get_running_loop()
                self._held_timer = loop.call_later(2 * HOLD_S, self._hold_expired)
        else:
            if wb is self._held:  # the held rounds go first, in this batch
                self._put_held(wb)
            put_blocks(grown, wb)
            self._put_checkpoints(wb, advanced)
            if own_wb:
                self._write(wb)
        for t, p, c in advanced:
            ckpts[(t, p)] = c
            if c >= hwm.get((t, p), 0):
                behind.pop((t, p), None)  # caught up: the next round need not look
        self._more = more
        self._progress = progress
        if advanced and own_wb:
            self.round_latency.observe(time.perf_counter() - t0)
        return grown

    def _put_checkpoints(self, wb: Any, advanced: list[tuple[str, int, int]]) -> None:
        qdb = self.qdb
        tids = qdb.topic_ids
        put = wb.put
        for t, p, c in advanced:
            put(checkpoint_key(tids[t] if t in tids else qdb.topic_id(t, wb), p), pack_u64(c))

    def _put_held(self, wb: Any) -> None:
        """The held rounds' blocks and checkpoints into `wb` (the held batch)."""
        hq, hc = self._held_queues, self._held_ckpts
        self._held_queues, self._held_ckpts = {}, {}
        put_blocks(list(hq), wb)
        self._put_checkpoints(wb, [(t, p, c) for (t, p), c in hc.items()])

    def _write(self, wb: Any) -> None:
        self._held = None
        self.qdb.pending_write = None
        if self._held_timer is not None:
            self._held_timer.cancel()
            self._held_timer = None
        try:
            wb.write()
        except Exception as e:  # the in-memory mirror is now ahead of the DB: stop
            self.failed = e
            log.critical("light-queue write failed, dispatcher stopped: %s", e)
            raise

    def write_held(self) -> None:
        """Write the rounds held back (QueueDB.db calls this before any other access)."""
        wb = self._held
        if wb is not None:
            try:
                self._put_held(wb)
                self._write(wb)
            except Exception:
                self._wake.set()  # the task sees `failed` and ends, as if its round failed
                raise

    def _hold_expired(self) -> None:
        self._held_timer = None
        with contextlib.suppress(Exception):  # logged by _write; the task ends
            self.write_held()

    def _stable(self, tp: tuple[str, int]) -> int:
        """The last stable offset: records of open Kafka transactions wait for their marker."""
        lso = self._lso
        if lso is None:  # a log without Kafka transactions
            return self.hwm.get(tp, 0)
        try:
            return int(lso(*tp))
        except UnknownTopicOrPartitionError:
            return 0

    def _index(
        self,
        t: str,
        p: int,
        data: bytes | bytearray,
        c: int,
        end: int,
        budget: int,
        wb: Any,
        stamp: int,
        grown: list[Queue],
    ) -> tuple[int, int]:
        """Index the records of `data` in [c, end), at most `budget` of them (whole batches
        unless the budget ends inside one); returns (new position, records indexed)."""
        tid = self.qdb.topic_id(t, wb)
        ehead = entry_head(tid, p)
        tcache = self._targets.get(t)
        if tcache is None or len(tcache) > _TARGET_CACHE_MAX:
            tcache = self._targets[t] = {}
        n = 0
        gated = self.gated
        derive = self.retained
        # log = "kafka": retained messages are derived from the records (the Python loop).
        keep = None if derive is None else (lambda r: self._retain(derive, t, p, r))
        aborted = self._aborted
        # Transaction markers and the records of aborted transactions are not delivered.
        walk = BatchWalk(
            data, c, end, skip_control=True, aborted=lambda pid, o: aborted(t, p, pid, o)
        )
        for h, pos, size in walk:
            base = h[BH_BASE_OFFSET]
            last = base + h[BH_LAST_OFFSET_DELTA]
            try:
                if h[BH_ATTRIBUTES] & COMPRESSION_MASK or keep is not None:
                    stop, n = _index_batch_py(
                        data, pos, size, base, c, end, n, budget, tcache,
                        lambda key: self._targets_for(t, key, wb), ehead, stamp, grown,
                        (tid, p) if gated else None, t, p, keep,
                    )  # fmt: skip
                else:
                    stop, n = _index_batch(
                        data, pos, size, base, c, end, n, budget, tcache,
                        lambda key: self._targets_for(t, key, wb), ehead, stamp, grown,
                        (tid, p) if gated else None, t, p,
                    )  # fmt: skip
            except (InvalidRecordError, ValueError) as exc:
                # A batch nobody can decode (garbled records under a valid CRC, a broken
                # compressed block): skip it, or it would stop dispatch for good.
                self.corrupt_batches += 1
                log.error("%s-%d: batch at offsets %d..%d cannot be decoded, not indexed: %s",
                          t, p, base, last, exc)  # fmt: skip
                continue
            if stop >= 0:
                self.records += n
                return stop, n
        self.records += n
        return walk.next_offset, n

    @staticmethod
    def _retain(retained: Any, t: str, p: int, r: Any) -> None:
        """A record published with MQTT's retain flag: it is now the topic's retained message
        (an empty payload clears it), wherever on the cluster it was published."""
        v = mqtt_view(t, r.key, list(r.headers))
        if v.retain:
            retained.set(v.topic, r.value or b"", v.qos, v.client_id, v.properties, r.timestamp,
                         (t, p, r.offset))  # fmt: skip

    def _targets_for(self, t: str, key: bytes | None, wb: Any) -> tuple[Queue, ...]:
        topic = mqtt_topic_of(t, key)
        q = self.qdb.queues.get(topic)
        if q is None:
            q = self.qdb.new_queue(topic, KIND_EXACT, wb)
        if t == PROBE_TOPIC:
            return (q,)
        return (q, *(f for f in self.trie.match(topic) if f.live))
