"""`$share` groups whose members are on several proxies: one group position, kept by the core.

A proxy with members of a group does not read the group's queue from its own position: it
asks the core for a LEASE of the next sequences (the core's redelivery list first, then from
the group's position up to the queue's end) and hands each leased message to one of its
members. It reports DONE when a message is finished (acknowledged, or sent at QoS 0, or passed
over), and RETURNs what it can no longer deliver (its last member left). Everything leased to
a proxy whose link drops goes back to the redelivery list. So each message goes to exactly
one member, and a member's unacknowledged messages reach another member when it leaves.

When messages go back to the list, the core WAKEs the other proxies of the group: they ask
again without waiting for the next message. State is in memory: after a core restart a group
starts again from its first member's stored position (unacknowledged ones are delivered again,
which QoS 1 allows).

Wire (JSON bodies, method numbers in `mqtt_proxy.backends.cluster`): LEASE [key, queue, hint, n] →
[[seq, ...], low]; DONE/RETURN [key, [seq, ...]]; WAKE (core → proxy) [queue].
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from mqtt_proxy.backends.cluster import DONE, LAG, LAG_STEP, LEASE, RETURN, WAKE
from notify.link import RpcPeer

log = logging.getLogger("lightgate.shares")


@dataclass(slots=True, eq=False)
class CoreGroup:
    queue: str
    pos: int
    leased: dict[int, RpcPeer] = field(default_factory=dict)
    redeliver: list[int] = field(default_factory=list)
    peers: set[RpcPeer] = field(default_factory=set)

    def low(self) -> int:
        """The group's acknowledged position: what a member stores as its own."""
        low = self.pos
        if self.leased:
            low = min(low, min(self.leased))
        if self.redeliver:
            low = min(low, self.redeliver[0])
        return low


class SharedGroups:
    """The core's half: group positions, leases per link, redelivery."""

    def __init__(self, queues: Any) -> None:
        self.queues = queues
        self.groups: dict[str, CoreGroup] = {}
        # Records the proxies appended that the dispatcher has not indexed yet (set by CoreLink):
        # a proxy only knows its own appends, so with several this is the core's to tell.
        self.undispatched: Any = lambda: 0

    def methods(self) -> dict[int, Any]:
        return {LEASE: self._lease, DONE: self._done, RETURN: self._return, LAG: self._lag}

    # -- flow control across proxies (mqtt_proxy.backends.cluster.LAG) --------------------------------
    def _lag(self, peer: RpcPeer, body: bytes) -> None:
        """A proxy's delivery lag changed: tell each other proxy the largest lag of the rest
        (or the dispatcher's backlog, if larger) when that moved by LAG_STEP (or fell to 0), so
        their publishers slow down too."""
        peer.state["lag"] = int.from_bytes(body[:4], "big")
        self._spread()

    def _spread(self) -> None:
        peers = self.lag_peers()
        core = self.undispatched() if len(peers) > 1 else 0
        for p in peers:
            others = max((q.state.get("lag", 0) for q in peers if q is not p), default=0)
            others = max(others, core)
            sent = p.state.get("lag_sent", 0)
            if abs(others - sent) >= LAG_STEP or (others == 0 and sent):
                p.state["lag_sent"] = others
                p.send(LAG, others.to_bytes(4, "big"))

    def lag_peers(self) -> list[RpcPeer]:
        """The links that report lag (set by CoreLink to its proxies)."""
        return []

    def _lease(self, peer: RpcPeer, body: bytes) -> bytes:
        key, queue, hint, n = json.loads(body)
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = CoreGroup(queue, int(hint))
        g.peers.add(peer)
        last = self.queues.last_seq(queue)
        end = (-1 if last is None else int(last)) + 1
        if len(g.peers) > 1:
            # A fair share of what is there now: the first proxy to ask must not take a whole
            # burst while the others' members, woken by the same event, find nothing left.
            avail = len(g.redeliver) + max(0, end - g.pos)
            n = min(n, max(1, -(-avail // len(g.peers))))
        out: list[int] = []
        while g.redeliver and len(out) < n:
            seq = g.redeliver.pop(0)
            out.append(seq)
        if len(out) < n:
            stop = min(end, g.pos + n - len(out))
            out.extend(range(g.pos, stop))
            g.pos = max(g.pos, stop)
        for seq in out:
            g.leased[seq] = peer
        return json.dumps([out, g.low()]).encode()

    def _done(self, peer: RpcPeer, body: bytes) -> None:
        key, seqs = json.loads(body)
        g = self.groups.get(key)
        if g is None:
            return
        leased = g.leased
        for seq in seqs:
            if leased.get(seq) is peer:
                del leased[seq]

    def _return(self, peer: RpcPeer, body: bytes) -> None:
        key, seqs = json.loads(body)
        g = self.groups.get(key)
        if g is None:
            return
        back = [s for s in seqs if g.leased.get(s) is peer]
        for s in back:
            del g.leased[s]
        self._requeue(g, back, peer)

    def _requeue(self, g: CoreGroup, seqs: list[int], gone: RpcPeer) -> None:
        if not seqs:
            return
        g.redeliver = sorted(set(g.redeliver).union(seqs))
        body = json.dumps([g.queue]).encode()
        for p in g.peers:
            if p is not gone:
                p.send(WAKE, body)

    def tick(self) -> None:
        """Every few ms (CoreLink): the dispatcher's backlog moves without any LAG frame."""
        self._spread()

    def peer_lost(self, peer: RpcPeer) -> None:
        """A proxy went away: what it had leased goes to the other members."""
        peer.state["lag"] = 0
        self._spread()
        for g in self.groups.values():
            g.peers.discard(peer)
            back = [s for s, p in g.leased.items() if p is peer]
            for s in back:
                del g.leased[s]
            self._requeue(g, back, peer)
