"""Child process for the kill -9 tests: appends and dispatches until killed.

usage: python lightqueue_crash_child.py DATA_DIR MODE
  backlog: (first run) append BACKLOG records with no dispatcher, then dispatch them in small
           rounds, printing the records dispatched after every round.
  live:    append random messages continuously while the dispatcher runs.
Filters in FILTERS are acquired before the dispatcher starts, so they cover the whole log.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightqueue.queues import LightQueueConfig, LightQueues  # noqa: E402
from store import MqttMessage, Store, StoreConfig  # noqa: E402

FILTERS = ["+/+/temp", "site0/#", "#", "site1/dev1/+"]
PARTITIONS = 3
BATCH_RECORDS = 1500
BACKLOG = 60_000


def topic(rnd: random.Random) -> str:
    return f"site{rnd.randrange(3)}/dev{rnd.randrange(4)}/{rnd.choice(['temp', 'hum'])}"


async def main(data: Path, mode: str) -> None:
    store = await Store.open(data, StoreConfig(default_partitions=PARTITIONS, fsync="never"))
    rnd = random.Random()
    marker = data / "backlog-written"
    if mode == "backlog" and not marker.exists():
        for i in range(0, BACKLOG, 1000):
            store.append_mqtt(
                [MqttMessage(topic(rnd), b"%d" % (i + j), 1, "c") for j in range(1000)]
            )
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)
        marker.write_text("ok")
    done = 0

    def sink(events: list[tuple[str, int]]) -> None:
        pass

    lq = LightQueues.open(data, store, LightQueueConfig(dispatch_batch_records=BATCH_RECORDS), sink)
    for f in FILTERS:
        lq.acquire_filter(f)
    await lq.start()
    print("started", flush=True)
    n = 0
    while True:
        if mode == "live":
            store.append_mqtt(
                [MqttMessage(topic(rnd), b"%d" % n, 1, "c") for _ in range(rnd.randint(1, 300))]
            )
            n += 1
        await asyncio.sleep(0)
        pos = sum(lq.qdb.checkpoints.values())  # records indexed so far, over all runs
        if pos != done:
            done = pos
            print("dispatched", done, flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1]), sys.argv[2]))
