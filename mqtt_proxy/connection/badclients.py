"""One log line per bad connection (garbage, a refused WebSocket handshake, no CONNECT in time),
rate-limited so that a scanner or a flood cannot fill the disk with them.

Up to `burst` lines are written per `window_s`; beyond that the lines are counted per listener
and written as one summary when the window ends (`flush`, called by the server's periodic task).
"""

from __future__ import annotations

import logging

from store.connlog import LogWindow


class BadClientLog:
    __slots__ = ("_log", "_window_s", "_window", "total")

    def __init__(self, log: logging.Logger, burst: int = 20, window_s: float = 10.0) -> None:
        self._log = log
        self._window_s = window_s
        self._window = LogWindow(burst, window_s, self._summary)
        self.total = 0  # bad connections seen since start (for metrics)

    def bad(self, listener: str, peer: str, reason: str, **extra: object) -> None:
        """Record one bad connection from `peer` on `listener`; logs it unless over the rate."""
        self.total += 1
        if self._window.admit(listener):
            tail = "".join(f" {k}={v!r}" for k, v in extra.items() if v not in (None, ""))
            self._log.warning("bad connection on %s from %s: %s%s", listener, peer, reason, tail)

    def flush(self, now: float | None = None) -> None:
        """Write the summary of suppressed lines once their window has ended."""
        self._window.flush(now)

    def _summary(self, suppressed: dict[str, int]) -> None:
        for listener, n in suppressed.items():
            self._log.warning(
                "bad connection on %s: %d more in the last %g s not logged one by one",
                listener,
                n,
                self._window_s,
            )
