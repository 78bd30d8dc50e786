"""Replay queues: history from a time, then live on the same queue, no gap, no duplicate."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from lightqueue_helpers import flushed, open_all

from lightqueue.keys import KIND_REPLAY
from store import MqttMessage

NOW = int(time.time() * 1000)


def stamped(topic: str, i: int, ts: int) -> MqttMessage:
    return MqttMessage(topic, b"%d" % i, 1, "c", timestamp_ms=ts)


async def read_all(lq, queue: str) -> list[tuple[str, bytes]]:  # type: ignore[no-untyped-def]
    kind, start, nxt = lq.info(queue)
    res = lq.read(queue, start, nxt - start)
    return [(m.topic, m.payload) for m in lq.resolve(res.entries) if m]


async def test_history_then_live(tmp_path: Path) -> None:
    store, lq = await open_all(tmp_path, partitions=3)
    await lq.start()
    sent = []
    for i in range(100):
        m = stamped(f"a/{i % 4}", i, NOW - 100_000 + i * 1000)
        sent.append(m)
    store.append_mqtt(sent)
    await flushed(store)
    lq.dispatcher.catch_up()
    since = NOW - 100_000 + 50 * 1000
    acq = lq.acquire_filter("a/+", since_ms=since)
    assert acq.queue == f"$replay/{since}/a/+" and acq.start_seq == 0
    await lq.wait_live(acq.queue)
    assert lq.info(acq.queue)[0] == KIND_REPLAY  # type: ignore[index]
    # ... then live on the same queue.
    more = [stamped(f"a/{i % 4}", i, NOW + i) for i in range(100, 130)]
    store.append_mqtt(more)
    await flushed(store)
    lq.dispatcher.catch_up()
    got = await read_all(lq, acq.queue)
    want = [(m.topic, m.payload) for m in sent + more if m.timestamp_ms >= since]
    assert sorted(got) == sorted(want) and len(got) == len(want) == 80
    for t in {t for t, _ in want}:
        assert [g for g in got if g[0] == t] == [w for w in want if w[0] == t]
    # The same replay again shares the queue and starts at its first history entry.
    assert lq.acquire_filter("a/+", since_ms=since) == (acq.queue, 0)
    assert lq.held(acq.queue) == 2
    await lq.close()
    await store.close()


async def test_replay_while_appending_has_no_gap_and_no_duplicate(tmp_path: Path) -> None:
    # Small backfill steps: many steps, each racing the appender.
    store, lq = await open_all(
        tmp_path, partitions=3, dispatch_batch_records=500, backfill_step_records=700
    )
    await lq.start()
    i = 0
    hist = []
    while i < 20_000:
        batch = [stamped(f"s/{j % 7}/t", i + j, NOW - 50_000 + i + j) for j in range(1000)]
        hist += batch
        store.append_mqtt(batch)
        i += 1000
    await flushed(store)
    stop = asyncio.Event()
    live: list[MqttMessage] = []

    async def appender() -> None:
        n = 0
        while not stop.is_set():
            batch = [stamped(f"s/{k % 7}/t", 10**6 + n + k, NOW + n + k) for k in range(50)]
            live.extend(batch)
            store.append_mqtt(batch)
            n += 50
            await asyncio.sleep(0.001)

    task = asyncio.create_task(appender())
    await asyncio.sleep(0.01)
    since = NOW - 50_000 + 5_000
    acq = lq.acquire_filter("s/+/t", since_ms=since)
    assert acq.queue in lq._backfills  # 15k history records at 700 per step: not live at once
    await asyncio.wait_for(lq.wait_live(acq.queue), 60)
    await asyncio.sleep(0.05)
    stop.set()
    await task
    await flushed(store)
    lq.dispatcher.catch_up()
    got = await read_all(lq, acq.queue)
    want = [(m.topic, m.payload) for m in hist + live if m.timestamp_ms >= since]
    assert len(got) == len(want) and sorted(got) == sorted(want)
    for t in {t for t, _ in want}:
        assert [g for g in got if g[0] == t] == [w for w in want if w[0] == t]
    await lq.close()
    await store.close()


async def test_backfill_resumes_after_restart(tmp_path: Path) -> None:
    store, lq = await open_all(tmp_path, partitions=2, backfill_step_records=300)
    msgs = [stamped(f"r/{i % 3}/x", i, NOW - 10_000 + i) for i in range(3000)]
    store.append_mqtt(msgs)
    await flushed(store)
    lq.dispatcher.refresh()
    lq.dispatcher.catch_up()
    since = NOW - 10_000 + 1000
    # Not started: creating the replay queue runs one synchronous backfill step, then a task
    # that close() cancels before it runs, like a crash after the first committed step.
    acq = lq.acquire_filter("r/+/x", since_ms=since)
    partial = lq.info(acq.queue)[2]  # type: ignore[index]
    assert 0 < partial < 2000
    await lq.close()
    await store.close()
    store, lq = await open_all(tmp_path, partitions=2, backfill_step_records=300)
    await lq.start()
    await asyncio.wait_for(lq.wait_live(acq.queue), 30)
    got = await read_all(lq, acq.queue)
    want = [(m.topic, m.payload) for m in msgs if m.timestamp_ms >= since]
    assert len(got) == 2000 and sorted(got) == sorted(want)
    for t in {t for t, _ in want}:
        assert [g for g in got if g[0] == t] == [w for w in want if w[0] == t]
    await lq.close()
    await store.close()


async def test_replay_from_offsets_and_before_log_start(tmp_path: Path) -> None:
    store, lq = await open_all(tmp_path, partitions=1)
    await lq.start()
    store.append_mqtt([stamped("o/x", i, NOW + i) for i in range(10)])
    await flushed(store)
    lq.dispatcher.catch_up()
    acq = lq.acquire_filter("o/#", offsets={("o", 0): 7})
    assert acq.queue.startswith("$replay/@")
    await lq.wait_live(acq.queue)
    assert [p for _, p in await read_all(lq, acq.queue)] == [b"7", b"8", b"9"]
    # A time before the log start replays from the log start.
    acq2 = lq.acquire_filter("o/x", since_ms=0)
    await lq.wait_live(acq2.queue)
    assert len(await read_all(lq, acq2.queue)) == 10
    await lq.close()
    await store.close()


async def test_replay_queue_name_is_held_again(tmp_path: Path) -> None:
    store, lq = await open_all(tmp_path)
    await lq.start()
    acq = lq.acquire_filter("n/#", since_ms=123)
    await lq.wait_live(acq.queue)
    assert lq.acquire_filter(acq.queue) == acq  # a restored session holds it by name
    assert lq.held(acq.queue) == 2
    lq.release_filter(acq.queue)
    lq.release_filter(acq.queue)
    assert lq.gc(time.monotonic() + 3600) == 1
    again = lq.acquire_filter(acq.queue)  # dropped: re-created from its name, fresh sequences
    assert again.queue == acq.queue
    await lq.close()
    await store.close()


async def _append(store, lq, msgs: list[MqttMessage]) -> None:  # type: ignore[no-untyped-def]
    store.append_mqtt(msgs)
    await flushed(store)
    lq.dispatcher.catch_up()


async def test_plain_and_replays_of_one_filter_are_all_fed_live(tmp_path: Path) -> None:
    """A regression: a replay queue used to replace the plain queue (and any earlier replay) in the
    filter index, so only the replay created last got live records. Every queue that wants the
    filter's live records gets each of them, and dropping one leaves the others fed, also after a
    restart of the light queues."""
    store, lq = await open_all(tmp_path)
    await lq.start()
    plain = lq.acquire_filter("a/+")
    await _append(store, lq, [stamped("a/x", i, NOW - 10_000 + i) for i in range(2)])
    r1 = lq.acquire_filter("a/+", since_ms=NOW - 60_000)
    r2 = lq.acquire_filter("a/+", since_ms=NOW - 50_000)
    await lq.wait_live(r1.queue)
    await lq.wait_live(r2.queue)
    names = (plain.queue, r1.queue, r2.queue)
    assert [lq.last_seq(n) for n in names] == [1, 1, 1]  # plain saw both live; replays: history
    await _append(store, lq, [stamped(f"a/{t}", i, NOW + i) for i, t in enumerate("xyz")])
    assert [lq.last_seq(n) for n in names] == [4, 4, 4]
    for n in names:
        assert [p for _, p in await read_all(lq, n)] == [b"0", b"1", b"0", b"1", b"2"]
    # The first replay is released and dropped after its grace: the other two stay fed.
    lq.release_filter(r1.queue)
    assert lq.gc(time.monotonic() + 3600) == 1
    await _append(store, lq, [stamped("a/x", 9, NOW + 9)])
    assert lq.last_seq(plain.queue) == 5 and lq.last_seq(r2.queue) == 5
    # The last replay goes too: the plain queue is still fed.
    lq.release_filter(r2.queue)
    assert lq.gc(time.monotonic() + 3600) == 1
    await _append(store, lq, [stamped("a/x", 10, NOW + 10)])
    assert lq.last_seq(plain.queue) == 6
    # A restart rebuilds the index from the stored filters: plain + a new replay both fed.
    r3 = lq.acquire_filter("a/+", since_ms=NOW - 60_000)
    await lq.wait_live(r3.queue)
    await lq.close()
    await store.close()
    store, lq = await open_all(tmp_path)
    await lq.start()
    before = lq.last_seq(plain.queue), lq.last_seq(r3.queue)
    await _append(store, lq, [stamped("a/z", 11, NOW + 11)])
    assert (lq.last_seq(plain.queue), lq.last_seq(r3.queue)) == (before[0] + 1, before[1] + 1)
    await lq.close()
    await store.close()
