"""Topic administration in the store: delete a topic, delete records, add partitions, per-topic
config; each durable across a restart and each crash point of `store/topic_admin.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from store import MqttMessage, OffsetOutOfRangeError, Store, StoreConfig
from store import segment_reader as sr
from store.config import StoreError, UnknownTopicOrPartitionError
from store.record_batch import build_batch


def batch(n: int, start: int = 0) -> bytes:
    return bytes(build_batch([(1000 + i, b"k", b"v%d" % (start + i), []) for i in range(n)]))


async def fill(store: Store, topic: str, n: int, per_batch: int = 10) -> None:
    for i in range(0, n, per_batch):
        await store.append_batch(topic, 0, batch(per_batch, i)).durable


async def test_delete_topic_removes_data_and_a_new_one_starts_at_zero(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=2))
    events: list[tuple[str, str]] = []
    store.add_topic_listener(lambda e, t: events.append((e, t)))
    store.create_topic("t", 2)
    await fill(store, "t", 50)
    store.append_mqtt([MqttMessage("other/x", b"keep", 1, "c")])
    await store.delete_topic("t")
    assert "t" not in store.topics() and events == [("deleted", "t")]
    with pytest.raises(UnknownTopicOrPartitionError):
        store.read("t", 0, 0, 100)
    with pytest.raises(UnknownTopicOrPartitionError):
        await store.delete_topic("t")
    await store.close()  # the background removal finishes with the store
    log_dir = tmp_path / "log"
    assert not [d for d in log_dir.iterdir() if d.name.startswith("t-")]
    assert "t" not in json.loads((log_dir / "topics.json").read_text())
    store = await Store.open(tmp_path, StoreConfig(default_partitions=2))
    assert "t" not in store.topics() and "other" in store.topics()
    store.create_topic("t", 3)  # the same name again: a new topic from offset 0
    res = store.append_batch("t", 0, batch(1))
    await res.durable
    assert res.offsets is None or res.offsets[0][2] == 0
    assert store.high_watermark("t", 0) == 1
    await store.close()


async def test_crash_points_of_delete_topic_are_cleaned_at_open(tmp_path: Path) -> None:
    """Crash after topics.json was rewritten but before the rename (an orphan directory), and
    after the rename (a `-delete` directory): both are removed when the store opens."""
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    store.create_topic("a", 1)
    store.create_topic("b", 1)
    await fill(store, "a", 10)
    await fill(store, "b", 10)
    await store.close()
    log_dir = tmp_path / "log"
    meta = json.loads((log_dir / "topics.json").read_text())
    del meta["a"]
    (log_dir / "topics.json").write_text(json.dumps(meta))  # crash point 2: a-0 is an orphan
    (log_dir / "b-0").rename(log_dir / "b-0.1234abcd-delete")  # crash point 3 (b stays listed)
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    names = sorted(d.name for d in log_dir.iterdir() if d.is_dir())
    assert names == ["b-0"]  # the orphan and the -delete dir are gone; b recreated empty
    assert store.high_watermark("b", 0) == 0 and "a" not in store.topics()
    await store.close()


async def test_delete_records_moves_the_log_start_for_every_reader(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1, segment_bytes=600))
    store.create_topic("r", 1)
    await fill(store, "r", 100)  # 10 batches over several small segments
    segs_before = len(sr.list_segments(tmp_path, "r", 0))
    assert await store.delete_records("r", 0, 35) == 35
    assert store.log_start_offset("r", 0) == 35
    with pytest.raises(OffsetOutOfRangeError):
        store.read("r", 0, 34, 1000)
    assert store.read("r", 0, 35, 1000)  # the batch holding 35 (it starts at 30)
    assert await store.delete_records("r", 0, 10) == 35  # never backwards
    with pytest.raises(OffsetOutOfRangeError):
        await store.delete_records("r", 0, 101)
    # Another process (Spark) sees the same start, and no record below it.
    assert sr.log_start_offset(tmp_path, "r", 0) == 35
    offs = [r.offset for r in sr.iter_records_from(tmp_path, "r", 0)]
    assert offs == list(range(35, 100))
    await store.close()
    assert len(sr.list_segments(tmp_path, "r", 0)) < segs_before  # whole segments below went
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1, segment_bytes=600))
    assert store.log_start_offset("r", 0) == 35 and store.high_watermark("r", 0) == 100
    assert await store.delete_records("r", 0, -1) == 100  # -1: everything
    await fill(store, "r", 10)
    assert store.log_start_offset("r", 0) == 100 and store.high_watermark("r", 0) == 110
    await store.close()


async def test_create_partitions_grows_and_persists(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    store.create_topic("p", 1)
    store.create_partitions("p", 4)
    assert store.partitions("p") == 4
    with pytest.raises(StoreError):
        store.create_partitions("p", 2)
    msgs = [MqttMessage(f"p/dev{i}", b"x", 1, "c") for i in range(40)]
    await store.append_mqtt(msgs).durable
    assert sum(store.high_watermark("p", i) for i in range(4)) == 40
    assert all(store.high_watermark("p", i) for i in range(4))  # spread over all four
    await store.close()
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    assert store.partitions("p") == 4 and sr.list_topics(tmp_path)["p"] == 4
    await store.close()


async def test_topic_config_changes_apply_at_once_and_persist(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    store.create_topic("c", 1)
    await fill(store, "c", 20)
    assert len(sr.list_segments(tmp_path, "c", 0)) == 1
    store.alter_topic_config("c", {"segment_bytes": 600, "retention_ms": 3_600_000})
    assert store.topic_overrides("c") == {"segment_bytes": 600, "retention_ms": 3_600_000}
    await fill(store, "c", 100)
    assert len(sr.list_segments(tmp_path, "c", 0)) > 2  # rolls at the new size at once
    with pytest.raises(StoreError):
        store.alter_topic_config("c", {"fsync": "sometimes"})
    store.alter_topic_config("c", {}, delete=["retention_ms"])
    await store.close()
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1))
    assert store.topic_overrides("c") == {"segment_bytes": 600}
    assert store.topic_config("c").segment_bytes == 600
    await store.close()
