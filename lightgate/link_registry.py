"""One table of the core link's methods, and the numbers of the wiring's own.

Every part of the link brings its methods as `{number: handler}`: the services in the core
(lightgate.link_services), the clients in a proxy (mqtt_proxy.remote_*), the wiring (HELLO,
STATS). Each end builds its one table with `MethodRegistry`, which refuses a number taken
twice: a dict merge would let the later part win silently and route its frames to the wrong
handler.

Method numbers (u16), by the module that defines the bodies:

    1-31   store          store.wire       TOPICS .. TOPIC_CHANGED (1-7)
    32-63  light queues   lightqueue.wire  READ .. ENTRIES (32-44)
    64-95  the wiring     here             HELLO (64), STATS (65)
                          notify.wire      REGISTER, UNREGISTER, EVENTS (66-68)
    200-209 several proxies mqtt_proxy.backends.cluster CLAIM, TAKE, WILL, GONE (200-203): client ids
                          (lightgate.owners); LEASE, DONE, RETURN, WAKE (204-207): `$share`
                          groups (lightgate.shares); SYS (208): summed `$SYS` figures;
                          LAG (209): delivery lag, flow control across proxies
"""

from __future__ import annotations

from collections.abc import Mapping

from notify.link import Handler

HELLO, STATS = 64, 65  # proxy → core: its id (one-way); core → proxy: its counters (JSON)


class DuplicateMethodError(ValueError):
    """Two parts of one end of the link claim the same method number."""


class MethodRegistry:
    """Method number → handler for one end of the link; `add` raises on a number taken twice."""

    def __init__(self) -> None:
        self._methods: dict[int, Handler] = {}
        self._owners: dict[int, str] = {}

    def add(self, owner: str, methods: Mapping[int, Handler]) -> MethodRegistry:
        """Add `owner`'s methods (all or none); returns self so calls chain."""
        for number in methods:
            if not 0 < number <= 0xFFFF:
                raise ValueError(f"{owner}: method number {number} is not a u16 above 0")
            if number in self._owners:
                raise DuplicateMethodError(
                    f"method {number} of {owner} is already taken by {self._owners[number]}"
                )
        for number, handler in methods.items():
            self._methods[number] = handler
            self._owners[number] = owner
        return self

    def owner(self, number: int) -> str | None:
        return self._owners.get(number)

    def table(self) -> dict[int, Handler]:
        """The table the link dispatches on (a copy: later `add`s do not change it)."""
        return dict(self._methods)
