"""Notify as an MQTT proxy in another process sees it: `LinkNotifier`, over the core link.

The client half of notify's methods (bodies in `notify.wire`, transport `notify.link`; the
service half is `lightgate.link_services.NotifyService`). Event-loop-only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from notify import Mailbox, wire
from notify.link import Handler, RpcPeer


class LinkNotifier:
    """A proxy's notifier over the core link: the interface of `InProcessNotifier` that the
    MQTT proxy uses (register, unregister, drop, batches), events coalesced in a Mailbox."""

    def __init__(self, proxy_id: str) -> None:
        self.proxy_id = proxy_id
        self.peer: RpcPeer | None = None
        self._interest: set[str] = set()
        self._box = Mailbox(proxy_id)

    def methods(self) -> dict[int, Handler]:
        return {wire.EVENTS: self._on_events}

    def attach(self, peer: RpcPeer) -> None:
        self.peer = peer
        peer.closed.add_done_callback(lambda _f: self._box.close())

    def _on_events(self, peer: RpcPeer, body: bytes) -> None:
        interest, box = self._interest, self._box
        for q, seq in wire.decode_events(body):
            if q in interest:
                box.put(q, seq)

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = True) -> None:
        """Add interest; the core answers each new queue with its current last sequence."""
        new = [q for q in queues if q not in self._interest]
        if new and self.peer is not None:
            self._interest.update(new)
            self.peer.send(wire.REGISTER, wire.encode_queues(new))

    def unregister(self, proxy_id: str, queues: Iterable[str]) -> None:
        gone = [q for q in queues if q in self._interest]
        self._interest.difference_update(gone)
        for q in gone:
            self._box.pending.pop(q, None)
        if gone and self.peer is not None:
            self.peer.send(wire.UNREGISTER, wire.encode_queues(gone))

    def drop(self, proxy_id: str) -> None:
        self.unregister(proxy_id, list(self._interest))

    async def batches(self, proxy_id: str) -> AsyncIterator[dict[str, int]]:
        box = self._box
        while True:
            await box.wait()
            if box.closed and not box.pending:
                return
            yield box.take()
