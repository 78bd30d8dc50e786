"""Keep-alive and CONNECT deadlines of every connection on one event-loop timer.

A loop timer per connection (with uvloop, a libuv timer armed at accept, then cancelled and armed
again at CONNECT) was ~6 % of a connect's CPU in py-spy. Here a connection is filed in the slot
of its deadline (one slot per TICK_S) and one loop timer fires for the earliest slot; a check
runs at most TICK_S after its deadline (Mosquitto sweeps its keep alives the same way). The
connection's own check decides: close, or file itself again under its next deadline (a client
that kept talking is re-filed once per keep-alive period, a set move, not a timer).
"""

from __future__ import annotations

import asyncio
from heapq import heappop, heappush
from typing import Protocol

TICK_S = 0.25


class Watched(Protocol):
    ka_slot: int  # the slot it is filed in; 0 = none

    def _keepalive_check(self) -> None: ...


class KeepaliveWheel:
    __slots__ = ("_loop", "_slots", "_heap", "_armed", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._slots: dict[int, set[Watched]] = {}
        self._heap: list[int] = []  # slot numbers that have a set, earliest first
        self._armed = 0  # the slot the timer fires for; 0 = no timer
        self._handle: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return sum(len(s) for s in self._slots.values())

    def add(self, conn: Watched, deadline: float) -> None:
        """File `conn` to be checked at `deadline` (loop time), forgetting its former slot."""
        slot = -int(-deadline // TICK_S)  # the first tick at or after the deadline
        old = conn.ka_slot
        if old == slot:
            return
        if old:
            s = self._slots.get(old)
            if s is not None:
                s.discard(conn)
        conn.ka_slot = slot
        s = self._slots.get(slot)
        if s is None:
            s = self._slots[slot] = set()
            heappush(self._heap, slot)
        s.add(conn)
        if not self._armed or slot < self._armed:
            self._arm(slot)

    def remove(self, conn: Watched) -> None:
        old = conn.ka_slot
        if old:
            conn.ka_slot = 0
            s = self._slots.get(old)
            if s is not None:
                s.discard(conn)

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._armed = 0

    def _arm(self, slot: int) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._armed = slot
        self._handle = self._loop.call_at(slot * TICK_S, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._armed = 0
        now = self._loop.time()
        heap, slots = self._heap, self._slots
        while heap and heap[0] * TICK_S <= now:
            due = slots.pop(heappop(heap), None)
            if not due:
                continue
            for conn in due:
                conn.ka_slot = 0
            for conn in due:
                if not conn.ka_slot:  # (one filed again meanwhile is checked then)
                    conn._keepalive_check()
        if heap and not self._armed:
            # A timer may fire a little early: a slot still ahead is armed again, so is one a
            # check just filed into the past (a deadline that was already due).
            self._arm(heap[0])
