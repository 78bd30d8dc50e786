"""The `lightgate` data source through real Spark: batch, options, streaming, concurrent appends."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tests.spark_helpers import LogWriter, Rec, mqtt_rec

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def load(spark, data_dir: Path, **options: str):
    reader = spark.read.format("lightgate")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load(str(data_dir))


def test_batch_read_equals_written(spark, tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"sensors": 3, "kafka": 1})
    written: dict[tuple[str, int, int], Rec] = {}
    for i in range(60):
        dev = f"dev{i % 6}"
        r = mqtt_rec(
            f"sensors/{dev}/temp", json.dumps({"n": i}).encode(), dev, i % 3, 1_700_000_000_000 + i
        )
        p = i % 3
        base = w.append("sensors", p, [r], compression=i % 5)
        written[("sensors", p, base)] = r
    ks = [Rec(b"order-1", b"\x00\x01", 5, [("trace", b"abc")]), Rec(None, b"v", 6)]
    for j, r in enumerate(ks):
        w.append("kafka", 0, [r])
        written[("kafka", 0, j)] = r
    df = load(spark, tmp_path)
    assert df.schema.simpleString() == (
        "struct<key:binary,value:binary,topic:string,partition:int,offset:bigint,"
        "timestamp:timestamp,timestampType:int,headers:array<struct<key:string,value:binary>>,"
        "mqtt_topic:string,client_id:string,qos:int>"
    )
    got = {(r.topic, r.partition, r.offset): r for r in df.collect()}
    assert set(got) == set(written)
    for k, e in written.items():
        r = got[k]
        assert (r.key, r.value) == (e.key, e.value)
        assert [(h.key, h.value) for h in r.headers] == e.headers
        assert round(r.timestamp.timestamp() * 1000) == e.timestamp
        if k[0] == "sensors":
            assert r.mqtt_topic == e.key.decode()
            assert r.client_id == e.headers[1][1].decode() and r.qos == int(e.headers[0][1])
        else:
            assert (r.mqtt_topic, r.client_id, r.qos) == ("kafka", None, None)
    by_dev = dict(df.groupBy("client_id").count().collect())
    assert by_dev == {**{f"dev{d}": 10 for d in range(6)}, None: 2}


def test_filters_and_offsets(spark, tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"a": 2, "b": 1, "__lightgate_device_events": 1})
    for i in range(10):
        w.append("a", i % 2, [mqtt_rec(f"a/{i % 4}/x", b"%d" % i, "c", 1, 100 + i)])
    w.append("b", 0, [mqtt_rec("b/1/x", b"b", "c", 0, 1), mqtt_rec("b/y", b"b", "c", 0, 1)])
    w.append("__lightgate_device_events", 0, [Rec(b"c", b"{}", 1)])
    assert load(spark, tmp_path).count() == 12  # system topics only by name
    assert load(spark, tmp_path, topics="__lightgate_device_events").count() == 1
    assert load(spark, tmp_path, topics="b,a").count() == 12
    assert load(spark, tmp_path, mqttTopicFilter="+/1/x").count() == 4
    assert load(spark, tmp_path, mqttTopicFilter="a/#", topics="b").count() == 0
    df = load(
        spark,
        tmp_path,
        topics="a",
        startingOffsets='{"a": {"0": 1, "1": -2}}',
        endingOffsets='{"a": {"0": 4}}',
    )
    assert sorted((r.partition, r.offset) for r in df.collect()) == [
        (0, 1),
        (0, 2),
        (0, 3),
        *[(1, o) for o in range(5)],
    ]
    df = load(spark, tmp_path, topics="a", startingTimestamp="106")
    assert sorted(int(r.value) for r in df.collect()) == [6, 7, 8, 9]
    with pytest.raises(Exception, match="mqttTopicFilter"):
        load(spark, tmp_path, mqttTopicFilter="a/#/b").count()
    with pytest.raises(Exception, match="does not exist"):
        load(spark, tmp_path / "missing").count()


def _run_available_now(spark, data_dir: Path, ckpt: Path, **options: str) -> list[list[int]]:
    """One AvailableNow run; returns the offsets seen per micro-batch."""
    batches: list[list[int]] = []

    def collect(df, batch_id: int) -> None:
        batches.append(sorted(r.offset for r in df.select("offset").collect()))

    reader = spark.readStream.format("lightgate")
    for k, v in options.items():
        reader = reader.option(k, v)
    q = (
        reader.load(str(data_dir))
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination(120)
    assert q.exception() is None
    return [b for b in batches if b]


def test_streaming_restart_reads_only_new(spark, tmp_path: Path) -> None:
    data, ckpt = tmp_path / "data", tmp_path / "ckpt"
    w = LogWriter(data, {"t": 1})
    for i in range(5):
        w.append("t", 0, [Rec(b"t/x", b"%d" % (i * 4 + j), i) for j in range(4)])
    first = _run_available_now(spark, data, ckpt, startingOffsets="earliest")
    assert sum(first, []) == list(range(20))
    for _ in range(2):
        w.append("t", 0, [Rec(b"t/x", b"new", 9)] * 3)
    w.add_topic("t2", 1)  # a new topic appears: read from its start
    w.append("t2", 0, [Rec(b"t2/x", b"n", 9)] * 2)
    second = _run_available_now(spark, data, ckpt, startingOffsets="earliest")
    assert sorted(sum(second, [])) == [0, 1, *range(20, 26)]
    assert _run_available_now(spark, data, ckpt) == []


def test_streaming_max_records_per_trigger(spark, tmp_path: Path) -> None:
    data = tmp_path / "data"
    w = LogWriter(data, {"t": 2})
    for i in range(8):
        w.append("t", i % 2, [Rec(b"t/x", b"v", i)] * 5)
    # Default streaming start is latest (as in Kafka's source): nothing yet.
    assert _run_available_now(spark, data, tmp_path / "c0") == []
    got = _run_available_now(
        spark, data, tmp_path / "c1", startingOffsets="earliest", maxRecordsPerTrigger="15"
    )
    assert [len(b) for b in got] == [15, 15, 10]


def test_reader_never_sees_torn_batch(spark, tmp_path: Path) -> None:
    """A writer thread writes each batch in slow pieces; every read is a prefix of whole batches."""
    w = LogWriter(tmp_path, {"t": 1})
    per_batch = 7
    reads = 0
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        i = 0
        while i < 300 and (i < 10 or reads < 4):  # keep writing until Spark read several times
            recs = [Rec(b"t/x", b"%d" % (i * per_batch + j), i) for j in range(per_batch)]
            data = w.batch_bytes("t", 0, recs, compression=i % 2)
            with open(w.segment[("t", 0)], "ab", buffering=0) as f:
                for k in range(0, len(data), 40):
                    f.write(data[k : k + 40])
                    time.sleep(0.003)
            i += 1
        written[0] = i * per_batch
        stop.set()

    assert load(spark, tmp_path).count() == 0  # warm up: the first read starts Python workers
    th = threading.Thread(target=writer)
    th.start()
    seen = []
    try:
        while True:
            done = stop.is_set()
            vals = [int(r.value) for r in load(spark, tmp_path).select("value").collect()]
            assert sorted(vals) == list(range(len(vals)))
            assert len(vals) % per_batch == 0
            seen.append(len(vals))
            reads += 1
            if done:
                break
    finally:
        stop.wait(60)
        th.join()
    assert seen[-1] == written[0]
    assert len(set(seen)) > 1  # really read while writing
