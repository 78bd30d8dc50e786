"""One log line per bad connection (garbage, a refused WebSocket handshake, no CONNECT in time),
rate-limited so that a scanner or a flood cannot fill the disk with them.

Up to `burst` lines are written per `window_s`; beyond that the lines are counted per listener
and written as one summary when the window ends (`flush`, called by the server's periodic task).
"""

from __future__ import annotations

import logging
import time


class BadClientLog:
    __slots__ = ("_log", "_burst", "_window_s", "_window_end", "_written", "_suppressed", "total")

    def __init__(self, log: logging.Logger, burst: int = 20, window_s: float = 10.0) -> None:
        self._log = log
        self._burst = burst
        self._window_s = window_s
        self._window_end = 0.0
        self._written = 0
        self._suppressed: dict[str, int] = {}
        self.total = 0  # bad connections seen since start (for metrics)

    def bad(self, listener: str, peer: str, reason: str, **extra: object) -> None:
        """Record one bad connection from `peer` on `listener`; logs it unless over the rate."""
        self.total += 1
        now = time.monotonic()
        if now >= self._window_end:
            self.flush(now)
            self._window_end = now + self._window_s
            self._written = 0
        if self._written < self._burst:
            self._written += 1
            tail = "".join(f" {k}={v!r}" for k, v in extra.items() if v not in (None, ""))
            self._log.warning("bad connection on %s from %s: %s%s", listener, peer, reason, tail)
        else:
            self._suppressed[listener] = self._suppressed.get(listener, 0) + 1

    def flush(self, now: float | None = None) -> None:
        """Write the summary of suppressed lines once their window has ended."""
        if not self._suppressed:
            return
        if now is None:
            now = time.monotonic()
        if now < self._window_end:
            return
        for listener, n in sorted(self._suppressed.items()):
            self._log.warning(
                "bad connection on %s: %d more in the last %g s not logged one by one",
                listener,
                n,
                self._window_s,
            )
        self._suppressed.clear()
