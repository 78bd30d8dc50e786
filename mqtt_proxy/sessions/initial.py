"""What a new subscription gets at once, before delivery takes it over: the retained messages
its filter matches (from the retained store, written as the stored copies say, its ACL and
expiry applied), or the current `$SYS` values for a `$SYS` filter."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightqueue.model import StoredMessage
from mqtt_proxy.delivery.queue_cache import CachedMsg
from mqtt_proxy.ports import QueuesPort
from mqtt_proxy.sessions.state import Inflight, Subscription

if TYPE_CHECKING:
    from mqtt_proxy.delivery.delivery import Delivery
    from mqtt_proxy.sys_topics import SysPublisher


class InitialMessages:
    def __init__(self, backend: QueuesPort, delivery: Delivery) -> None:
        self._backend = backend
        self._delivery = delivery
        # `$SYS` values for a new `$SYS` subscriber: set by the server once built (the
        # publisher reads the sessions, so it comes after them).
        self.sys: SysPublisher | None = None

    def send_initial(self, subs: list[Subscription], done: Callable[[], None]) -> None:
        """What new subscriptions get at once: retained messages, or `$SYS` values; then they
        are released to delivery and `done` runs (after the last answer, in order)."""
        pending = [len(subs) + 1]

        def one_done(sub: Subscription | None) -> None:
            if sub is not None:
                sub.held = False
                if sub.session.conn is not None and not sub.local:
                    qs = self._delivery.queues.get(sub.queue)
                    if qs is not None:
                        self._delivery.mark(qs)
            pending[0] -= 1
            if pending[0] == 0:
                done()

        for sub in subs:
            if sub.local:
                assert self.sys is not None
                self.sys.send_current(sub)
                one_done(sub)
            else:
                self.send_retained(sub, one_done)
        one_done(None)

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

        self._backend.retained_for(sub.spec.filter, found)

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
