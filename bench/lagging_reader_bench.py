"""A subscriber far behind its light queue (a QoS 1 reader of a fan-in): µs per message to read its
entries, resolve them to messages through the store and fill delivery's cache, cold.

    .venv/bin/python bench/lagging_reader_bench.py [--records 200000] [--batch 256] [--repeat 3]
        [--tick 1000]

One process, a real Store (fsync never) and LevelDB in a temp dir: `--records` plain MQTT
messages on 10 topics, appended `--tick` at a time (one append per pass of the loop, as the MQTT
proxy's tick: at full fan-in speed a tick holds ~25,000 messages, so its batches are as big as
MQTT_BATCH_BYTES allows), indexed into the filter queue `f/+`, then read back `--batch` entries at
a time as `Delivery.load` does (LightQueues.read, LightQueues.resolve, fill_cache), the
resolver's cache emptied before each pass. LIGHTGATE_NO_EXTENSIONS=1 measures the pure twins.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightqueue.queues import LightQueueConfig, LightQueues  # noqa: E402
from mqtt_proxy.delivery.queue_cache import RAW_TYPES, CachedMsg, fill_cache  # noqa: E402
from store import MqttMessage, Store, StoreConfig  # noqa: E402


async def main(records: int, batch: int, repeat: int, tick: int) -> None:
    d = Path(tempfile.mkdtemp(prefix="lagbench"))
    try:
        store = await Store.open(d, StoreConfig(default_partitions=1, fsync="never"))
        t_write = 0.0
        for _ in range(0, records, tick):
            msgs = [MqttMessage(f"f/t{j % 10}", b"x" * 16, 1, f"pub{j % 10}") for j in range(tick)]
            t0 = time.perf_counter()
            store.append_mqtt(msgs)
            store.write_now()
            t_write += time.perf_counter() - t0
            await asyncio.sleep(0)
        await asyncio.sleep(0.05)
        lq = LightQueues.open(d, store, LightQueueConfig())
        lq.acquire_filter("f/+")
        lq.qdb.queues["f/+"].start = 0  # the reader starts at the first record
        lq.dispatcher.refresh()
        t0 = time.perf_counter()
        lq.dispatcher.catch_up()
        t_index = time.perf_counter() - t0
        print(f"write (build, append) {1e6 * t_write / records:.2f}  index {1e6 * t_index / records:.2f}"
              "  µs per message")  # fmt: skip
        info = lq.info("f/+")
        assert info is not None and info[2] >= records, info
        for _ in range(repeat):
            lq.resolver.clear()
            t_read = t_resolve = t_fill = 0.0
            seq, total = info[1], 0
            while seq < info[2]:
                t0 = time.perf_counter()
                r = lq.read("f/+", seq, batch)
                t1 = time.perf_counter()
                msgs = lq.resolve(r.entries)
                t2 = time.perf_counter()
                fill_cache(
                    CachedMsg, msgs, {}, r.first_seq, "__lightgate", "__lightgate_probe/", RAW_TYPES
                )
                t3 = time.perf_counter()
                t_read, t_resolve, t_fill = t_read + t1 - t0, t_resolve + t2 - t1, t_fill + t3 - t2
                total += len(r.entries)
                seq = r.first_seq + len(r.entries)
            us = 1e6 / total
            print(f"read {t_read * us:.2f}  resolve {t_resolve * us:.2f}  fill {t_fill * us:.2f}"
                  f"  µs per message ({total} messages)")  # fmt: skip
        await lq.close()
        await store.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tick", type=int, default=1000, help="messages per append")
    a = ap.parse_args()
    asyncio.run(main(a.records, a.batch, a.repeat, a.tick))
