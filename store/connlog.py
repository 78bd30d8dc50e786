"""One log line per connection lifecycle event (connected, refused, closed), each naming the
connection id, rate-limited the way `mqtt_proxy.connection.badclients.BadClientLog` is: a connect storm
writes a summary, not a line per client. Used by the MQTT proxy (ids `c1`, `c2`, ...; also on its
bad-connection lines) and the Kafka listener (`k1`, ...); it lives in `store`, the bottom of the
import arrows, so both can.

At most `per_s` lines per one-second window; past that, events are counted by kind and written as
one summary line when the window ends (a timer, or `flush` from a periodic task, or the next
event, whichever comes first). `per_s = 0` logs none. Event-loop-only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable


class LogWindow:
    """The rate limit both logs share: up to `burst` lines per `window_s`; past that, events are
    counted per key and handed to `summary` once the window has ended (`flush`: called by the
    next event, a periodic task, or with `timer` a call_later set at the first suppressed one)."""

    __slots__ = ("_burst", "_window_s", "_summary", "_timer", "_end", "_written", "_suppressed")

    def __init__(
        self,
        burst: int,
        window_s: float,
        summary: Callable[[dict[str, int]], None],
        timer: bool = False,
    ) -> None:
        self._burst = burst
        self._window_s = window_s
        self._summary = summary
        self._timer = timer
        self._end = 0.0
        self._written = 0
        self._suppressed: dict[str, int] = {}

    def admit(self, key: str) -> bool:
        """True: write this line; False: it was counted under `key` for the summary."""
        now = time.monotonic()
        if now >= self._end:
            self.flush(now)
            self._end = now + self._window_s
            self._written = 0
        if self._written < self._burst:
            self._written += 1
            return True
        if self._timer and not self._suppressed:  # the summary is due when this window ends
            asyncio.get_running_loop().call_later(self._end - now + 0.01, self.flush)
        self._suppressed[key] = self._suppressed.get(key, 0) + 1
        return False

    def flush(self, now: float | None = None) -> None:
        """The summary of the events not logged one by one, once their window has ended."""
        if not self._suppressed:
            return
        if now is None:
            now = time.monotonic()
        if now < self._end:
            return
        self._summary(dict(sorted(self._suppressed.items())))
        self._suppressed.clear()


class ConnLog:
    __slots__ = ("_log", "_per_s", "_window", "_next", "_prefix")

    def __init__(self, log: logging.Logger, per_s: int = 20, prefix: str = "c") -> None:
        self._log = log
        self._per_s = per_s
        self._window = LogWindow(per_s, 1.0, self._summary, timer=True)
        self._next = 0
        self._prefix = prefix

    def new_id(self) -> str:
        self._next += 1
        return f"{self._prefix}{self._next}"

    def event(self, kind: str, conn_id: str, fmt: str, *args: object) -> None:
        """`kind` (connected / refused / closed) of `conn_id`; `fmt % args` says the rest."""
        if self._per_s <= 0:
            return
        if self._window.admit(kind):
            self._log.info(f"{kind} {conn_id} " + fmt, *args, extra={"conn": conn_id})

    def flush(self, now: float | None = None) -> None:
        """The summary of the events not logged one by one, once their window has ended."""
        self._window.flush(now)

    def _summary(self, suppressed: dict[str, int]) -> None:
        counts = ", ".join(f"{n} {kind}" for kind, n in suppressed.items())
        self._log.info(
            "connection log: %d more events in the last second not logged one by one (%s)",
            sum(suppressed.values()),
            counts,
        )
