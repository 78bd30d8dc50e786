"""Session registry: open/resume on CONNECT, takeover, wills, expiry, persistence, subscribe.

Theory of operation
-------------------
`sessions` maps client id → `Session`, online or (persistent only) offline. CONNECT either starts
a fresh session (clean start / clean session, or none stored) or resumes the stored one
(`session present`). A persistent session (v3 clean session 0, or v5 session expiry > 0) survives
its connection: its subscriptions keep their light-queue positions, and on reconnect delivery
simply pulls from there, so offline messages arrive in order. Its expiry timer starts at
disconnect; expiry deletes it and releases its wildcard filters.

Persistence (persistence.py, `SessionWriter`): a persistent session is written when it
changes in a way a `kill -9` must not lose (a SUBSCRIBE before its SUBACK, a stored QoS 2 id
before its PUBREC, ...) and periodically; this registry tells the writer which sessions are
persistent and which changed. Connected persistent sessions are also snapshotted about once a
second because QoS 0 delivery moves positions without marking them dirty (a restart then
re-sends at most about a second of QoS 0 messages, which is allowed). What a new subscription
gets at once (retained messages, `$SYS` values) is in initial.py.

Wills: published on a close that was not a normal DISCONNECT, after
min(will delay, session expiry); a reconnect to the session before then cancels it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mqtt_proxy.messages import broker_message
from mqtt_proxy.ports import ClientPort, NodeClaim, QueuesPort
from mqtt_proxy.sessions.initial import InitialMessages
from mqtt_proxy.sessions.persistence import SessionWriter
from mqtt_proxy.sessions.state import Session, Subscription, Will
from mqtt_proxy.sessions.topic_filters import FilterSpec
from store.mapping import MqttMessage

if TYPE_CHECKING:
    from mqtt_proxy.access import TopicAccess
    from mqtt_proxy.delivery.delivery import Delivery
    from mqtt_proxy.device_events import DeviceEvents
    from store.connlog import ConnLog

log = logging.getLogger("lightgate.mqtt.sessions")

NEVER_EXPIRES = 0xFFFFFFFF


class SessionManager:
    def __init__(
        self,
        backend: QueuesPort,
        delivery: Delivery,
        access: TopicAccess,
        publish: Callable[[MqttMessage], None],
        *,
        conns: dict[str, ClientPort],
        counters: dict[str, int],
        internal_counters: dict[str, int],
        internal_ids: set[str],
        events: DeviceEvents,
        conn_log: ConnLog,
    ) -> None:
        """`publish`: into the next append batch (wills); `conns`, `counters`,
        `internal_counters`, `internal_ids`: the server's maps, which this registry keeps
        current as clients come and go."""
        self._backend = backend
        self._delivery = delivery
        self._access = access
        self._publish = publish
        self._conns = conns
        self._counters = counters
        self._internal_counters = internal_counters
        self._internal_ids = internal_ids
        self._events = events
        self._conn_log = conn_log
        # Writing persistent sessions (persistence.py) and what a new subscription gets at once
        # (initial.py); their entry points are this registry's, bound here (no extra call).
        self.writer = writer = SessionWriter(backend, delivery.group_of)
        self.initial = initial = InitialMessages(backend, delivery)
        self.flush = writer.flush
        self.write_now = writer.write_now
        self.after_write = writer.after_write
        self.save = writer.save
        self.send_initial = initial.send_initial
        self.send_retained = initial.send_retained
        # Reports a disconnect for flapping detection (store/bans.py); None: not detected here.
        self.report_disconnect: Callable[[str, str], object] | None = None
        self.closing = False  # the server is going down: no flapping reports
        # Other nodes on the same Kafka cluster (set by the wiring): `node_claim(client_id,
        # then)` owns the id cluster-wide, then calls `then(moved, state)`: moved with the
        # session another node handed over (its queues held here), or None to start afresh;
        # not moved: this node's own copy is current.
        self.node_claim: NodeClaim | None = None
        self.sessions: dict[str, Session] = {}
        # The persistent ones among them (the writer's map: it writes them).
        self.persistent = writer.persistent

    # -- restore / persist ---------------------------------------------------------------------
    async def restore(self) -> None:
        """Load persistent sessions after a restart; they are offline until their client returns."""
        now = time.time()
        backend = self._backend
        if backend.cluster is not None:
            return  # the core holds them until a client's CLAIM hands its session to a proxy
        restored: list[Session] = []
        for state in await backend.load_sessions():
            try:
                s = Session.from_state(state)
            except Exception:
                log.exception("dropping unreadable session %r", state.get("client_id"))
                continue
            restored.append(s)
        # Hold every queue the restored subscriptions read (holds live in memory), in one call.
        held = [sub for s in restored for sub in s.subs.values() if not sub.local]
        got = await backend.acquire_all([_held_spec(sub) for sub in held])
        for lost, answer in zip(held, got, strict=True):
            if isinstance(answer, str):
                log.error("session %r: %r cannot be restored (%s); it is dropped",
                          lost.session.client_id, lost.spec.raw, answer)  # fmt: skip
                del lost.session.subs[lost.spec.raw]
                lost.session.dirty = True
                self.writer.watched.add(lost.session)
        for s in restored:
            was_offline = bool(s.disconnected_at)
            if not was_offline:
                s.disconnected_at = now  # it was online when the gateway stopped
            _pending_from_inflight(s)
            self.sessions[s.client_id] = self.persistent[s.client_id] = s
            self._arm_expiry(s, now)
            if was_offline and s.will is not None:
                # A will that was waiting out its delay: still due when it was due before.
                due = s.disconnected_at + min(s.will.delay, s.expiry) - now
                s.will_timer = asyncio.get_running_loop().call_later(
                    max(0.0, due), self._will_due, s
                )
        if self.sessions:
            log.info("restored %d persistent MQTT sessions", len(self.sessions))

    def install(self, state: dict[str, Any]) -> None:
        """A session the core handed over (its queues already held on this link): offline
        until `open` resumes it; its will was cancelled by the claim."""
        try:
            s = Session.from_state(state)
        except Exception:
            log.exception("dropping unreadable session %r", state.get("client_id"))
            return
        s.will = None
        if not s.disconnected_at:
            s.disconnected_at = time.time()
        _pending_from_inflight(s)
        self.sessions[s.client_id] = self.persistent[s.client_id] = s
        self._arm_expiry(s, s.disconnected_at)

    def adopt(self, state: dict[str, Any], due: float | None) -> None:
        """A dead node's session (queues held): installed as a disconnected one whose will,
        kept, is published at `due` (wall clock) unless its client returns first."""
        self.install(state)
        session = self.persistent.get(state.get("client_id", ""))
        if session is None or due is None:
            return
        session.will = Session.from_state(state).will
        if session.will is not None:
            session.will_timer = asyncio.get_running_loop().call_later(
                max(0.0, due - time.time()), self._will_due, session
            )

    def moved_in(self, client_id: str, state: dict[str, Any] | None) -> None:
        """Another node handed `client_id` over: what this node kept of it is older (a
        connection of it was ended first); `state` (queues held) replaces it, or none."""
        old = self.sessions.get(client_id)
        if old is not None:
            if old.conn is not None:
                old.conn.taken_over()
            if self.sessions.get(client_id) is old:
                self._end(old, publish_will=False)
        if state is None:
            self._backend.delete_session(client_id)
        else:
            self.install(state)
            self._backend.save_sessions([(client_id, state)])

    def hand_off(self, client_id: str) -> list[str]:
        """The core's TAKE: another proxy claimed `client_id`. End its connection here (0x8E),
        write its state and forget the session, keeping its queue holds for the core to move;
        returns those queues (one per queue-backed subscription)."""
        session = self.sessions.get(client_id)
        if session is None:
            return []
        conn = session.conn
        if conn is not None:
            conn.taken_over()
        if self.sessions.get(client_id) is not session:
            return []  # not persistent: it ended with its connection
        for t in (session.expiry_timer, session.will_timer):
            if t is not None:
                t.cancel()
        session.expiry_timer = session.will_timer = None
        session.will = None  # a new connection in time: the will is not published
        queues = [sub.queue for sub in session.subs.values() if not sub.local]
        self._backend.save_sessions([self.writer.state(session)])
        del self.sessions[client_id]
        self.persistent.pop(client_id, None)
        self.writer.watched.discard(session)
        return queues

    def _will_changed(self, session: Session) -> None:
        """Keep the core's copy of this session's pending will current (several proxies)."""
        cluster = self._backend.cluster
        if cluster is None:
            return
        due = None
        if session.conn is None and session.will is not None:
            due = session.disconnected_at + min(session.will.delay, session.expiry)
        cluster.will(session.client_id, session.will, session.expiry, due)

    # -- connect -------------------------------------------------------------------------------
    def open(
        self,
        conn: ClientPort,
        client_id: str,
        clean: bool,
        expiry: int,
        version: int,
        will: Will | None,
    ) -> tuple[Session, bool]:
        """Start or resume the session of `client_id` for `conn` (already authenticated)."""
        conns = self._conns
        old = conns.get(client_id)
        if old is not None and old is not conn:
            old.taken_over()
        session = self.sessions.get(client_id)
        present = False
        if session is not None and clean:
            self._end(session, publish_will=True)
            session = None
        if session is not None:
            present = True
            for t in (session.expiry_timer, session.will_timer):
                if t is not None:
                    t.cancel()
            session.expiry_timer = session.will_timer = None
        else:
            session = Session(client_id=client_id)
            self.sessions[client_id] = session
        session.persistent = expiry > 0
        if session.persistent:
            self.persistent[client_id] = session
        else:
            self.persistent.pop(client_id, None)
        session.expiry = expiry
        session.version = version
        session.will = will
        session.conn = conn
        session.disconnected_at = 0.0  # online again: restore() must not count from a stale time
        session.dirty = session.persistent
        if session.persistent:
            self.writer.watched.add(session)
        else:
            self.writer.watched.discard(session)
        if not session.persistent and present:
            # Resumed with expiry 0 (v5): nothing to keep in the store any more.
            self._backend.delete_session(client_id)
        conns[client_id] = conn
        self._will_changed(session)
        return session, present

    def resume(self, session: Session) -> None:
        """After CONNACK: attach subscriptions to delivery, resend in-flight messages with DUP."""
        conn = session.conn
        assert conn is not None
        delivery = self._delivery
        for sub in session.subs.values():
            if not sub.local:
                delivery.attach(sub)
        if session.inflight:
            out = []
            for pid, inf in sorted(session.inflight.items(), key=lambda kv: kv[1].seq):
                if inf.released:
                    out.append(bytes((0x62, 2, pid >> 8, pid & 0xFF)))  # PUBREL
                else:
                    data = bytearray(inf.data)
                    data[0] |= 0x08  # DUP
                    out.append(bytes(data))
            conn.write(b"".join(out))
        conn.session_overlap = session.overlapping

    def disconnected(self, conn: ClientPort, reason: str) -> None:
        """The connection of a session went away (any cause)."""
        session = conn.session
        if session is None:
            return
        cid = session.client_id
        conns = self._conns
        if conns.get(cid) is conn:
            del conns[cid]
            if conn.counters is self._internal_counters:
                self._internal_ids.discard(cid)
        conn.counters["disconnects"] += 1
        self._events.disconnect(cid, reason, conn.remote)
        report = self.report_disconnect
        if report is not None and not self.closing:  # flapping detection (store/bans.py)
            report(cid, conn.remote.rpartition(":")[0])
        self._conn_log.event("closed", conn.conn_id, "client %r: %s", cid, reason or "closed")
        for feed in session.feeds[:]:  # retained messages no longer wanted: release the queues
            if feed.conn is conn:
                feed.finish()
        if session.conn is not conn:
            return  # already taken over by a newer connection
        session.conn = None
        delivery = self._delivery
        for sub in session.subs.values():
            if not sub.local:
                delivery.detach(sub)
        will = session.will if conn.will_on_close else None
        session.will = None
        if not session.persistent:
            self._end(session, publish_will=False)
            if will is not None:
                self.publish_will(will)
            cluster = self._backend.cluster
            if cluster is not None:
                cluster.gone(cid)
            return
        session.disconnected_at = time.time()
        session.dirty = True
        self.writer.watched.add(session)  # already there (it was connected): written, then dropped
        if will is not None:
            delay = min(will.delay, session.expiry)
            if delay <= 0:
                self.publish_will(will)
            else:
                session.will = will  # kept so expiry publishes it if it comes first
                session.will_timer = asyncio.get_running_loop().call_later(
                    delay, self._will_due, session
                )
        self._will_changed(session)
        self._arm_expiry(session, session.disconnected_at)

    def _will_due(self, session: Session) -> None:
        session.will_timer = None
        if session.conn is None and session.will is not None:
            will, session.will = session.will, None
            session.dirty = True
            self.writer.watched.add(session)
            self.publish_will(will)
            self._will_changed(session)

    def publish_will(self, will: Will) -> None:
        """Publish a will its owner's rights allow now (rules may have changed since CONNECT,
        on reload or by the auth hook); a will they do not allow is dropped and counted."""
        access = self._access
        allowed = access.will_allowed(will)
        if allowed is None:  # the auth hook was not asked about this topic yet
            access.authorize_will(will, lambda ok: self._publish_checked_will(will, ok))
            return
        self._publish_checked_will(will, allowed)

    def _publish_checked_will(self, will: Will, allowed: bool) -> None:
        if not allowed:
            self._counters["wills_refused"] += 1
            log.info("will of %r to %r not published: not authorized", will.owner, will.topic)
            return
        self._counters["wills_published"] += 1
        self._publish(
            broker_message(will.topic, will.payload, will.qos, will.retain, will.properties)
        )

    def _arm_expiry(self, session: Session, since: float) -> None:
        if session.expiry >= NEVER_EXPIRES:
            return
        left = session.disconnected_at + session.expiry - time.time() if since else session.expiry
        session.expiry_timer = asyncio.get_running_loop().call_later(
            max(0.0, left), self._expire, session
        )

    def _expire(self, session: Session) -> None:
        session.expiry_timer = None
        if session.conn is not None or self.sessions.get(session.client_id) is not session:
            return
        self._counters["sessions_expired"] += 1
        log.info("session %r expired", session.client_id)
        self._end(session, publish_will=True)
        cluster = self._backend.cluster
        if cluster is not None:
            cluster.gone(session.client_id)

    def _end(self, session: Session, publish_will: bool) -> None:
        """Delete a session: release its filters, its stored state, its pending will."""
        for t in (session.expiry_timer, session.will_timer):
            if t is not None:
                t.cancel()
        session.expiry_timer = session.will_timer = None
        delivery = self._delivery
        backend = self._backend
        for sub in session.subs.values():
            if not sub.local:
                if session.conn is not None:
                    delivery.detach(sub)
                backend.release(sub.queue)
        session.subs.clear()
        if publish_will and session.will is not None:
            will, session.will = session.will, None
            self.publish_will(will)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        if self.persistent.get(session.client_id) is session:
            del self.persistent[session.client_id]
        self.writer.watched.discard(session)
        backend.delete_session(session.client_id)

    # -- subscribe -----------------------------------------------------------------------------
    def needs_queue(self, session: Session, spec: FilterSpec) -> bool:
        """A SUBSCRIBE of `spec` creates a subscription that reads a light queue."""
        return spec.raw not in session.subs and not is_local(spec)

    def subscribe(
        self,
        session: Session,
        spec: FilterSpec,
        qos: int,
        no_local: bool,
        rap: bool,
        rh: int,
        sub_id: int | None,
        acquired: tuple[str, int] | None = None,
    ) -> Subscription | None:
        """Add or replace one subscription; a new queue-backed one reads `acquired` (the
        queue `Backend.acquire_many` holds for it, and where it starts). Returns it when retain
        handling wants its retained messages sent now: it is then `held` (no delivery) until
        the caller has sent them (`send_initial`, after the SUBACK)."""
        existing = session.subs.get(spec.raw)
        local = is_local(spec)
        if existing is not None:
            if acquired is not None:
                self._backend.release(acquired[0])  # the same filter twice in one SUBSCRIBE
            existing.qos, existing.no_local = qos, no_local
            existing.retain_as_published, existing.retain_handling = rap, rh
            existing.sub_id = sub_id
            sub = existing
            is_new = False
        else:
            sub = Subscription(session, spec, qos, no_local, rap, rh, sub_id, local=local)
            is_new = True
            if not local:
                assert acquired is not None
                sub.queue, start = acquired
                group = self._delivery.group(spec.share_group, sub.queue)
                sub.pos = group.pos if group is not None else start
            session.subs[spec.raw] = sub
            owner = session.conn
            (self._counters if owner is None else owner.counters)["subscriptions"] += 1
        # A replay's history already holds the retained messages it covers: sending them again
        # would deliver them twice (docs/replay.md).
        initial = (
            spec.share_group is None
            and spec.replay_since_ms is None
            and (rh == 0 or (rh == 1 and is_new))
        )
        if initial:
            sub.held = True
        if is_new and session.conn is not None and not local:
            self._delivery.attach(sub)
        session.dirty = session.persistent
        if session.conn is not None:
            session.conn.session_overlap = session.overlapping
        return sub if initial else None

    def unsubscribe(self, session: Session, raw: str) -> bool:
        sub = session.subs.pop(raw, None)
        if sub is None:
            return False
        if not sub.local:
            if session.conn is not None:
                self._delivery.detach(sub)
            self._backend.release(sub.queue)
        session.dirty = session.persistent
        if session.conn is not None:
            session.conn.session_overlap = session.overlapping
        return True


def _pending_from_inflight(s: Session) -> None:
    """A loaded session's in-flight messages are pending on their subscriptions again (acked
    there when the client answers the DUP resend), and reading goes on after them."""
    for pid, inf in s.inflight.items():
        sub = s.subs.get(inf.filter_raw)
        if sub is not None and inf.seq >= 0 and sub.spec.share_group is None:
            sub.pending[inf.seq] = pid
            if inf.seq >= sub.pos:
                sub.pos = inf.seq + 1


def _held_spec(sub: Subscription) -> FilterSpec:
    """What to acquire for a restored subscription: its filter, or, for a session that came
    from another node, the replay queue (from log offsets) it reads by name."""
    if sub.queue.startswith("$replay/@"):
        return FilterSpec(sub.spec.raw, sub.queue, sub.spec.share_group)
    return sub.spec


def is_local(spec: FilterSpec) -> bool:
    """`$SYS/...` and other `$` filters (not replays) are served by the proxy, not a queue."""
    return spec.filter.startswith("$") and spec.replay_since_ms is None
