"""Store API: append (MQTT and Kafka bytes), read, durable futures, reopen, lock, refusals."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from store import (
    InvalidRecordError,
    MqttMessage,
    MqttProperties,
    OffsetOutOfRangeError,
    Store,
    StoreConfig,
    StoreLockedError,
    TopicMappingError,
)
from store.mapping import mqtt_view, partition_for_key
from store.record_batch import build_batch, iter_batches, iter_records


def records(data: bytes) -> list:
    return [r for pos, size in iter_batches(data) for r in iter_records(data[pos : pos + size])]


def read_all(store: Store, topic: str, partition: int) -> list:
    out, off = [], store.log_start_offset(topic, partition)
    while off < store.high_watermark(topic, partition):
        data = store.read(topic, partition, off, 1 << 20)
        recs = [r for r in records(data) if r.offset >= off]
        out += recs
        off = recs[-1].offset + 1
    return out


async def test_append_mqtt_read_back(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=3))
    props = MqttProperties(content_type="text/plain", user_properties=(("a", "1"), ("mqtt.x", "2")))
    msgs = [
        MqttMessage(f"plant/m{i % 5}/t", b"p%d" % i, i % 3, "c1", timestamp_ms=1000 + i)
        for i in range(50)
    ]
    msgs.append(MqttMessage("plant/m0/t", b"last", 1, "c2", retain=True, properties=props))
    res = store.append_mqtt(msgs)
    assert not res.durable.done()
    await asyncio.wait_for(res.durable, 5)
    assert store.topics() == {"plant": 3}
    by_part: dict[int, list[int]] = {}
    for i, (topic, part, off) in enumerate(res.offsets):
        assert topic == "plant"
        assert part == partition_for_key(msgs[i].topic.encode(), 3)
        by_part.setdefault(part, []).append(off)
    for part, offs in by_part.items():
        assert offs == list(range(len(offs)))  # input order, contiguous
        assert store.high_watermark("plant", part) == len(offs)
        recs = read_all(store, "plant", part)
        assert [r.offset for r in recs] == offs
    last = res.offsets[-1]
    rec = [r for r in read_all(store, "plant", last[1]) if r.offset == last[2]][0]
    assert rec.key == b"plant/m0/t" and rec.value == b"last"
    view = mqtt_view("plant", rec.key, rec.headers)
    assert (view.topic, view.qos, view.client_id, view.retain) == ("plant/m0/t", 1, "c2", True)
    assert view.properties == props
    first = [r for r in read_all(store, "plant", res.offsets[0][1]) if r.offset == 0][0]
    assert first.timestamp == 1000 and first.headers == [
        ("mqtt.qos", b"0"),
        ("mqtt.client_id", b"c1"),
    ]
    await store.close()


async def test_append_batch_offsets_and_reopen(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=2))
    b = bytes(build_batch([(5, b"k", b"v%d" % i, [("h", None)]) for i in range(4)], base_offset=77))
    r1 = store.append_batch("orders", 1, b)
    r2 = store.append_batch("orders", 1, b)
    assert [o for _, _, o in r1.offsets] == [0, 1, 2, 3]
    assert r2.offsets[0] == ("orders", 1, 4) and r2.offsets[-1] == ("orders", 1, 7)
    await asyncio.gather(r1.durable, r2.durable)
    data = store.read("orders", 1, 5, 1)  # one whole batch even when max_bytes is smaller
    assert data[8:] == b[8:] and int.from_bytes(data[:8], "big") == 4  # only base offset differs
    assert store.read("orders", 1, 8, 100) == b""
    with pytest.raises(OffsetOutOfRangeError):
        store.read("orders", 1, 9, 100)
    assert store.offset_for_timestamp("orders", 1, 5) == 0
    assert store.offset_for_timestamp("orders", 1, 6) is None
    await store.close()
    store = await Store.open(tmp_path, StoreConfig())
    assert store.topics() == {"orders": 2}
    assert store.high_watermark("orders", 1) == 8 and store.high_watermark("orders", 0) == 0
    assert [r.value for r in read_all(store, "orders", 1)] == [b"v0", b"v1", b"v2", b"v3"] * 2
    await store.close()


async def test_corrupt_producer_batches_refused(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    good = build_batch([(1, None, b"v", [])])
    bad_crc = bytearray(good)
    bad_crc[-1] ^= 1
    bad_magic = bytearray(good)
    bad_magic[16] = 1
    for bad in (bytes(bad_crc), bytes(bad_magic), bytes(good[:-1]), b"", bytes(good) + b"\0" * 5):
        with pytest.raises(InvalidRecordError):
            store.append_batch("t", 0, bad)
    assert store.high_watermark("t", 0) == 0
    await store.close()


async def test_dollar_topics_never_stored(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig())
    for t in ("$SYS/x", "", "a/+/b", "a/#"):
        with pytest.raises(TopicMappingError):
            store.append_mqtt([MqttMessage("ok/1", b"", 0, "c"), MqttMessage(t, b"", 0, "c")])
    assert all(store.high_watermark(t, p) == 0 for t, n in store.topics().items() for p in range(n))
    await store.close()


async def test_second_open_is_locked(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig())
    with pytest.raises(StoreLockedError, match="locked by another process"):
        await Store.open(tmp_path, StoreConfig())
    await store.close()
    again = await Store.open(tmp_path, StoreConfig())  # released on close
    await again.close()


async def test_listener_and_group_commit(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    seen: list[tuple[str, int, int]] = []
    store.add_append_listener(lambda t, p, h: seen.append((t, p, h)))
    results = [store.append_mqtt([MqttMessage("g/x", b"%d" % i, 1, "c")]) for i in range(20)]
    assert store.high_watermark("g", 0) == 0  # visible only once written, at the end of the tick
    await asyncio.gather(*(r.durable for r in results))
    assert seen == [("g", 0, 20)]  # one write for the whole tick
    empty = store.append_mqtt([])
    assert empty.offsets == [] and (await empty.durable) is None
    assert store.high_watermark("g", 0) == 20
    await store.close()


async def test_unacknowledged_append_waits_for_the_interval_fsync(tmp_path: Path) -> None:
    """`sync=False` (MQTT QoS 0): written this tick, no fsync of its own under `always`; the
    interval timer syncs it, and an acknowledged append's fsync covers it if that comes first."""
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1, fsync_interval_ms=200))
    seg = lambda: store._logs[("q", 0)].segments[-1]  # noqa: E731
    res = store.append_mqtt([MqttMessage("q/x", b"0", 0, "c")], sync=False)
    assert res.durable.done()  # nobody waits
    await asyncio.sleep(0.02)
    assert store.high_watermark("q", 0) == 1  # written at the end of the tick...
    assert seg().dirty  # ...but not fsynced by itself
    await asyncio.sleep(0.4)
    assert not seg().dirty  # the interval timer synced it
    store.append_mqtt([MqttMessage("q/x", b"1", 0, "c")], sync=False)
    acked = store.append_mqtt([MqttMessage("q/x", b"2", 1, "c")])
    await asyncio.wait_for(acked.durable, 5)
    assert not seg().dirty  # one fsync covered both
    await store.close()


