"""A latency histogram cheap enough for hot paths, exported by the gateway's Prometheus collector.

Why not `prometheus_client.Histogram`: its `observe` takes a lock and walks every bucket (about
1 us); this one is a `bisect` and two additions (about 0.15 us), and `observe(v, n)` records a
whole batch of equal latencies (one fsync's waiters, one pump's subscribers) at once. It lives in
`store`, the bottom of the import arrows, so every component can keep one; the wiring in
`lightgate/metrics.py` reads them at scrape time (and the MQTT proxy ships them over the core
link as `to_dict()`). Event-loop-only (no lock): each instance belongs to one loop.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Seconds; Prometheus `le` upper bounds (a value equal to a bound falls in that bucket).
BOUNDS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip
# The same bounds in whole milliseconds for ms-resolution timestamps (publish→deliver).
BOUNDS_MS: tuple[float, ...] = tuple(b * 1000 for b in BOUNDS)


class LatencyHistogram:
    """Bucket counts (last one: above every bound), sum and count, in seconds."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = BOUNDS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, seconds: float, n: int = 1, _bisect: Any = bisect_left) -> None:
        """Record `n` observations of `seconds`."""
        self.counts[_bisect(self.bounds, seconds)] += n
        self.sum += seconds * n

    def observe_ms(self, ms: int, n: int = 1, _bisect: Any = bisect_left) -> None:
        """Record `n` observations of `ms` milliseconds (integer timestamps' differences)."""
        self.counts[_bisect(BOUNDS_MS, ms)] += n
        self.sum += ms * n * 0.001

    @property
    def count(self) -> int:
        return sum(self.counts)

    def to_dict(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.sum}

    def merge(self, d: dict[str, Any]) -> None:
        """Add another histogram's `to_dict()` (same bounds)."""
        counts = d.get("counts") or []
        if len(counts) == len(self.counts):
            self.counts = [a + b for a, b in zip(self.counts, counts, strict=True)]
            self.sum += float(d.get("sum", 0.0))

    def quantile(self, q: float) -> float | None:
        """Estimated q-quantile (linear inside the bucket, as Prometheus' histogram_quantile);
        None when empty. Above the last bound: the last bound."""
        total = self.count
        if not total:
            return None
        rank = q * total
        seen = 0
        lo = 0.0
        for i, c in enumerate(self.counts):
            if i == len(self.bounds):
                return self.bounds[-1]
            hi = self.bounds[i]
            if c and seen + c >= rank:
                return lo + (hi - lo) * max(0.0, rank - seen) / c
            seen += c
            lo = hi
        return self.bounds[-1]
