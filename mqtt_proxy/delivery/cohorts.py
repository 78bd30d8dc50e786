"""QoS 0 cohorts: encode once, write many. Subscribers of one queue at the same position with the
same protocol version, retain-as-published, subscription id and topic alias maximum (grouped by
`Delivery._pump`) take each run of messages as one joined `bytes` object, the same one written to
every member's transport. With server-assigned topic aliases (topic_aliases.py) the run is
encoded once with the aliases, and a member that does not know one of them yet gets its own copy
of that run, with the topic names it has to learn."""

from __future__ import annotations

from collections.abc import Callable

from mqtt_proxy.codec import publish_qos0
from mqtt_proxy.delivery.queue_cache import PUMP_BATCHES, Cached, CachedMsg, QueueState, cached
from mqtt_proxy.delivery.topic_aliases import AliasBook, OutAliases
from mqtt_proxy.ports import PeerPort
from mqtt_proxy.sessions.state import Subscription
from store.latency import LatencyHistogram
from store.twins import twin

ReadRange = Callable[[QueueState, int], tuple[int, int]]


class CohortPump:
    """The cohort loops of one `Delivery`: `read_range` is its reads (cached messages from a
    position), `latency` its receive-to-write histogram, `aliases` its topic alias numbering."""

    __slots__ = ("_range", "deliver_latency", "aliases")

    def __init__(
        self, read_range: ReadRange, latency: LatencyHistogram, aliases: AliasBook
    ) -> None:
        self._range = read_range
        self.deliver_latency = latency
        self.aliases = aliases

    def plain(
        self,
        qs: QueueState,
        subs: list[Subscription],
        pos: int,
        v5: bool,
        rap: bool,
        sid: int | None,
        now_ms: int,
    ) -> bool:
        """Members without topic aliases: one run of PUBLISH bytes for all of them."""
        sub_ids = (sid,) if (v5 and sid) else ()
        observe = self.deliver_latency.observe_ms
        for _ in range(PUMP_BATCHES):
            start, end = self._range(qs, pos)
            if start >= end:
                if start != pos:
                    for sub in subs:
                        sub.pos = start
                return False
            data, n = qos0_run(
                qs.cache, start, end, now_ms, v5, sub_ids, rap, observe, len(subs), cached
            )
            if data is not None:
                nbytes = len(data)
                still = []
                for sub in subs:
                    conn = sub.session.conn
                    assert conn is not None  # a cohort holds connected subscribers only
                    conn.write_delivery(data, n, nbytes)
                    sub.pos = end
                    if conn.writable:
                        still.append(sub)
                subs = still
            else:
                for sub in subs:
                    sub.pos = end
            pos = end
            if not subs:
                return False
        return True

    def aliased(
        self,
        qs: QueueState,
        subs: list[Subscription],
        pos: int,
        rap: bool,
        sid: int | None,
        amax: int,
        now_ms: int,
    ) -> bool:
        """`plain` for v5 members using topic aliases up to `amax`: each run is encoded
        once with empty topics and aliases; members that map every alias of the run (the
        steady state) share it, the others get their own copy carrying the topic names they
        have to learn (topic_aliases.py)."""
        sub_ids = (sid,) if sid else ()
        observe = self.deliver_latency.observe_ms
        lookup = self.aliases.lookup
        for _ in range(PUMP_BATCHES):
            start, end = self._range(qs, pos)
            if start >= end:
                if start != pos:
                    for sub in subs:
                        sub.pos = start
                return False
            chunks = []
            plan: list[tuple[CachedMsg, int]] = []  # (message, alias or 0) per chunk
            used: dict[int, str] = {}  # alias -> topic in this run
            mixed = False  # one alias named two topics in this run (the book moved it)
            cache = qs.cache
            nsubs = len(subs)
            ts0, same = 0, 0  # as in `qos0_run_py`: one observation per run of equal timestamps
            for seq in range(start, end):
                m = cached(cache, seq)
                if m is None:
                    continue
                exp = m.expire_at_ms
                if exp is not None and now_ms >= exp:
                    continue
                retain = m.retain and rap
                a = lookup(m.topic)
                if a and a <= amax:
                    if used.setdefault(a, m.topic) != m.topic:
                        mixed = True
                    chunks.append(m.qos0_alias(a, False, retain, sub_ids, now_ms))
                else:
                    a = 0
                    chunks.append(m.qos0(retain, True, sub_ids, now_ms))
                plan.append((m, a))
                ts = m.ts_ms
                if ts != ts0:
                    if same:
                        observe(now_ms - ts0, same * nsubs)
                    ts0, same = ts, 0
                same += 1
            if same:
                observe(now_ms - ts0, same * nsubs)
            n = len(chunks)
            if n:
                data = b"".join(chunks)
                still = []
                for sub in subs:
                    # Cohort members are connected and use aliases (checked in Delivery._pump).
                    conn: PeerPort = sub.session.conn  # type: ignore[assignment]
                    oa: OutAliases = conn.out_aliases  # type: ignore[assignment]
                    if not mixed and oa.knows(used):
                        conn.write_delivery(data, n, len(data))
                    else:
                        own = learn(plan, chunks, oa.sent, rap, sub_ids, now_ms)
                        conn.write_delivery(own, n, len(own))
                    sub.pos = end
                    if conn.writable:
                        still.append(sub)
                subs = still
            else:
                for sub in subs:
                    sub.pos = end
            pos = end
            if not subs:
                return False
        return True


