"""One log line per connection lifecycle event (connected, refused, closed), each naming the
connection id, rate-limited the way `BadClientLog` is: a connect storm writes a summary, not a
line per client.

At most `per_s` lines per one-second window; past that, events are counted by kind and written as
one summary line when the window ends (`flush`, from the server's periodic task, or the next
event). `per_s = 0` logs none. Connection ids (`c1`, `c2`, ...) are per proxy process and also
appear on the bad-connection lines, so one client's lines can be followed.
"""

from __future__ import annotations

import logging
import time


class ConnLog:
    __slots__ = ("_log", "_per_s", "_window_end", "_written", "_suppressed", "_next")

    def __init__(self, log: logging.Logger, per_s: int = 20) -> None:
        self._log = log
        self._per_s = per_s
        self._window_end = 0.0
        self._written = 0
        self._suppressed: dict[str, int] = {}
        self._next = 0

    def new_id(self) -> str:
        self._next += 1
        return f"c{self._next}"

    def event(self, kind: str, conn_id: str, fmt: str, *args: object) -> None:
        """`kind` (connected / refused / closed) of `conn_id`; `fmt % args` says the rest."""
        if self._per_s <= 0:
            return
        now = time.monotonic()
        if now >= self._window_end:
            self.flush(now)
            self._window_end = now + 1.0
            self._written = 0
        if self._written < self._per_s:
            self._written += 1
            self._log.info(f"{kind} {conn_id} " + fmt, *args, extra={"conn": conn_id})
        else:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1

    def flush(self, now: float | None = None) -> None:
        """The summary of the events not logged one by one, once their window has ended."""
        if not self._suppressed:
            return
        if now is None:
            now = time.monotonic()
        if now < self._window_end:
            return
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(self._suppressed.items()))
        total = sum(self._suppressed.values())
        self._log.info(
            "connection log: %d more events in the last second not logged one by one (%s)",
            total,
            counts,
        )
        self._suppressed.clear()
