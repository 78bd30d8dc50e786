"""Is this machine fit for a latency figure? A Python process doing small chunks of work with
short sleeps between them (the shape of a broker at 1k msg/s) times every chunk.

On 2026-11-27 (docs/performance-history.md) a chunk of ~0.27 ms ran 8-13x slower for 20-80 ms
every ~1.5 s, in pairs ~50 ms apart, with the process on the CPU the whole time (perf sched):
something outside the process slowed it down. In those windows every Python broker's messages
queue up (Lightgate's and amqtt's p99 at 1k msg/s went to 5-13 ms, Mosquitto's, which does ~50x
less work per message, to 0.7 ms). A p99 taken while this reports slow windows measures the
machine, not the broker.

Usage: python bench/machine_jitter.py [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import time


def _chunk(d: dict[int, int]) -> int:
    s = 0
    for i in range(2000):
        d[i % 97] = i
        s += i * i
    return s


def measure(seconds: float) -> dict[str, float | int]:
    d: dict[int, int] = {}
    times: list[tuple[float, float]] = []
    end = time.perf_counter() + seconds
    while (t := time.perf_counter()) < end:
        _chunk(d)
        times.append((t, time.perf_counter() - t))
        time.sleep(0.0005)
    ordered = sorted(x for _, x in times)
    med = ordered[len(ordered) // 2]
    slow = [(t, x) for t, x in times if x > 3 * med]
    windows: list[list[float]] = []  # [start, end] of runs of slow chunks less than 10 ms apart
    for t, x in slow:
        if windows and t - windows[-1][1] < 0.010:
            windows[-1][1] = t + x
        else:
            windows.append([t, t + x])
    return {
        "chunks": len(ordered),
        "chunk_median_ms": round(med * 1e3, 3),
        "chunk_p99_ms": round(ordered[int(len(ordered) * 0.99)] * 1e3, 3),
        "chunk_max_ms": round(ordered[-1] * 1e3, 3),
        "slow_chunks": len(slow),  # over 3x the median
        "slow_windows": len(windows),
        "slow_ms_total": round(sum(b - a for a, b in windows) * 1e3, 1),
        "worst_slowdown": round(ordered[-1] / med, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of a sentence")
    args = ap.parse_args()
    r = measure(args.seconds)
    if args.json:
        print(json.dumps({"ts": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **r}))
        return
    print(
        f"{r['chunks']} chunks, median {r['chunk_median_ms']} ms, p99 {r['chunk_p99_ms']} ms, "
        f"max {r['chunk_max_ms']} ms ({r['worst_slowdown']}x); {r['slow_windows']} slow windows "
        f"({r['slow_chunks']} chunks over 3x the median, {r['slow_ms_total']} ms in all)"
    )


if __name__ == "__main__":
    main()
