"""`InProcessNotifier`: the embedded default, dispatcher and proxies on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING

from notify.router import QueueEvent, RouteTable

if TYPE_CHECKING:
    from notify.router import Notifier


class InProcessNotifier:
    """Notifier over a `RouteTable`; also the route table the core link serves remote proxies from.

    `last_seq_of(queue)` (e.g. the light queues' `last_seq`) lets `resync` and registration
    announce the true current sequence; without it the last published one is used.
    Event-loop-only.
    """

    def __init__(
        self,
        last_seq_of: Callable[[str], int | None] | None = None,
        resync_interval: float | None = 5.0,
    ) -> None:
        self.routes = RouteTable(last_seq_of)
        self._resync_interval = resync_interval
        self._resync_task: asyncio.Task[None] | None = None

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = False) -> None:
        self.routes.register(proxy_id, queues, announce)

    def unregister(self, proxy_id: str, queues: Iterable[str]) -> None:
        self.routes.unregister(proxy_id, queues)

    def drop(self, proxy_id: str) -> None:
        self.routes.drop(proxy_id)

    def publish(self, events: Iterable[tuple[str, int]]) -> None:
        self.routes.publish(events)

    def skip_known(self, proxy_id: str, known: Callable[[str, int], bool] | None) -> None:
        """Events `known(queue, last_seq)` says `proxy_id` has are not put in its mailbox: a
        proxy in this process gets a round's entries pushed before its events are published."""
        self.routes.mailbox(proxy_id).known = known

    def resync(self) -> int:
        return self.routes.resync()

    async def events(self, proxy_id: str) -> AsyncIterator[QueueEvent]:
        """Coalesced events for `proxy_id` until it is dropped or the notifier closes."""
        box = self.routes.mailbox(proxy_id)
        while True:
            await box.wait()
            if box.closed and not box.pending:
                return
            for q, seq in box.take().items():
                yield QueueEvent(q, seq)

    async def batches(self, proxy_id: str) -> AsyncIterator[dict[str, int]]:
        """Like `events`, one dict queue → last_seq per wake-up (cheaper for busy proxies)."""
        box = self.routes.mailbox(proxy_id)
        while True:
            await box.wait()
            if box.closed and not box.pending:
                return
            yield box.take()

    def start(self) -> None:
        """Start the periodic resync (covers events lost by a transport)."""
        if self._resync_interval and self._resync_task is None:
            self._resync_task = asyncio.get_running_loop().create_task(self._resync_loop())

    async def _resync_loop(self) -> None:
        assert self._resync_interval
        while True:
            await asyncio.sleep(self._resync_interval)
            self.routes.resync()

    async def close(self) -> None:
        t, self._resync_task = self._resync_task, None
        if t is not None:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.routes.close()


if TYPE_CHECKING:

    def _is_a_notifier(n: InProcessNotifier) -> Notifier:
        return n  # mypy: the in-process notifier is the whole interface
