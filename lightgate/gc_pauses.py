"""CPython's garbage collections in the gateway: timed, and the start-up heap left out of them.

A collection stops the event loop while it runs, so its length is a latency every connection
sees. A full collection walks every tracked object, and about 51,000 of them exist once the
gateway's modules are imported (17-20 ms a collection on the project machine,
`docs/performance-history.md`): `freeze_startup_heap` moves everything alive when the gateway is
ready into CPython's permanent generation (`gc.freeze`), which later collections skip; those
objects live as long as the process anyway. `GcPauses` times each collection (`gc.callbacks`)
into the `lightgate_gc_pause_seconds` histogram.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from store.latency import LatencyHistogram


class GcPauses:
    """One observation per collection (any generation) of this process."""

    def __init__(self) -> None:
        self.histogram = LatencyHistogram()
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.histogram.observe(time.perf_counter() - self._t0)

    def install(self) -> GcPauses:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self


def freeze_startup_heap() -> int:
    """Collect once, then freeze what is left (see the module docstring); returns how many
    objects later collections will skip."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
