"""Light queues when a log topic is deleted: nothing keeps pointing at its offsets, because a
topic re-created under the same name reuses them for other records."""

from __future__ import annotations

from pathlib import Path

from lightqueue_helpers import flushed, msg, open_all


async def payloads(lq, queue: str) -> list[bytes]:  # type: ignore[no-untyped-def]
    kind, start, nxt = lq.info(queue)
    res = lq.read(queue, start, nxt - start)
    return [m.payload for m in lq.resolve(res.entries) if m is not None]


async def test_deleted_topic_entries_are_void_and_a_new_topic_is_indexed_fresh(
    tmp_path: Path,
) -> None:
    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.acquire_filter("d/+")
    store.append_mqtt([msg("d/x", b"old%d" % i) for i in range(5)] + [msg("k/x", b"keep")])
    lq.retained.set("d/x", b"old-retained", 1)
    lq.retained.set("k/x", b"keep-retained", 1)
    await flushed(store)
    lq.dispatcher.catch_up()
    assert await payloads(lq, "d/x") == [b"old%d" % i for i in range(5)]
    await store.delete_topic("d")
    # Entries of the deleted topic read as void; the queues and their sequences stay.
    assert await payloads(lq, "d/x") == [] and await payloads(lq, "d/+") == []
    assert lq.retained.get("d/x") is None and lq.retained.get("k/x") is not None
    assert ("d", 0) not in lq.qdb.checkpoints and ("d", 0) not in lq.dispatcher.hwm
    # The same MQTT topic again re-creates the log topic from offset 0: only new records show.
    store.append_mqtt([msg("d/x", b"new%d" % i) for i in range(2)])
    await flushed(store)
    lq.dispatcher.catch_up()
    assert store.high_watermark("d", 0) == 2
    assert await payloads(lq, "d/x") == [b"new0", b"new1"]
    assert await payloads(lq, "d/+") == [b"new0", b"new1"]
    assert await payloads(lq, "k/x") == [b"keep"]
    await lq.close()
    await store.close()
    # After a restart the retired id stays retired and the new topic's checkpoint is right.
    store, lq = await open_all(tmp_path)
    await lq.start()
    assert await payloads(lq, "d/x") == [b"new0", b"new1"]
    store.append_mqtt([msg("d/x", b"new2")])
    await flushed(store)
    lq.dispatcher.catch_up()
    assert await payloads(lq, "d/x") == [b"new0", b"new1", b"new2"]
    await lq.close()
    await store.close()


async def test_delete_records_moves_queues_past_the_new_log_start(tmp_path: Path) -> None:
    store, lq = await open_all(tmp_path)
    await lq.start()
    store.append_mqtt([msg("r/x", b"%d" % i) for i in range(10)])
    await flushed(store)
    lq.dispatcher.catch_up()
    await store.delete_records("r", 0, 6)
    assert await payloads(lq, "r/x") == [b"6", b"7", b"8", b"9"]
    kind, start, nxt = lq.info("r/x")
    assert (start, nxt) == (6, 10)
    await lq.close()
    await store.close()
