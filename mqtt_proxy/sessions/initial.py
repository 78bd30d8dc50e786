"""What a new subscription gets at once, before delivery takes it over: the retained messages
its filter matches (fed page by page by `RetainedFeed`, as the client takes them), or the
current `$SYS` values for a `$SYS` filter."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mqtt_proxy.ports import QueuesPort
from mqtt_proxy.sessions.retained_feed import RetainedFeed
from mqtt_proxy.sessions.state import Subscription

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
        """What new subscriptions get at once: retained messages, or `$SYS` values. `done` runs
        once each has its first page written (in order); each is released to delivery when
        its last retained message is written."""
        pending = [len(subs) + 1]

        def one_started() -> None:
            pending[0] -= 1
            if pending[0] == 0:
                done()

        for sub in subs:
            if sub.local:
                assert self.sys is not None
                self.sys.send_current(sub)
                self._release(sub)
                one_started()
            else:
                self.send_retained(sub, one_started, self._release)
        one_started()

    def _release(self, sub: Subscription) -> None:
        sub.held = False
        if sub.session.conn is not None and not sub.local:
            qs = self._delivery.queues.get(sub.queue)
            if qs is not None:
                self._delivery.mark(qs)

    def send_retained(
        self,
        sub: Subscription,
        started: Callable[[], None],
        finished: Callable[[Subscription], None],
    ) -> None:
        if sub.session.conn is None:
            started()
            finished(sub)
            return
        RetainedFeed(self._backend.retained_page, sub, started, lambda: finished(sub)).start()
