"""Delivery: light queue → connections, pulled on notify events, encoded once, written to many.

Theory of operation
-------------------
Each queue with local subscribers has a `QueueState`: the online subscriptions reading it, the
shared groups reading it, the highest sequence notify told us about, and a cache of recent
resolved messages (`CachedMsg`) shared by every local subscriber of the queue. A notify event (or a
subscriber becoming writable, or an ack opening its window) marks the queue dirty; one
`call_soon` per loop tick pumps every dirty queue.

Pumping a queue:
1. QoS 0 subscribers with no per-subscriber filtering (no overlap, no no-local) are grouped into
   cohorts by (position, protocol version, retain-as-published, subscription id, topic alias
   maximum). A cohort's PUBLISH bytes for the whole range are joined once and the same `bytes`
   object is written to each member's transport: encode once, write many. With server-assigned
   topic aliases (topic_aliases.py) the run is encoded once with the aliases, and a member that
   does not know one of them yet gets its own copy of that run instead (cohorts.py).
2. Everything else (QoS 1/2, overlap, no-local) goes message by message, still sharing each
   message's template per (QoS, retain, version, subscription ids); only the packet id is patched.
3. Shared groups hand each message to one member with room (round robin; shared_groups.py).
With an acl_file, a subscription whose filter reaches topics its client may not read (a deny
inside it, or a read rule narrower than it) leaves the cohorts and checks each message
(`ClientAcl.can_read`, cached per topic); without one, `conn.acl` is None and nothing is checked.
A subscriber whose transport is paused (`pause_writing`) or whose in-flight window is full is
skipped and resumed by `resume_writing` / the ack that frees its window.

Positions: `sub.pos` is the next sequence to read; QoS 0 advances it on write, QoS 1/2 leaves the
sequence in `sub.pending` until the ack, and the stored position is the acked prefix
(`Subscription.acked_pos`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from lightqueue.model import ReadResult
from mqtt_proxy.codec import publish_v3_qos1
from mqtt_proxy.delivery.cohorts import CohortPump
from mqtt_proxy.delivery.overlap import overlap_owner
from mqtt_proxy.delivery.qos1_run import qos1_run
from mqtt_proxy.delivery.queue_cache import (
    PUMP_BATCHES,
    RAW_TYPES,
    CachedMsg,
    QueueState,
    cached,
    cached_end,
    evict_oldest,
    fill_cache,
    pushed_from,
)
from mqtt_proxy.delivery.shared_groups import GroupDelivery, SharedGroup
from mqtt_proxy.delivery.topic_aliases import AliasBook
from mqtt_proxy.ports import Entries, Message, PeerPort, QueuesPort
from mqtt_proxy.sessions.state import Inflight, Session, Subscription
from mqtt_proxy.settings import ProxySettings
from store.latency import LatencyHistogram
from store.mapping import PROBE_TOPIC, SYSTEM_TOPIC_PREFIX

if TYPE_CHECKING:
    from mqtt_proxy.ports import LeasesPort

log = logging.getLogger("lightgate.mqtt.delivery")

INTERNAL_TOPIC_PREFIX = SYSTEM_TOPIC_PREFIX
PROBE_PREFIX = PROBE_TOPIC + "/"  # the gateway's latency probes: delivered (exact topic only)
SLOW_AFTER_S = 0.1  # a subscriber whose socket stays full this long is a slow consumer
PUSHED_MAX = 1 << 17  # pushed entries kept per queue for readers behind the head


class Delivery:
    """Pull-side delivery for one proxy. Event-loop-only."""

    def __init__(
        self,
        reader: QueuesPort,
        settings: ProxySettings,
        stats: dict[str, int],
        on_interest: Callable[[str, bool], None],
    ) -> None:
        self._reader = reader  # a Backend: load(queue, from_seq, max_n, done)
        self._batch = settings.read_batch
        self._cache_max = settings.cache_per_queue
        self._stats = stats
        # Broker receive → PUBLISH written, per delivered copy (ms resolution: the stored
        # timestamp); observed in the pump loops, one bisect per message per cohort.
        self.deliver_latency = LatencyHistogram()
        self._on_interest = on_interest
        # Outbound topic aliases (topic_aliases.py): one numbering for every connection here.
        self.aliases = AliasBook(settings.max_topic_alias_out)
        self.queues: dict[str, QueueState] = {}
        self._dirty: set[QueueState] = set()
        self._scheduled = False
        # Per queue: messages still owed to *writable* readers after the last pump (CPU-bound
        # lag, not slow consumers). Inbound throttles publishers on its maximum.
        self.lag: dict[str, int] = {}
        self._loop = asyncio.get_running_loop()
        # Several proxies: `$share` groups take leases from the core (mqtt_proxy.backends.cluster).
        self.leases: LeasesPort | None = None
        self._cohorts = CohortPump(self.read_range, self.deliver_latency, self.aliases)
        self._groups = GroupDelivery(self, self._batch)

    # -- membership ------------------------------------------------------------------------
    def attach(self, sub: Subscription) -> None:
        qs = self.queues.get(sub.queue)
        if qs is None:
            qs = self.queues[sub.queue] = QueueState(sub.queue)
            self._on_interest(sub.queue, True)
        group = sub.spec.share_group
        if group is None:
            qs.subs[sub] = None
        else:
            key = f"{group}/{sub.queue}"
            g = qs.groups.get(key)
            if g is None:
                g = qs.groups[key] = SharedGroup(key, sub.queue, pos=sub.pos)
                if self.leases is not None:
                    g.lease = []
            g.members.append(sub)
        self.mark(qs)

    def detach(self, sub: Subscription) -> None:
        qs = self.queues.get(sub.queue)
        if qs is None:
            return
        group = sub.spec.share_group
        if group is None:
            qs.subs.pop(sub, None)
        else:
            g = qs.groups.get(f"{group}/{sub.queue}")
            if g is not None:
                self._groups.leave(qs, g, sub)
        if not qs.subs and not qs.groups:
            del self.queues[sub.queue]
            self.lag.pop(sub.queue, None)
            self._dirty.discard(qs)
            if qs.retry is not None:
                qs.retry.cancel()
            self._on_interest(sub.queue, False)

    def group_of(self, sub: Subscription) -> SharedGroup | None:
        return self.group(sub.spec.share_group, sub.queue)

    def group(self, share_group: str | None, queue: str) -> SharedGroup | None:
        qs = self.queues.get(queue)
        if qs is None or share_group is None:
            return None
        return qs.groups.get(f"{share_group}/{queue}")

    # -- scheduling ------------------------------------------------------------------------
    def on_round(self, pushed: Sequence[tuple[str, int, Entries]]) -> None:
        """A dispatch round in this process pushed these entries: deliver them now, in the same
        pass of the event loop, instead of one more pass later (a message that arrives alone
        crosses the loop several times; docs/performance-history.md)."""
        for queue, first, entries in pushed:
            self._add_entries(queue, first, entries)
        if self._dirty and not self._scheduled:
            self._run()

    def on_entries(self, queue: str, first: int, entries: Entries) -> None:
        """A dispatch round's new entries of a queue read here (pushed, see LightQueues.watch)."""
        qs = self._add_entries(queue, first, entries)
        if qs is not None:
            self.mark(qs)

    def _add_entries(self, queue: str, first: int, entries: Entries) -> QueueState | None:
        qs = self.queues.get(queue)
        if qs is None or not entries:
            return None
        qs.pushed.append((first, entries))
        qs.pushed_n += len(entries)
        while qs.pushed_n > PUSHED_MAX and len(qs.pushed) > 1:
            qs.pushed_n -= len(qs.pushed.popleft()[1])  # readers that far behind read instead
        last = first + len(entries) - 1
        if last > qs.last_seq:
            qs.last_seq = last
        self._dirty.add(qs)
        return qs

    def on_event(self, queue: str, last_seq: int) -> None:
        """Notify says `queue` reached `last_seq`. Only news marks it: in one process a round's
        entries were already pushed and pumped (`on_round`) before its event arrives, and the
        event's pump found nothing, one more pass of the loop per round (per message at low
        rates). Readers held for other reasons are woken by their own cause (ack, writable,
        load answer, lease)."""
        qs = self.queues.get(queue)
        if qs is None:
            return
        if last_seq > qs.last_seq:
            qs.last_seq = last_seq
            self.mark(qs)

    def knows(self, queue: str, last_seq: int) -> bool:
        """`on_event(queue, last_seq)` would do nothing: the notifier need not send it."""
        qs = self.queues.get(queue)
        return qs is None or last_seq <= qs.last_seq

    def mark(self, qs: QueueState) -> None:
        self._dirty.add(qs)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self._run)

    def mark_session(self, session: Session) -> None:
        """The session can take more (acks freed its window, its socket drained). A caught-up
        subscription is not marked: its pump would find nothing (`read_range` reads nothing
        past `last_seq`), and a caught-up QoS 1 reader's every PUBACK cost a pump that found
        nothing. A `$share` member is always marked: acks credit its group."""
        if session.feeds:  # retained messages waiting for room go first
            for feed in session.feeds[:]:
                feed.pump()
        for sub in session.subs.values():
            if sub.local:
                continue
            qs = self.queues.get(sub.queue)
            if qs is not None and (sub.pos <= qs.last_seq or sub.spec.share_group is not None):
                self.mark(qs)

    def _run(self) -> None:
        self._scheduled = False
        dirty, self._dirty = self._dirty, set()
        for qs in dirty:
            if qs.name in self.queues:
                try:
                    self._pump(qs)
                except Exception:
                    log.exception("delivery failed on queue %s", qs.name)

    # -- reading -------------------------------------------------------------------------
    def load(self, qs: QueueState, from_seq: int) -> int | None:
        """Ask for a batch from `from_seq`. Returns the first valid sequence (> from_seq when
        retention trimmed the queue) when the answer came within the call (in-process backend);
        None while it is on its way (core link): the answer re-marks the queue."""
        if qs.loading:
            return None
        qs.loading = 1
        done = lambda res, msgs: self._loaded(qs, from_seq, res, msgs)  # noqa: E731
        entries = pushed_from(qs, from_seq, self._batch)
        if entries is not None:
            self._reader.load_entries(qs.name, from_seq, entries, done)
        else:
            self._reader.load(qs.name, from_seq, self._batch, done)
        if not qs.loading:
            return qs.loaded_start
        qs.loading = 2
        return None

    def _loaded(
        self,
        qs: QueueState,
        from_seq: int,
        res: ReadResult | None,
        msgs: list[Message | None] | None,
    ) -> None:
        was_waiting = qs.loading == 2
        qs.loading = 0
        qs.loaded_start = from_seq
        live = self.queues.get(qs.name) is qs
        if res is None or msgs is None:  # the backend failed (logged there): try again later
            if live and qs.retry is None:
                qs.retry = self._loop.call_later(0.5, self._retry, qs)
            return
        start = max(from_seq, res.start_seq)
        qs.loaded_start = start
        if res.start_seq > qs.floor:
            qs.floor = res.start_seq
        if msgs:
            cache = qs.cache
            fill_cache(
                CachedMsg, msgs, cache, start, INTERNAL_TOPIC_PREFIX, PROBE_PREFIX, RAW_TYPES
            )
            over = len(cache) - self._cache_max
            if over > 0:
                evict_oldest(cache, over, start)
        if res.next_seq > qs.read_end:
            qs.read_end = res.next_seq
        if res.next_seq - 1 > qs.last_seq:
            qs.last_seq = res.next_seq - 1
        if was_waiting and live:
            self.mark(qs)

    def _retry(self, qs: QueueState) -> None:
        qs.retry = None
        if self.queues.get(qs.name) is qs:
            self.mark(qs)

    def read_range(self, qs: QueueState, pos: int) -> tuple[int, int]:
        """Messages cached from `pos`: (first valid seq, end exclusive); start == end when there
        is nothing yet (caught up, or a load is on its way)."""
        if pos < qs.floor:
            pos = qs.floor
        cache = qs.cache
        if pos not in cache:
            if pos >= qs.read_end and pos > qs.last_seq:
                return pos, pos
            start = self.load(qs, pos)
            if start is None:
                return pos, pos
            pos = start
        return pos, cached_end(cache, pos, pos + self._batch)

    # -- pumping -------------------------------------------------------------------------
    def _pump(self, qs: QueueState) -> None:
        """Deliver what is new on `qs`, at most PUMP_BATCHES reads per reader per tick; a reader
        with more to go re-marks the queue for the next tick, so a deep backlog never holds the
        loop (ingest, dispatch and other queues get their turn in between)."""
        now_ms = int(time.time() * 1000)
        more = False
        cohorts: dict[tuple[int, bool, bool, int | None, int], list[Subscription]] = {}
        for sub in tuple(qs.subs):  # a copy: a detach from inside the loop must not break it
            conn = sub.session.conn
            if conn is None or not conn.writable or sub.held:
                continue
            acl = conn.acl  # None without an acl_file: no per-message cost
            if acl is not None and sub.acl_of is not acl:
                sub.acl_of = acl
                sub.acl_check = None if acl.reads_all(sub.spec.filter) else acl
            if (
                sub.qos == 0
                and not sub.no_local
                and not conn.session_overlap
                and not conn.max_out_packet
                and (acl is None or sub.acl_check is None)
            ):
                oa = conn.out_aliases
                amax = 0 if oa is None else oa.maximum
                key = (sub.pos, conn.v5, sub.retain_as_published, sub.sub_id, amax)
                cohort = cohorts.get(key)
                if cohort is None:
                    cohorts[key] = [sub]
                else:
                    cohort.append(sub)
            else:
                more |= self._pump_one(qs, sub, conn, now_ms)
        pump = self._cohorts
        for (pos, v5, rap, sid, amax), subs in cohorts.items():
            if amax:
                more |= pump.aliased(qs, subs, pos, rap, sid, amax, now_ms)
            else:
                more |= pump.plain(qs, subs, pos, v5, rap, sid, now_ms)
        groups = self._groups
        for g in list(qs.groups.values()):
            more |= groups.pump(qs, g, now_ms)
        if qs.cache or qs.pushed:
            self._trim(qs)
        if more:
            self.mark(qs)
        self._measure_lag(qs)

    def _measure_lag(self, qs: QueueState) -> None:
        """What this queue owes readers that can take it now (`lag`, which throttles ingest):
        writable ones, and ones whose socket filled less than SLOW_AFTER_S ago (a fast reader
        that reads in bursts). A reader paused for longer, or one whose QoS 1/2 window is full
        of unacknowledged messages, is consumer-bound: it catches up from its light queue
        later and never holds publishers back."""
        low = None
        recent_pause = self._loop.time() - SLOW_AFTER_S
        for s in qs.subs:
            c = s.session.conn
            if c is None or s.held or (not c.writable and c.paused_since < recent_pause):
                continue
            if s.qos and len(s.session.inflight) >= c.out_window:
                continue  # waits for its own acks: the consumer, not the CPU, sets its pace
            if low is None or s.pos < low:
                low = s.pos
        for g in qs.groups.values():
            if low is None or g.pos < low:
                low = g.pos
        behind = 0 if low is None else qs.last_seq + 1 - low
        if behind > 0:
            self.lag[qs.name] = behind
        elif qs.name in self.lag:
            del self.lag[qs.name]

    def _trim(self, qs: QueueState) -> None:
        low = min((s.pos for s in qs.subs), default=qs.read_end)
        for g in qs.groups.values():
            low = min(low, g.acked_pos())
        pushed = qs.pushed
        while pushed and pushed[0][0] + len(pushed[0][1]) <= low:
            qs.pushed_n -= len(pushed.popleft()[1])
        cache = qs.cache
        if cache and next(iter(cache)) < low:
            # Every key below `low`, wherever inserted (loads of other ranges interleave): the
            # compiled eviction scan over the whole cache (a list comprehension here was ~1.7 %
            # of a QoS 1 fan-in, run at each pump of a lagging reader).
            evict_oldest(cache, len(cache), low)

    def _pump_one(self, qs: QueueState, sub: Subscription, conn: PeerPort, now_ms: int) -> bool:
        session = sub.session
        v5 = conn.v5
        check = sub.acl_check if conn.acl is not None else None
        oa = conn.out_aliases
        out: list[bytes] = []
        nbytes = 0
        more = False
        observe = self.deliver_latency.observe_ms
        ts = ts_n = 0
        # A 3.1.1 QoS 1 reader: its QoS 1 messages go through `qos1_run` (compiled).
        run1 = not v5 and sub.qos and check is None and not conn.session_overlap
        for _ in range(PUMP_BATCHES):
            if not conn.writable:
                break
            start, end = self.read_range(qs, sub.pos)
            if start >= end:
                sub.pos = start
                break
            cache = qs.cache
            seq = start
            blocked = False
            while seq < end:
                if run1:
                    seq, session.next_pid, n1, blocked = qos1_run(
                        cache, seq, end, sub.pending, session.inflight,
                        conn.out_window - len(session.inflight), session.next_pid, now_ms,
                        qs.name, sub.spec.raw, Inflight, observe, out, sub.qos,
                        sub.retain_as_published,
                    )  # fmt: skip
                    if n1:
                        nbytes += n1
                        session.dirty = True
                    if blocked or seq >= end:
                        break
                m = cached(cache, seq)
                if m is None or seq in sub.pending or m.expired(now_ms):
                    seq += 1
                    continue
                if sub.no_local and m.client_id == session.client_id:
                    seq += 1
                    continue
                if check is not None and not check.can_read(m.topic):
                    seq += 1  # a topic this client may not read (acl_file): skipped
                    continue
                qos = m.qos if m.qos < sub.qos else sub.qos
                sub_ids: tuple[int, ...] = (sub.sub_id,) if (v5 and sub.sub_id) else ()
                if conn.session_overlap:
                    decision = overlap_owner(session, sub, m)
                    if decision is None:
                        seq += 1
                        continue
                    qos = m.qos if m.qos < decision[0] else decision[0]
                    sub_ids = decision[1] if v5 else ()
                if qos and len(session.inflight) >= conn.out_window:
                    blocked = True
                    break
                retain = m.retain and sub.retain_as_published
                if qos == 1 and not v5 and not retain:
                    # 3.1.1 has no properties, aliases or size limit: no template to build (a
                    # QoS 1 reader catching up gets one packet per message, each its own id).
                    pid = session.alloc_pid()
                    data = full = publish_v3_qos1(m.topic, m.payload, pid)
                else:
                    tpl = m.template(qos, retain, v5, sub_ids, now_ms)
                    if conn.max_out_packet and tpl.size > conn.max_out_packet:
                        # MQTT 5 §3.1.2.11.4: too large for this client: discard as if delivered.
                        seq += 1
                        continue
                    pid = session.alloc_pid() if qos else 0
                    full = tpl.packet(pid) if qos else tpl.data
                    data = full if oa is None else oa.packet(m.topic, tpl, pid, full)
                if qos:  # the full topic, not the alias: what a reconnect resends
                    session.inflight[pid] = Inflight(qs.name, seq, qos, full, False, sub.spec.raw)
                    sub.pending[seq] = pid
                    session.dirty = True
                out.append(data)
                nbytes += len(data)
                if m.ts_ms == ts:  # one observation per run of equal receive times
                    ts_n += 1
                else:
                    if ts_n:
                        observe(now_ms - ts, ts_n)
                    ts, ts_n = m.ts_ms, 1
                seq += 1
            sub.pos = seq
            if blocked:
                break
        else:
            more = True
        if ts_n:
            observe(now_ms - ts, ts_n)
        if out:
            conn.write_delivery(b"".join(out), len(out), nbytes)
        return more

    # -- acks ------------------------------------------------------------------------------
    def acked(self, session: Session, inf: Inflight) -> None:
        """An outbound QoS 1/2 message completed: credit its subscription or group."""
        self.acked_many(session, (inf,))

    def acked_many(self, session: Session, infs: Sequence[Inflight]) -> None:
        """Outbound QoS 1/2 messages completed (a read chunk's PUBACKs in one call: a lagging
        QoS 1 reader of a fan-in acks ~60k/s): credit each one's subscription or group."""
        subs = session.subs
        credited = False
        for inf in infs:
            sub = subs.get(inf.filter_raw)
            if sub is None or inf.seq < 0:
                continue
            credited = True
            if sub.spec.share_group is None:
                sub.pending.pop(inf.seq, None)
                continue
            g = self.group_of(sub)
            if g is not None and g.pending.pop(inf.seq, None) is not None and g.lease is not None:
                assert self.leases is not None  # a group holds a lease only with several proxies
                self.leases.done(g.key, inf.seq)
        if credited:
            session.dirty = True
