"""A `$share` group's state: its position, members and what is in flight to them. Kept apart
from the group delivery that drives it (shared_groups.py) so that a queue's state
(queue_cache.py) can hold its groups without importing the delivery around them."""

from __future__ import annotations

from dataclasses import dataclass, field

from mqtt_proxy.sessions.state import Session, Subscription


@dataclass(slots=True, eq=False)
class SharedGroup:
    """`$share/<group>/<filter>`: one position, each message to one member."""

    key: str  # "<group>/<filter>"
    queue: str
    pos: int = 0
    members: list[Subscription] = field(default_factory=list)
    pending: dict[int, tuple[Session, int]] = field(default_factory=dict)  # seq -> (session, pid)
    redeliver: list[int] = field(default_factory=list)  # seqs orphaned by a leaving member
    rr: int = 0
    # Several proxies: the sequences the core leased to this proxy (its members take them in
    # order; see lightgate/shares.py), None when the group lives in this proxy alone.
    lease: list[int] | None = None
    asking: bool = False  # a LEASE is on its way
    again: bool = False  # the queue grew while it was: ask once more when it is answered

    def acked_pos(self) -> int:
        low = self.pos
        if self.pending:
            low = min(low, min(self.pending))
        if self.redeliver:
            low = min(low, min(self.redeliver))
        return low