def learn(
    plan: list[tuple[CachedMsg, int]],
    chunks: list[bytes],
    sent: dict[int, str],
    rap: bool,
    sub_ids: tuple[int, ...],
    now_ms: int,
) -> bytes:
    """One member's copy of an aliased run: the first use of an alias it does not map to that
    topic yet carries the topic name (and updates `sent`); the rest are the shared chunks."""
    out = []
    for (m, a), chunk in zip(plan, chunks, strict=True):
        if a and sent.get(a) != m.topic:
            sent[a] = m.topic
            chunk = m.qos0_alias(a, True, m.retain and rap, sub_ids, now_ms)
        out.append(chunk)
    return b"".join(out)


def qos0_run_py(
    cache: dict[int, Cached],
    start: int,
    end: int,
    now_ms: int,
    v5: bool,
    sub_ids: tuple[int, ...],
    rap: bool,
    observe: Callable[[int, int], None],
    nsubs: int,
    upgrade: Callable[[dict[int, Cached], int], CachedMsg | None],
) -> tuple[bytes | None, int]:
    """(the QoS 0 PUBLISH packets of cache[start:end] joined, their count), or (None, 0).
    Messages of one receive tick share a timestamp: the receive-to-write latency is observed
    once per run of them (times `nsubs`). A raw message (queue_cache.RAW_TYPES) is encoded as
    it is, or made a CachedMsg by `upgrade` where it needs one. Twin of `_ccohorts.qos0_run`."""
    chunks = []
    ts0, same = 0, 0
    for seq in range(start, end):
        m = cache[seq]
        if m is None:
            continue
        if not isinstance(m, CachedMsg):  # raw: no properties, so no expiry
            ts = m.timestamp_ms
            if sub_ids or type(m.payload) is not bytes:
                c = upgrade(cache, seq)
                assert c is not None
                d = c.qos0(c.retain and rap, v5, sub_ids, now_ms)
            else:
                d = publish_qos0(m.topic, m.payload, m.retain and rap, v5)
        else:
            exp = m.expire_at_ms
            if exp is not None and now_ms >= exp:
                continue
            d0 = m.data0  # the 3.1.1 plain QoS 0 packet, once built (CachedMsg.qos0)
            if d0 is None or v5 or sub_ids or (rap and m.retain):
                d0 = m.qos0(m.retain and rap, v5, sub_ids, now_ms)
            d = d0
            ts = m.ts_ms
        chunks.append(d)
        if ts != ts0:
            if same:
                observe(now_ms - ts0, same * nsubs)
            ts0, same = ts, 0
        same += 1
    if same:
        observe(now_ms - ts0, same * nsubs)
    if not chunks:
        return None, 0
    return b"".join(chunks), len(chunks)


qos0_run = twin(
    qos0_run_py,
    "mqtt_proxy.delivery._ccohorts",
    "qos0_run",
    what="a QoS 0 cohort's PUBLISH run in one buffer",
)
