"""Why `/health` says 503: a once-a-second watch over the dispatcher and the latency probes.

The dispatcher is *stopped* when its task ended or it failed a LevelDB write (`LightQueues.
dispatch_running`), and *stuck* when it is behind and has indexed nothing for `dispatch_stall_ms`
(seen by this watch, which samples `Dispatcher.records` every second: no per-round cost, and a
burst that merely arrived between two rounds is not a stall). Probes: `Probe.problem()`. A change
of verdict is logged once (warning when it turns bad, info when it recovers), not every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightgate.app import Gateway

log = logging.getLogger("lightgate.health")

INTERVAL_S = 1.0


class HealthWatch:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._task: asyncio.Task[None] | None = None
        self._records = -1
        self._stuck_since: float | None = None
        self._last: list[str] = []

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="health-watch")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def reasons(self) -> list[str]:
        out: list[str] = []
        q = self.gw.queues
        if q is not None:
            if not q.dispatch_running:
                out.append("dispatcher stopped")
            elif self._stuck_since is not None:
                stalled = time.monotonic() - self._stuck_since
                if stalled * 1000 >= self.gw.cfg.dispatch_stall_ms:
                    out.append(
                        f"dispatcher stuck: {q.dispatcher.behind()} records behind, "
                        f"nothing indexed for {stalled:.0f} s"
                    )
        probe = self.gw.probe
        if probe is not None:
            problem = probe.problem()
            if problem:
                out.append(problem)
        return out

    def sample(self) -> None:
        q = self.gw.queues
        if q is not None:
            d = q.dispatcher
            records, behind = d.records, d.behind()
            if behind > 0 and records == self._records:
                if self._stuck_since is None:
                    self._stuck_since = time.monotonic() - INTERVAL_S
            else:
                self._stuck_since = None
            self._records = records
        reasons = self.reasons()
        kinds = [r.split(":")[0] for r in reasons]  # the figures in a reason change every second
        if kinds != self._last:
            if reasons:
                log.warning("unhealthy: %s", "; ".join(reasons), extra={"reasons": len(reasons)})
            elif self._last:
                log.info("healthy again")
            self._last = kinds

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(INTERVAL_S)
            try:
                self.sample()
                if self.gw.endpoints.get("http"):
                    await self.gw.figures.tick()  # a rate sample even when nobody looks
            except Exception:
                log.exception("health watch failed")
