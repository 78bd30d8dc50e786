"""Route table and per-proxy mailboxes: events go only to proxies that asked for the queue.

Theory of operation
-------------------
The dispatcher publishes, after each dispatch batch, one `QueueEvent(queue, last_seq)` per queue
that grew. `RouteTable` maps queue → the proxies registered for it; each proxy has a `Mailbox`
that coalesces by queue (`pending[queue] = max(last_seq)`), so a slow proxy costs at most one slot
per registered queue, never a growing backlog, and nothing is lost in-process. A proxy that reads
its mailbox gets "queue Q has data up to last_seq": it then pulls from its own stored position, so
an event that is lost (a core link down) or late only delays delivery; `resync()` re-announces the
current last_seq of every registered queue to cover exactly that.

Event-loop-only; no I/O here (a proxy in another process is served over the core link:
lightgate.link_services.NotifyService drains its mailbox into EVENTS frames).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from typing import NamedTuple, Protocol


class QueueEvent(NamedTuple):
    """Queue `queue` has entries up to and including `last_seq` (a plain tuple on the wire)."""

    queue: str
    last_seq: int


class Notifier(Protocol):
    """What the dispatcher and the MQTT proxies see, whichever the transport (InProcessNotifier;
    a proxy in another process sees the subset in mqtt_proxy.ports.NotifierPort)."""

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = False) -> None: ...

    def unregister(self, proxy_id: str, queues: Iterable[str]) -> None: ...

    def drop(self, proxy_id: str) -> None: ...

    def publish(self, events: Iterable[tuple[str, int]]) -> None: ...

    def events(self, proxy_id: str) -> AsyncIterator[QueueEvent]: ...

    def batches(self, proxy_id: str) -> AsyncIterator[dict[str, int]]: ...


class Mailbox:
    """One proxy's coalesced pending events plus a way to wait for them."""

    __slots__ = (
        "proxy_id", "queues", "pending", "_waiter", "on_ready", "closed", "delivered", "known"
    )  # fmt: skip

    def __init__(self, proxy_id: str) -> None:
        self.proxy_id = proxy_id
        self.queues: set[str] = set()
        self.pending: dict[str, int] = {}
        self._waiter: asyncio.Future[None] | None = None
        self.on_ready: Callable[[Mailbox], None] | None = None  # the link: drain into a frame
        self.closed = False
        self.delivered = 0  # events handed out (coalesced), for tests and metrics
        # `known(queue, last_seq)`: the proxy has it already (a reader in this process that the
        # dispatch round pushed the entries to): no event, and no wake-up of its reader task.
        self.known: Callable[[str, int], bool] | None = None

    def put(self, queue: str, last_seq: int) -> None:
        pending = self.pending
        cur = pending.get(queue)
        if cur is None or last_seq > cur:
            known = self.known
            if known is not None and known(queue, last_seq):
                return
            pending[queue] = last_seq
            self._kick()

    def _kick(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self.on_ready is not None:
            self.on_ready(self)

    def take(self) -> dict[str, int]:
        pending, self.pending = self.pending, {}
        self.delivered += len(pending)
        return pending

    async def wait(self) -> None:
        """Return when something is pending or the mailbox is closed."""
        while not self.pending and not self.closed:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def close(self) -> None:
        self.closed = True
        self._kick()


class RouteTable:
    """queue → proxies, proxy → mailbox, and the last announced sequence of routed queues."""

    def __init__(self, last_seq_of: Callable[[str], int | None] | None = None) -> None:
        self._routes: dict[str, set[Mailbox]] = {}
        self._boxes: dict[str, Mailbox] = {}
        self._last: dict[str, int] = {}  # only queues someone registered for: bounded
        self._last_seq_of = last_seq_of
        self.published = 0
        self.routed = 0

    def mailbox(self, proxy_id: str) -> Mailbox:
        box = self._boxes.get(proxy_id)
        if box is None or box.closed:
            box = self._boxes[proxy_id] = Mailbox(proxy_id)
        return box

    def proxies_for(self, queue: str) -> set[str]:
        return {b.proxy_id for b in self._routes.get(queue, ())}

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = False) -> None:
        """Route `queues` to `proxy_id`; `announce` puts their current last_seq in its mailbox
        at once (a reconnecting remote proxy catches up without waiting for the next resync)."""
        box = self.mailbox(proxy_id)
        for q in queues:
            if q in box.queues:
                if announce:
                    self._announce(box, q)
                continue
            box.queues.add(q)
            subs = self._routes.get(q)
            if subs is None:
                subs = self._routes[q] = set()
            subs.add(box)
            if announce:
                self._announce(box, q)

    def _announce(self, box: Mailbox, q: str) -> None:
        seq = self.current(q)
        if seq is not None and seq >= 0:
            box.put(q, seq)

    def current(self, queue: str) -> int | None:
        """Best known last_seq of `queue`: the source of truth if wired, else the last event."""
        if self._last_seq_of is not None:
            seq = self._last_seq_of(queue)
            if seq is not None:
                return seq
        return self._last.get(queue)

    def unregister(self, proxy_id: str, queues: Iterable[str]) -> None:
        box = self._boxes.get(proxy_id)
        if box is None:
            return
        for q in queues:
            if q not in box.queues:
                continue
            box.queues.discard(q)
            box.pending.pop(q, None)
            subs = self._routes.get(q)
            if subs is not None:
                subs.discard(box)
                if not subs:
                    del self._routes[q]
                    self._last.pop(q, None)

    def drop(self, proxy_id: str) -> None:
        """Forget a proxy entirely (its connection is gone); wakes its reader to end."""
        box = self._boxes.get(proxy_id)
        if box is None:
            return
        self.unregister(proxy_id, list(box.queues))
        del self._boxes[proxy_id]
        box.close()

    def publish(self, events: Iterable[tuple[str, int]]) -> None:
        routes = self._routes
        last = self._last
        n = 0
        for q, seq in events:
            n += 1
            subs = routes.get(q)
            if subs is None:
                continue
            if seq > last.get(q, -1):
                last[q] = seq
            for box in subs:
                box.put(q, seq)
                self.routed += 1
        self.published += n

    def counts(self) -> tuple[int, int]:
        """(events routed into mailboxes, events handed out after coalescing) for /metrics;
        the difference is what coalescing saved (mailboxes of gone proxies are not counted)."""
        return self.routed, sum(b.delivered for b in self._boxes.values())

    def resync(self) -> int:
        """Re-announce the current last_seq of every routed queue to its proxies."""
        n = 0
        for q, subs in self._routes.items():
            seq = self.current(q)
            if seq is None or seq < 0:
                continue
            for box in subs:
                box.put(q, seq)
                n += 1
        return n

    def close(self) -> None:
        for pid in list(self._boxes):
            self.drop(pid)
