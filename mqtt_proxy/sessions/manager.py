"""Session registry: open/resume on CONNECT, takeover, wills, expiry, persistence, subscribe.

Theory of operation
-------------------
`sessions` maps client id → `Session`, online or (persistent only) offline. CONNECT either starts
a fresh session (clean start / clean session, or none stored) or resumes the stored one
(`session present`). A persistent session (v3 clean session 0, or v5 session expiry > 0) survives
its connection: its subscriptions keep their light-queue positions, and on reconnect delivery
simply pulls from there, so offline messages arrive in order. Its expiry timer starts at
disconnect; expiry deletes it and releases its wildcard filters.

Persistence: dirty persistent sessions are written to the light-queue DB's session store every
`session_flush_ms`, at disconnect and on graceful close; a SUBSCRIBE or UNSUBSCRIBE writes its
session before the SUBACK / UNSUBACK (retained messages follow the SUBACK), so a `kill -9` right
after an ack cannot lose or resurrect a subscription; a stored QoS 2 PUBLISH writes it (its id in
`qos2_in`) before the PUBREC, so a resend after a `kill -9` is known as one (`write_now`), and
writes it again before the PUBCOMP (the id forgotten: the client may reuse it) and before an
outbound PUBREL (the PUBLISH released: never sent again), these per loop pass (`after_write`).
Ids whose message is not stored yet are never written as stored (`Session.to_state`). Connected persistent sessions are also
snapshotted about once a second because QoS 0 delivery moves positions without marking them
dirty (a restart then re-sends at most about a second of QoS 0 messages, which is allowed). A
flush looks only at the connected persistent sessions and the offline ones changed since their
last write (`_watched`), plus every persistent session once in FULL_WALK_EVERY flushes: 100,000
offline sessions cost each flush 4 ms when it walked them all (docs/performance-history.md).

Wills: published on a close that was not a normal DISCONNECT, after
min(will delay, session expiry); a reconnect to the session before then cancels it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightqueue.model import StoredMessage
from mqtt_proxy.delivery.queue_cache import CachedMsg
from mqtt_proxy.ports import SessionState
from mqtt_proxy.sessions.state import Inflight, Session, Subscription, Will
from mqtt_proxy.sessions.topic_filters import FilterSpec

if TYPE_CHECKING:
    from mqtt_proxy.connection.connection import MqttConnection
    from mqtt_proxy.server import MqttServer

log = logging.getLogger("lightgate.mqtt.sessions")

NEVER_EXPIRES = 0xFFFFFFFF
FULL_WALK_EVERY = 100  # flushes (session_flush_ms each): every persistent session is looked at


class SessionManager:
    def __init__(self, server: MqttServer) -> None:
        self.server = server
        self.sessions: dict[str, Session] = {}
        # The persistent ones among them (possibly a few that stopped being persistent since).
        self.persistent: dict[str, Session] = {}
        # What `flush` walks: the connected persistent sessions and the offline ones with changes
        # not written yet (an offline session changes only at disconnect, when its will is
        # published, or at restore), so 10^5 offline persistent sessions cost a flush nothing;
        # every FULL_WALK_EVERY flushes it walks them all, in case a change came by another way.
        self._watched: set[Session] = set()
        self._flushes = 0
        # `after_write`: what waits for a session's next write, written once per loop pass.
        self._waiting: dict[Session, list[Callable[[], None]]] = {}

    # -- restore / persist ---------------------------------------------------------------------
    async def restore(self) -> None:
        """Load persistent sessions after a restart; they are offline until their client returns."""
        now = time.time()
        backend = self.server.backend
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
                self._watched.add(lost.session)
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
            self.server.backend.delete_session(client_id)
        else:
            self.install(state)
            self.server.backend.save_sessions([(client_id, state)])

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
        self.server.backend.save_sessions([self._state(session)])
        del self.sessions[client_id]
        self.persistent.pop(client_id, None)
        self._watched.discard(session)
        return queues

    def _will_changed(self, session: Session) -> None:
        """Keep the core's copy of this session's pending will current (several proxies)."""
        cluster = self.server.backend.cluster
        if cluster is None:
            return
        due = None
        if session.conn is None and session.will is not None:
            due = session.disconnected_at + min(session.will.delay, session.expiry)
        cluster.will(session.client_id, session.will, session.expiry, due)

    def flush(self, force: bool = False) -> None:
        self._flushes += 1
        snapshot = force or self._flushes % 10 == 0
        full = force or self._flushes % FULL_WALK_EVERY == 0
        pool = self.persistent.values() if full else self._watched
        items = []
        written_offline = []
        for s in pool:
            if s.persistent and (s.dirty or (snapshot and s.conn is not None)):
                items.append(self._state(s))
                if s.conn is None:
                    written_offline.append(s)
        self.server.backend.save_sessions(items)
        if full:  # and whatever else has nothing left to write or is no longer registered
            persistent = self.persistent
            self._watched = {
                s
                for s in self._watched
                if (s.conn is not None or s.dirty) and persistent.get(s.client_id) is s
            }
        else:
            self._watched.difference_update(written_offline)

    def write_now(self, sessions: list[Session], done: Callable[[], None]) -> None:
        """Write these sessions' state at once (not at the next flush); `done` once written.
        A session no longer registered here (ended, or handed to another proxy) is not
        written: that would bring back a deleted one or overwrite its new owner's."""
        persistent = self.persistent
        items = [self._state(s) for s in sessions if persistent.get(s.client_id) is s]
        self.server.backend.save_sessions(items, done)

    def after_write(self, session: Session, then: Callable[[], None]) -> None:
        """`then()` once `session` is written, in a write shared by everything that asked in
        this pass of the loop (a read chunk of PUBRECs: one write, not one per packet)."""
        waiting = self._waiting
        if not waiting:
            asyncio.get_running_loop().call_soon(self._write_waiting)
        fns = waiting.get(session)
        if fns is None:
            waiting[session] = [then]
        else:
            fns.append(then)

    def _write_waiting(self) -> None:
        waiting, self._waiting = self._waiting, {}

        def done() -> None:
            for fns in waiting.values():
                for fn in fns:
                    fn()

        self.write_now(list(waiting), done)

    def _state(self, s: Session) -> tuple[str, SessionState]:
        """(client id, state to store); the session is clean afterwards."""
        s.dirty = False
        group_of = self.server.delivery.group_of
        for sub in s.subs.values():
            if sub.spec.share_group is not None and (g := group_of(sub)) is not None:
                sub.pos = g.acked_pos()  # a member stores its group's position
        return s.client_id, s.to_state()

    # -- connect -------------------------------------------------------------------------------
    def open(
        self,
        conn: MqttConnection,
        client_id: str,
        clean: bool,
        expiry: int,
        version: int,
        will: Will | None,
    ) -> tuple[Session, bool]:
        """Start or resume the session of `client_id` for `conn` (already authenticated)."""
        server = self.server
        old = server.conns.get(client_id)
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
            self._watched.add(session)
        else:
            self._watched.discard(session)
        if not session.persistent and present:
            # Resumed with expiry 0 (v5): nothing to keep in the store any more.
            server.backend.delete_session(client_id)
        server.conns[client_id] = conn
        self._will_changed(session)
        return session, present

    def resume(self, session: Session) -> None:
        """After CONNACK: attach subscriptions to delivery, resend in-flight messages with DUP."""
        conn = session.conn
        assert conn is not None
        delivery = self.server.delivery
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

    def disconnected(self, conn: MqttConnection, reason: str) -> None:
        """The connection of a session went away (any cause)."""
        server = self.server
        session = conn.session
        if session is None:
            return
        cid = session.client_id
        if server.conns.get(cid) is conn:
            del server.conns[cid]
            if conn.counters is server.internal_counters:
                server.internal_ids.discard(cid)
        conn.counters["disconnects"] += 1
        server.events.disconnect(cid, reason, conn.remote)
        report = server.report_disconnect
        if report is not None and not server.closing:  # flapping detection (store/bans.py)
            report(cid, conn.remote.rpartition(":")[0])
        server.conn_log.event("closed", conn.conn_id, "client %r: %s", cid, reason or "closed")
        if session.conn is not conn:
            return  # already taken over by a newer connection
        session.conn = None
        delivery = server.delivery
        for sub in session.subs.values():
            if not sub.local:
                delivery.detach(sub)
        will = session.will if conn.will_on_close else None
        session.will = None
        if not session.persistent:
            self._end(session, publish_will=False)
            if will is not None:
                self.publish_will(will)
            if server.backend.cluster is not None:
                server.backend.cluster.gone(cid)
            return
        session.disconnected_at = time.time()
        session.dirty = True
        self._watched.add(session)  # already there (it was connected): written, then dropped
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
            self._watched.add(session)
            self.publish_will(will)
            self._will_changed(session)

    def publish_will(self, will: Will) -> None:
        """Publish a will its owner's rights allow now (rules may have changed since CONNECT,
        on reload or by the auth hook); a will they do not allow is dropped and counted."""
        server = self.server
        allowed = server.will_allowed(will)
        if allowed is None:  # the auth hook was not asked about this topic yet
            web = server.topic_hook
            assert web is not None
            task = server.loop.create_task(web.authorize(will.user, will.owner, will.topic, 2))
            task.add_done_callback(
                lambda t: self._publish_checked_will(will, not t.exception() and t.result())
            )
            return
        self._publish_checked_will(will, allowed)

    def _publish_checked_will(self, will: Will, allowed: bool) -> None:
        server = self.server
        if not allowed:
            server.counters["wills_refused"] += 1
            log.info("will of %r to %r not published: not authorized", will.owner, will.topic)
            return
        server.counters["wills_published"] += 1
        server.publish_message(
            will.topic, will.payload, will.qos, will.retain, will.properties, client_id=""
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
        self.server.counters["sessions_expired"] += 1
        log.info("session %r expired", session.client_id)
        self._end(session, publish_will=True)
        if self.server.backend.cluster is not None:
            self.server.backend.cluster.gone(session.client_id)

    def _end(self, session: Session, publish_will: bool) -> None:
        """Delete a session: release its filters, its stored state, its pending will."""
        for t in (session.expiry_timer, session.will_timer):
            if t is not None:
                t.cancel()
        session.expiry_timer = session.will_timer = None
        server = self.server
        delivery = server.delivery
        for sub in session.subs.values():
            if not sub.local:
                if session.conn is not None:
                    delivery.detach(sub)
                server.backend.release(sub.queue)
        session.subs.clear()
        if publish_will and session.will is not None:
            will, session.will = session.will, None
            self.publish_will(will)
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
        if self.persistent.get(session.client_id) is session:
            del self.persistent[session.client_id]
        self._watched.discard(session)
        server.backend.delete_session(session.client_id)

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
        server = self.server
        existing = session.subs.get(spec.raw)
        local = is_local(spec)
        if existing is not None:
            if acquired is not None:
                server.backend.release(acquired[0])  # the same filter twice in one SUBSCRIBE
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
                group = server.delivery.group(spec.share_group, sub.queue)
                sub.pos = group.pos if group is not None else start
            session.subs[spec.raw] = sub
            owner = session.conn
            (server.counters if owner is None else owner.counters)["subscriptions"] += 1
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
            server.delivery.attach(sub)
        session.dirty = session.persistent
        if session.conn is not None:
            session.conn.session_overlap = session.overlapping
        return sub if initial else None

    def send_initial(self, subs: list[Subscription], done: Callable[[], None]) -> None:
        """What new subscriptions get at once: retained messages, or `$SYS` values; then they
        are released to delivery and `done` runs (after the last answer, in order)."""
        pending = [len(subs) + 1]

        def one_done(sub: Subscription | None) -> None:
            if sub is not None:
                sub.held = False
                if sub.session.conn is not None and not sub.local:
                    qs = self.server.delivery.queues.get(sub.queue)
                    if qs is not None:
                        self.server.delivery.mark(qs)
            pending[0] -= 1
            if pending[0] == 0:
                done()

        for sub in subs:
            if sub.local:
                self.server.sys.send_current(sub)
                one_done(sub)
            else:
                self.send_retained(sub, one_done)
        one_done(None)

    def save(self, session: Session, done: Callable[[], None]) -> None:
        """Write one persistent session now (SUBSCRIBE / UNSUBSCRIBE, before their ack), then
        `done`: a `kill -9` right after a SUBACK must not lose the subscription (the periodic
        flush runs every `session_flush_ms`). A LevelDB write without fsync, as every session
        write (lightqueue/session_store.py): the OS has it when `done` runs."""
        if session.persistent:
            self.server.backend.save_sessions([self._state(session)], done)
        else:
            done()

    def unsubscribe(self, session: Session, raw: str) -> bool:
        sub = session.subs.pop(raw, None)
        if sub is None:
            return False
        if not sub.local:
            if session.conn is not None:
                self.server.delivery.detach(sub)
            self.server.backend.release(sub.queue)
        session.dirty = session.persistent
        if session.conn is not None:
            session.conn.session_overlap = session.overlapping
        return True

    def send_retained(
        self, sub: Subscription, done: Callable[[Subscription], None] | None = None
    ) -> None:
        conn = sub.session.conn
        if conn is None:
            if done is not None:
                done(sub)
            return

        def found(msgs: list[StoredMessage]) -> None:
            self._write_retained(sub, msgs)
            if done is not None:
                done(sub)

        self.server.backend.retained_for(sub.spec.filter, found)

    def _write_retained(self, sub: Subscription, msgs: list[StoredMessage]) -> None:
        conn = sub.session.conn
        if not msgs or conn is None or conn.closed:
            return
        now_ms = int(time.time() * 1000)
        session = sub.session
        out = []
        acl = conn.acl
        for stored in msgs:
            m = CachedMsg.from_stored(stored)
            if m.expired(now_ms) or (acl is not None and not acl.can_read(m.topic)):
                continue
            qos = min(m.qos, sub.qos)
            sids = (sub.sub_id,) if (conn.v5 and sub.sub_id) else ()
            tpl = m.template(qos, True, conn.v5, sids, now_ms)
            if qos:
                if len(session.inflight) >= 65000:
                    break
                pid = session.alloc_pid()
                data = tpl.packet(pid)
                session.inflight[pid] = Inflight("", -1, qos, data, False, sub.spec.raw)
            else:
                pid = 0
                data = tpl.data
            if conn.out_aliases is not None:
                data = conn.out_aliases.packet(m.topic, tpl, pid, data)
            out.append(data)
        if out:
            conn.write_delivery(b"".join(out), len(out), sum(map(len, out)))


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
