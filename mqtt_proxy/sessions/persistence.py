"""Writing persistent sessions to the session store (the light-queue DB): when, and what.

Dirty persistent sessions are written every `session_flush_ms` (`flush`), at disconnect and on
graceful close; a SUBSCRIBE or UNSUBSCRIBE writes its session before its ack (`save`); a stored
QoS 2 PUBLISH writes it before the PUBREC (`write_now`), and again before the PUBCOMP and an
outbound PUBREL, these per loop pass (`after_write`). A flush looks only at the connected
persistent sessions and the offline ones changed since their last write (`watched`), plus every
persistent session once in FULL_WALK_EVERY flushes: 100,000 offline sessions cost each flush
4 ms when it walked them all (docs/performance-history.md). The registry (manager.py) decides
which sessions are persistent and watched; this object only writes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from mqtt_proxy.ports import QueuesPort, SessionState
from mqtt_proxy.sessions.state import Session, Subscription

if TYPE_CHECKING:
    from mqtt_proxy.delivery.group_state import SharedGroup

FULL_WALK_EVERY = 100  # flushes (session_flush_ms each): every persistent session is looked at


class SessionWriter:
    def __init__(
        self, backend: QueuesPort, group_of: Callable[[Subscription], SharedGroup | None]
    ) -> None:
        """`group_of`: a `$share` member's group (delivery's), whose position it stores."""
        self._backend = backend
        self._group_of = group_of
        # The persistent sessions (possibly a few that stopped being persistent since).
        self.persistent: dict[str, Session] = {}
        # What `flush` walks: the connected persistent sessions and the offline ones with changes
        # not written yet (an offline session changes only at disconnect, when its will is
        # published, or at restore), so 10^5 offline persistent sessions cost a flush nothing;
        # every FULL_WALK_EVERY flushes it walks them all, in case a change came by another way.
        self.watched: set[Session] = set()
        self._flushes = 0
        # `after_write`: what waits for a session's next write, written once per loop pass.
        self._waiting: dict[Session, list[Callable[[], None]]] = {}

    def flush(self, force: bool = False) -> None:
        self._flushes += 1
        snapshot = force or self._flushes % 10 == 0
        full = force or self._flushes % FULL_WALK_EVERY == 0
        pool = self.persistent.values() if full else self.watched
        items = []
        written_offline = []
        for s in pool:
            if s.persistent and (s.dirty or (snapshot and s.conn is not None)):
                items.append(self.state(s))
                if s.conn is None:
                    written_offline.append(s)
        self._backend.save_sessions(items)
        if full:  # and whatever else has nothing left to write or is no longer registered
            persistent = self.persistent
            self.watched = {
                s
                for s in self.watched
                if (s.conn is not None or s.dirty) and persistent.get(s.client_id) is s
            }
        else:
            self.watched.difference_update(written_offline)

    def write_now(self, sessions: list[Session], done: Callable[[], None]) -> None:
        """Write these sessions' state at once (not at the next flush); `done` once written.
        A session no longer registered here (ended, or handed to another proxy) is not
        written: that would bring back a deleted one or overwrite its new owner's."""
        persistent = self.persistent
        items = [self.state(s) for s in sessions if persistent.get(s.client_id) is s]
        self._backend.save_sessions(items, done)

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

    def state(self, s: Session) -> tuple[str, SessionState]:
        """(client id, state to store); the session is clean afterwards."""
        s.dirty = False
        group_of = self._group_of
        for sub in s.subs.values():
            if sub.spec.share_group is not None and (g := group_of(sub)) is not None:
                sub.pos = g.acked_pos()  # a member stores its group's position
        return s.client_id, s.to_state()

    def save(self, session: Session, done: Callable[[], None]) -> None:
        """Write one persistent session now (SUBSCRIBE / UNSUBSCRIBE, before their ack), then
        `done`: a `kill -9` right after a SUBACK must not lose the subscription (the periodic
        flush runs every `session_flush_ms`). A LevelDB write without fsync, as every session
        write (lightqueue/session_store.py): the OS has it when `done` runs."""
        if session.persistent:
            self._backend.save_sessions([self.state(session)], done)
        else:
            done()