@pytest.mark.parametrize("policy", ["interval_ms", "never"])
async def test_other_fsync_policies(tmp_path: Path, policy: str) -> None:
    store = await Store.open(tmp_path, StoreConfig(fsync=policy, fsync_interval_ms=5))
    res = store.append_mqtt([MqttMessage("p/x", b"1", 1, "c")])
    await asyncio.wait_for(res.durable, 5)
    await asyncio.sleep(0.02)
    assert store.topic_config("p").fsync == policy
    await store.close()


async def test_idle_reopen_keeps_sealed_files(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    await store.append_mqtt([MqttMessage("idle/x", b"1", 1, "c")] * 3).durable
    await store.close()
    idx = tmp_path / "log" / "idle-0" / "00000000000000000000.index"
    before = idx.stat().st_mtime_ns
    for _ in range(2):  # clean open + close with no writes: nothing to seal again
        store = await Store.open(tmp_path, StoreConfig())
        assert store.high_watermark("idle", 0) == 3
        await store.close()
    assert idx.stat().st_mtime_ns == before
    assert (tmp_path / "log" / "clean-shutdown").exists()
    store = await Store.open(tmp_path, StoreConfig())
    assert not (tmp_path / "log" / "clean-shutdown").exists()  # removed while open
    with pytest.raises(Exception, match="closed"):
        await store.close() or store.append_mqtt([MqttMessage("idle/x", b"2", 1, "c")])


async def test_read_fresh_is_the_last_write_as_written(tmp_path: Path) -> None:
    """The dispatcher's read-back of an append: the batch a recent write put at an offset (or
    holding it), the same bytes as a read from the file; None for a batch read past already or
    below the log start, and a `read` after it goes on from where it ended."""
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1, fsync="never"))
    res = store.append_mqtt([MqttMessage("d/1", b"a%d" % i, 0, "c") for i in range(5)])
    await asyncio.wait_for(res.durable, 5)
    first = store.read_fresh("d", 0, 0)
    assert first is not None and bytes(first) == store.read("d", 0, 0, 1 << 20)
    assert store.read_fresh("d", 0, 3) is first  # a budget that ran out inside the batch
    assert store.read_fresh("d", 0, 5) is None  # not written yet
    assert store.read_fresh("d", 0, 0) is None  # read past already
    res = store.append_mqtt([MqttMessage("d/1", b"b%d" % i, 0, "c") for i in range(3)])
    await asyncio.wait_for(res.durable, 5)
    again = store.read_fresh("d", 0, 5)
    assert again is not None and [r.value for r in records(bytes(again))] == [b"b0", b"b1", b"b2"]
    assert bytes(again) == store.read("d", 0, 5, 1 << 20)
    res = store.append_mqtt([MqttMessage("d/1", b"c", 0, "c")])
    await asyncio.wait_for(res.durable, 5)
    assert [r.value for r in records(store.read("d", 0, 8, 1 << 20))] == [b"c"]
    await store.delete_records("d", 0, 9)
    assert store.read_fresh("d", 0, 8) is None  # below the log start now
    for _ in range(40):  # nobody reads them back: a bounded few are kept
        res = store.append_mqtt([MqttMessage("d/1", bytes(100_000), 0, "c")])
        await asyncio.wait_for(res.durable, 5)
    assert store.read_fresh("d", 0, 9) is None and store.read_fresh("d", 0, 48) is not None
    await store.close()
