"""Store benchmarks: raw Kafka batch append, MQTT build+append, fsync-always group commit.

    .venv/bin/python bench/store_bench.py                 # all three, ~20 s
    .venv/bin/python bench/store_bench.py raw --seconds 5
    .venv/bin/python bench/store_bench.py --profile mqtt  # pyinstrument report of one scenario

Each scenario opens a fresh Store in a temporary data dir (on the same disk as the repo unless
--dir is given) and runs on one event loop (one core; fsyncs run in the store's worker threads).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from store import MqttMessage, Store, StoreConfig  # noqa: E402
from store.record_batch import build_batch  # noqa: E402


async def bench_raw(
    data: Path, seconds: float, batch_kib: int = 64, record_bytes: int = 1024
) -> str:
    """Kafka producer batches (pre-built, uncompressed) appended under fsync `interval_ms`."""
    store = await Store.open(data, StoreConfig(default_partitions=4, fsync="interval_ms"))
    n = batch_kib * 1024 // (record_bytes + 20)
    now = int(time.time() * 1000)
    batch = bytes(
        build_batch([(now, b"key-%d" % i, os.urandom(record_bytes), []) for i in range(n)])
    )
    total = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    last = None
    while time.perf_counter() < deadline:
        for _ in range(16):  # 16 producer batches per tick, spread over 4 partitions
            for p in range(4):
                last = store.append_batch("raw", p, batch)
                total += len(batch)
        await asyncio.sleep(0)
    assert last is not None
    await last.durable
    dt = time.perf_counter() - t0
    await store.close()
    return (
        f"raw Kafka batch append (interval_ms, {batch_kib} KiB batches of {n} x {record_bytes} B): "
        f"{total / dt / 1e6:.0f} MB/s ({total / 1e6:.0f} MB in {dt:.1f} s)"
    )


async def bench_mqtt(data: Path, seconds: float) -> str:
    """append_mqtt of 1000 messages (100-byte payloads, 200 MQTT topics, 4 partitions) per call."""
    store = await Store.open(data, StoreConfig(default_partitions=4, fsync="interval_ms"))
    payload = b"p" * 100
    calls = [
        [
            MqttMessage(f"site/dev{(k * 1000 + i) % 200}/temp", payload, 1, f"dev{i % 200}")
            for i in range(1000)
        ]
        for k in range(8)
    ]
    msgs = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    last = None
    k = 0
    while time.perf_counter() < deadline:
        last = store.append_mqtt(calls[k & 7])
        k += 1
        msgs += 1000
        await asyncio.sleep(0)  # one call per tick: every call is its own write
    assert last is not None
    await last.durable
    dt = time.perf_counter() - t0
    await store.close()
    return f"MQTT build+append (interval_ms, 1000 x 100 B per call): {msgs / dt / 1e3:.0f}k msg/s"


async def bench_fsync(data: Path, seconds: float, appenders: int = 100, per_append: int = 1) -> str:
    """`appenders` tasks, each: append_mqtt(per_append messages), await durable, repeat."""
    store = await Store.open(data, StoreConfig(default_partitions=4, fsync="always"))
    payload = b"p" * 100
    count = 0
    stop = False

    async def appender(a: int) -> None:
        nonlocal count
        msgs = [MqttMessage(f"site/dev{a}/m{j}", payload, 1, f"dev{a}") for j in range(per_append)]
        while not stop:
            await store.append_mqtt(msgs).durable
            count += per_append

    tasks = [asyncio.create_task(appender(a)) for a in range(appenders)]
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    stop = True
    await asyncio.gather(*tasks)
    dt = time.perf_counter() - t0
    await store.close()
    return (
        f"fsync always, group commit, {appenders} appenders x {per_append} msg/append: "
        f"{count / dt / 1e3:.1f}k msg/s"
    )


def fsync_latency(directory: Path) -> str:
    path = directory / "fsync.probe"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        os.write(fd, b"x" * 100)
        os.fdatasync(fd)
        n += 1
    os.close(fd)
    path.unlink()
    return (
        f"disk: one append+fdatasync takes {1000 * (time.perf_counter() - t0) / n:.2f} ms ({n}/s)"
    )


SCENARIOS: dict[str, Callable[..., Awaitable[str]]] = {
    "raw": bench_raw,
    "mqtt": bench_mqtt,
    "fsync": bench_fsync,
}


async def run(names: list[str], seconds: float, base: Path) -> None:
    print(fsync_latency(base), flush=True)
    for name in names:
        data = Path(tempfile.mkdtemp(prefix=f"store-bench-{name}-", dir=base))
        try:
            print(await SCENARIOS[name](data, seconds), flush=True)
            if name == "fsync":
                print(await bench_fsync(data / "b", seconds, per_append=4), flush=True)
        finally:
            shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("scenario", nargs="*", choices=[*SCENARIOS, []], default=[])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--dir", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--profile", action="store_true", help="pyinstrument the run")
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = ap.parse_args()
    names = args.scenario or list(SCENARIOS)
    if args.uvloop:
        import uvloop

        uvloop.install()
    if args.profile:
        from pyinstrument import Profiler

        with Profiler() as prof:
            asyncio.run(run(names, args.seconds, args.dir))
        prof.print()
    else:
        asyncio.run(run(names, args.seconds, args.dir))


if __name__ == "__main__":
    main()
