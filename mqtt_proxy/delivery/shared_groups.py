"""Delivery to `$share/<group>/<filter>` groups: one position per group, each message to one
member with room (round robin), a leaving member's unacknowledged messages redelivered to the
others. With several proxies, a group reads the sequences the core leased to this proxy
(mqtt_proxy.backends.cluster, lightgate/shares.py) instead of its own position. Driven by `Delivery`,
which owns the queues, their reads and the scheduling."""

from __future__ import annotations

import enum
from typing import Final

from mqtt_proxy.delivery.group_state import SharedGroup
from mqtt_proxy.delivery.queue_cache import PUMP_BATCHES, CachedMsg, QueueState, cached, cached_get
from mqtt_proxy.ports import GroupHostPort, PeerPort
from mqtt_proxy.sessions.state import Inflight, Subscription

__all__ = ["GroupDelivery", "SharedGroup"]


class _Pick(enum.Enum):
    UNREADABLE = 0  # _pick_member: no member of the group may read the message


_UNREADABLE: Final = _Pick.UNREADABLE


class GroupDelivery:
    """The `$share` half of one `Delivery`: pumps its groups, takes leaving members out."""

    def __init__(self, delivery: GroupHostPort, batch: int) -> None:
        self._delivery = delivery  # reads (read_range, load), marks, the cluster's leases
        self._batch = batch
        self._latency = delivery.deliver_latency

    def leave(self, qs: QueueState, g: SharedGroup, sub: Subscription) -> None:
        """A member leaves: its unacked messages go back to the group for another member."""
        try:
            g.members.remove(sub)
        except ValueError:
            return
        session = sub.session
        for seq, (owner, pid) in list(g.pending.items()):
            if owner is session:
                del g.pending[seq]
                session.inflight.pop(pid, None)
                g.redeliver.append(seq)
        g.redeliver.sort()
        sub.pos = g.acked_pos()  # what a persistent member resumes from
        if not g.members:
            del qs.groups[g.key]
            if g.lease is not None:  # the other proxies' members take them
                leases = self._delivery.leases
                assert leases is not None  # a group holds a lease only with several proxies
                leases.give_back(g.key, g.redeliver + g.lease)
        else:
            self._delivery.mark(qs)

    def pump(self, qs: QueueState, g: SharedGroup, now_ms: int) -> bool:
        members = g.members
        if not members:
            return False
        lease = g.lease
        delivery = self._delivery
        read_range = delivery.read_range
        load = delivery.load
        leases = delivery.leases
        for _ in range(PUMP_BATCHES * self._batch):
            if g.redeliver or lease:
                seq = g.redeliver[0] if g.redeliver else lease[0]  # type: ignore[index]
                if seq not in qs.cache and seq >= qs.floor and load(qs, seq) is None:
                    return False  # its load is on the way; the answer marks the queue again
                m = cached_get(qs.cache, seq)
            elif lease is not None:
                assert leases is not None  # a group holds a lease only with several proxies
                leases.ask(delivery, qs, g)  # the core's answer marks the queue again
                return False
            else:
                start, end = read_range(qs, g.pos)
                if start >= end:
                    g.pos = start
                    return False
                seq = start
                m = cached(qs.cache, seq)
            pending = False
            if m is not None and not m.expired(now_ms):
                target = self._pick_member(g, m)
                if target is None:
                    return False
                if target is not _UNREADABLE:
                    sub, conn = target
                    pending = self._send(qs, g, sub, conn, seq, m, now_ms)
            if g.redeliver and g.redeliver[0] == seq:
                g.redeliver.pop(0)
            elif lease is not None:
                lease.pop(0)
            else:
                g.pos = seq + 1
            if lease is not None and not pending:
                assert leases is not None
                leases.done(g.key, seq)
        return True

    def _pick_member(
        self, g: SharedGroup, m: CachedMsg
    ) -> tuple[Subscription, PeerPort] | _Pick | None:
        """The next member with room that may read `m`; None when none has room now;
        `_UNREADABLE` when no connected member may read it (the group passes over it rather
        than hold every later message back)."""
        members = g.members
        n = len(members)
        online = denied = 0
        for i in range(n):
            sub = members[(g.rr + i) % n]
            conn = sub.session.conn
            if conn is None:
                continue
            online += 1
            if conn.acl is not None and not conn.acl.can_read(m.topic):
                denied += 1
                continue
            if not conn.writable or sub.held:
                continue
            qos = min(m.qos, sub.qos)
            if qos and len(sub.session.inflight) >= conn.out_window:
                continue
            g.rr = (g.rr + i + 1) % n
            return sub, conn
        return _UNREADABLE if online and denied == online else None

    def _send(
        self,
        qs: QueueState,
        g: SharedGroup,
        sub: Subscription,
        conn: PeerPort,
        seq: int,
        m: CachedMsg,
        now_ms: int,
    ) -> bool:
        """Send `m` to one member; True when it waits for the member's ack (QoS 1/2)."""
        v5 = conn.v5
        qos = min(m.qos, sub.qos)
        sub_ids = (sub.sub_id,) if (v5 and sub.sub_id) else ()
        tpl = m.template(qos, m.retain and sub.retain_as_published, v5, sub_ids, now_ms)
        session = sub.session
        if conn.max_out_packet and tpl.size > conn.max_out_packet:
            return False  # MQTT 5 §3.1.2.11.4: discarded for this client as if delivered
        pid = 0
        if qos:
            pid = session.alloc_pid()
            data = tpl.packet(pid)
            session.inflight[pid] = Inflight(qs.name, seq, qos, data, False, sub.spec.raw)
            g.pending[seq] = (session, pid)
        else:
            data = tpl.data
        if conn.out_aliases is not None:
            data = conn.out_aliases.packet(m.topic, tpl, pid, data)
        self._latency.observe_ms(now_ms - m.ts_ms)
        conn.write_delivery(data, 1, len(data))
        return bool(qos)
