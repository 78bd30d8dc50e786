"""Inbound PUBLISH → store, batched per event-loop tick; acks only once the batch is durable.

Back-pressure: publishers cannot outrun the dispatcher that indexes what they publish. When the
records this proxy appended minus those the dispatcher indexed pass `LAG_HIGH`, every connection
that delivers more data is paused (`pause_reading`) until the lag is back under `LAG_LOW`. (Our
own count, not `Dispatcher.behind()`: that one trails the store's per-tick writes and read
~10k while 240k records were waiting.) The same pause applies while delivery owes more than
`LAG_HIGH` messages to subscribers that can take them (`Delivery.lag`): then the CPU, not the
consumer, is the limit, and a backlog past the recent-append cache makes every message cost a
store read and a batch parse (measured: 43 % of the loop in `LightQueues.resolve`). Slow
consumers (unwritable sockets) do not count: they read from their light queue later. Without this, ingest on the shared event
loop starves dispatch and delivery: measured with mqttbench fan-in (10 publishers, QoS 0), the lag
grew by ~100k records/s and subscribers got 1 % of the messages while the flood lasted.

Every PUBLISH parsed in one loop iteration (across all connections) goes into one
`store.append_mqtt` call, so the store builds one RecordBatch per partition and group-commits one
fsync for all of them. PUBACK / PUBREC wait for `AppendResult.durable` (DEVELOPERS.md:
acknowledged means durable); QoS 0 publishes are fire-and-forget and never wait.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from store.mapping import MqttMessage

if TYPE_CHECKING:
    from mqtt_proxy.ports import ClientPort, QueuesPort
    from mqtt_proxy.sessions.manager import SessionManager
    from mqtt_proxy.sessions.state import Session
    from store.latency import LatencyHistogram

# (connection, packet ids, ack packet type): a read chunk's QoS 1 ids in one run
Ack = tuple["ClientPort", list[int], int]

log = logging.getLogger("lightgate.mqtt.inbound")

PUBACK, PUBREC = 4, 5
LAG_HIGH = 20_000  # records appended but not yet indexed: pause publishers above this
LAG_LOW = 5_000  # ... and resume them below this
TICK_MAX = 10_000  # messages parsed in one tick before publishers are paused as well


class Inbound:
    __slots__ = (
        "_backend",
        "_lag",
        "_latency",
        "sessions",
        "_msgs",
        "_acks",
        "_retained",
        "_scheduled",
        "inflight",
        "_futs",
        "_loop",
        "throttled",
        "_paused",
        "appended",
        "_indexed0",
        "_gather",
    )

    def __init__(
        self,
        backend: QueuesPort,
        lag: dict[str, int],
        puback_latency: LatencyHistogram,
        gather_ms: int = 0,
    ) -> None:
        """`lag`: delivery's lag per queue (read, never written here); `puback_latency`: the
        receive -> PUBACK histogram; `gather_ms`: how long a round waits for more PUBLISHes. `sessions` (the registry, which writes a persistent
        session's QoS 2 ids before their PUBREC) is set by the server once it exists: the
        registry publishes wills through this object, so each needs the other."""
        self._backend = backend
        self._lag = lag
        self._latency = puback_latency
        self.sessions: SessionManager | None = None
        self._msgs: list[MqttMessage] = []
        self._acks: list[Ack] = []
        self._retained: list[int] = []  # indexes into _msgs of retain=1 publishes
        self._scheduled = False
        self.inflight = 0  # appended batches whose `durable` has not resolved yet
        self._futs: set[asyncio.Future[None]] = set()
        self._loop = asyncio.get_running_loop()
        self.throttled = False  # dispatcher lag above LAG_HIGH: publishers are being paused
        self._paused: list[ClientPort] = []
        self.appended = 0  # records this proxy appended
        self._indexed0 = backend.indexed()
        # publish_gather_ms: wait for more PUBLISHes before the round (0: end of this pass)
        self._gather = gather_ms / 1000

    def add(
        self, msg: MqttMessage, conn: ClientPort | None = None, pid: int = 0, qos: int = 0
    ) -> None:
        """Queue one message for this tick's append; `conn`/`pid` get the ack when durable."""
        msgs = self._msgs
        if msg.retain:
            self._retained.append(len(msgs))
        msgs.append(msg)
        if len(msgs) == TICK_MAX and not self.throttled:
            # One loop tick can read megabytes from many sockets: stop reading more before
            # this tick alone outruns what dispatch and delivery can absorb.
            self.throttled = True
            self._loop.call_later(0.001, self._check_lag)
        if qos:
            assert conn is not None  # only the broker's own messages (wills) have none: QoS 0
            self._acks.append((conn, [pid], PUBACK if qos == 1 else PUBREC))
        if not self._scheduled:
            self._schedule()

    def add_many(self, msgs: list[MqttMessage], conn: ClientPort, pids: list[int]) -> None:
        """`add` for one read chunk of `conn`: `pids` are its QoS 1 messages' packet ids, in order
        (PUBACK when durable). Not retained, not QoS 2 (those go through `add`)."""
        mine = self._msgs
        mine += msgs
        if not self.throttled and len(mine) >= TICK_MAX:
            self.throttled = True  # as in `add`: this tick alone read enough
            self._loop.call_later(0.001, self._check_lag)
        if pids:
            self._acks.append((conn, pids, PUBACK))
        if not self._scheduled:
            self._schedule()

    def _schedule(self) -> None:
        self._scheduled = True
        if self._gather:
            self._loop.call_later(self._gather, self.flush)
        else:
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        self._scheduled = False
        msgs = self._msgs
        if not msgs:
            return
        acks, retained = self._acks, self._retained
        self._msgs, self._acks, self._retained = [], [], []
        writes: list[asyncio.Future[bytes]] = []  # retained-message writes the acks wait for
        acked = None
        if acks:
            t0 = self._loop.time()  # this pass parsed them: receive → durable, per batch
            acked = lambda f: self._durable(f, acks, writes, t0)  # noqa: E731
        try:
            # The round: written, indexed, delivered (LocalBackend.publish); acks on `acked`.
            res = self._backend.publish(msgs, retained, acked, writes)
        except Exception:
            log.exception("append of %d MQTT messages failed", len(msgs))
            for conn, _pids, _ack in acks:
                conn.fail(0x80, "store append failed")
            return
        if acks:
            self.inflight += 1
            self._futs.add(res.durable)
        self.appended += len(msgs)
        if not self.throttled and self.backlog() > LAG_HIGH:
            self.throttled = True
            self._loop.call_later(0.001, self._check_lag)

    def _durable(
        self,
        fut: asyncio.Future[None],
        acks: list[Ack],
        writes: list[asyncio.Future[bytes]] | None = None,
        t0: float = 0.0,
    ) -> None:
        if writes and not all(w.done() for w in writes):
            # Acknowledged means the retained state is written too (a kill -9 right after the
            # PUBACK must not lose it): the core answers RETAIN after writing it.
            asyncio.gather(*writes, return_exceptions=True).add_done_callback(
                lambda _g: self._durable(fut, acks, None, t0)
            )
            return
        self.inflight -= 1
        self._futs.discard(fut)
        if fut.cancelled() or fut.exception() is not None:
            log.error("append not durable: %r", None if fut.cancelled() else fut.exception())
            for conn, pids, ack in acks:
                if ack == PUBREC and conn.session is not None:
                    conn.session.qos2_in.difference_update(pids)
                conn.fail(0x80, "store append not durable")
            return
        if t0:
            self._latency.observe(self._loop.time() - t0, sum([len(pids) for _c, pids, _a in acks]))
        # A PUBREC promises the message is stored once: a persistent session's QoS 2 ids
        # (`qos2_in`, how a resent PUBLISH is known) are written before it goes out, not at the
        # next periodic flush (a crash in between made the client's resend a second copy).
        qos2: set[Session] = set()
        for conn, pids, ack in acks:
            session = conn.session
            if ack == PUBREC and session is not None:
                session.qos2_pending.difference_update(pids)  # stored now: written as such
                if session.persistent:
                    qos2.add(session)
        if qos2:
            assert self.sessions is not None
            self.sessions.write_now(list(qos2), lambda: self._send_acks(acks))
        else:
            self._send_acks(acks)

    def _send_acks(self, acks: list[Ack]) -> None:
        # One write per connection for all its acks of this fsync (was one syscall per ack:
        # 11 % of the loop in a QoS 1 fan-in profile), built per run of a read chunk.
        out: dict[ClientPort, list[bytes]] = {}
        for conn, pids, ack in acks:
            data = conn.acks_bytes(pids, ack)
            if data:
                parts = out.get(conn)
                if parts is None:
                    out[conn] = [data]
                else:
                    parts.append(data)
        for conn, parts in out.items():
            conn.write(parts[0] if len(parts) == 1 else b"".join(parts))

    def throttle(self, conn: ClientPort) -> None:
        """Called by a connection that just fed us while throttled: stop reading it for now."""
        conn.transport.pause_reading()
        self._paused.append(conn)

    def backlog(self) -> int:
        """Records we appended that the dispatcher has not indexed yet (Kafka appends make this
        an underestimate, never an overestimate; through the core link it includes what is
        still on its way there), or what delivery owes readers that can take it now."""
        backend = self._backend
        undispatched = self.appended - (backend.indexed() - self._indexed0)
        lag = self._lag
        out = max(undispatched, max(lag.values())) if lag else undispatched
        cluster = backend.cluster
        # Several proxies: a reader behind on another proxy slows our publishers too (they
        # fill the same queues); the core tells us the largest lag of the others.
        return out if cluster is None else max(out, cluster.others_lag)

    def _check_lag(self) -> None:
        if self.backlog() > LAG_LOW:
            self._loop.call_later(0.002, self._check_lag)
            return
        self.throttled = False
        paused, self._paused = self._paused, []
        for conn in paused:
            conn.resume_reading()  # unless blocked for another reason (publish rate)

    async def drain(self) -> None:
        """Wait for every outstanding append to be durable (graceful close)."""
        if self._futs:
            await asyncio.wait(list(self._futs), timeout=10)
