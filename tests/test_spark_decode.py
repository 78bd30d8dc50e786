"""The reader without Spark: decoding, filters, seeking, torn tails (fast, pure Python + Arrow)."""

from __future__ import annotations

import struct
from pathlib import Path

import cramjam
import pytest

from spark_analytics.arrow_decode import ARROW_SCHEMA
from spark_analytics.logdir import PartitionTail, iter_batches, offset_for_timestamp
from spark_analytics.mqtt import (
    FilterError,
    filter_plan,
    filter_regex,
    topic_matches,
    topics_for_filter,
)
from spark_analytics.options import OptionError, parse_options
from spark_analytics.source import LightgateBatchReader, LogRange, read_range
from tests.spark_helpers import LogWriter, Rec, build_batch, mqtt_rec


def ms(dt: object) -> int:
    return round(dt.timestamp() * 1000)  # type: ignore[attr-defined]


def rows(data_dir: Path, **options: str) -> list[dict]:
    opts = parse_options({"path": str(data_dir), **options}, streaming=False)
    reader = LightgateBatchReader(opts)
    out: list[dict] = []
    for part in reader.partitions():
        for rb in read_range(opts, part):
            assert rb.schema.equals(ARROW_SCHEMA)
            out.extend(rb.to_pylist())
    return sorted(out, key=lambda r: (r["topic"], r["partition"], r["offset"]))


def test_decode_all_fields_and_codecs(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"sensors": 1, "raw": 1})
    expected = []
    for codec in range(5):  # none, gzip, snappy (xerial), lz4, zstd
        recs = [
            mqtt_rec(
                f"sensors/d{i}/t", b'{"v": %d}' % i + b"x" * (i * 40), f"d{i}", i % 3, 1000 + i
            )
            for i in range(7)
        ]
        w.append("sensors", 0, recs, compression=codec)
        expected += recs
    got = rows(tmp_path, topics="sensors")
    assert len(got) == 35
    for i, (r, e) in enumerate(zip(got, expected, strict=True)):
        assert r["offset"] == i and r["partition"] == 0 and r["topic"] == "sensors"
        assert (r["key"], r["value"]) == (e.key, e.value)
        assert ms(r["timestamp"]) == e.timestamp and r["timestampType"] == 0
        assert [(h["key"], h["value"]) for h in r["headers"]] == e.headers
        assert r["mqtt_topic"] == e.key.decode()
        assert r["client_id"] == e.headers[1][1].decode()
        assert r["qos"] == int(e.headers[0][1])


def test_kafka_records_mqtt_topic_fallback(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"raw": 1})
    w.append(
        "raw",
        0,
        [
            Rec(b"raw/a/b", b"1", 1, [("mqtt.qos", b"2")]),  # valid, maps to raw
            Rec(b"raw", b"2", 2),  # the first level alone
            Rec(b"other/a", b"3", 3),  # first level maps to another topic
            Rec(b"raw/+/x", b"4", 4),  # wildcard: not a topic
            Rec(None, None, 5, [("k", None), ("mqtt.qos", b"7")]),  # nulls, bad qos
            Rec(b"\xff\xferaw", b"6", 6, [("mqtt.client_id", b"c1"), ("mqtt.client_id", b"c2")]),
            Rec(b"", b"7", 7),
        ],
    )
    got = rows(tmp_path)
    assert [r["mqtt_topic"] for r in got] == ["raw/a/b", "raw", "raw", "raw", "raw", "raw", "raw"]
    assert [r["qos"] for r in got] == [2, None, None, None, None, None, None]
    assert [r["client_id"] for r in got] == [None] * 5 + ["c1", None]
    assert got[4]["key"] is None and got[4]["value"] is None
    assert got[4]["headers"] == [{"key": "k", "value": None}, {"key": "mqtt.qos", "value": b"7"}]
    assert got[6]["key"] == b""


def test_raw_snappy_and_log_append_time(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"t": 1})
    w.append("t", 0, [Rec(b"t/a", b"v%d" % i, 10 + i) for i in range(3)], log_append_time=99)
    # Raw (non-xerial) snappy, as librdkafka writes it.
    plain = build_batch(3, [Rec(b"t/b", b"w%d" % i, 20 + i) for i in range(4)])
    import crc32c

    body = bytes(cramjam.snappy.compress_raw(plain[61:]))
    head = bytearray(plain[:61])
    struct.pack_into(">i", head, 8, 49 + len(body))
    struct.pack_into(">h", head, 21, 2)
    batch = bytearray(head + body)
    struct.pack_into(">I", batch, 17, crc32c.crc32c(bytes(batch[21:])))
    with open(w.segment[("t", 0)], "ab") as f:
        f.write(batch)
    got = rows(tmp_path)
    assert [r["value"] for r in got] == [b"v0", b"v1", b"v2", b"w0", b"w1", b"w2", b"w3"]
    assert [r["timestampType"] for r in got] == [1, 1, 1, 0, 0, 0, 0]
    assert [ms(r["timestamp"]) for r in got] == [99, 99, 99, 20, 21, 22, 23]


def test_offsets_segments_and_seek(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"t": 2})
    for i in range(20):
        w.append("t", 0, [Rec(b"t/x", b"%d" % (i * 5 + j), 1000 * i + j) for j in range(5)])
        if i == 9:
            w.roll("t", 0)  # second segment starts at offset 50
    w.append("t", 1, [Rec(b"t/y", b"p1-%d" % j, 5) for j in range(3)])
    seg2 = w.segment[("t", 0)]
    assert seg2.name == f"{50:020d}.log"
    got = rows(tmp_path, startingOffsets='{"t": {"0": 47}}', endingOffsets='{"t": {"0": 63}}')
    p0 = [r["offset"] for r in got if r["partition"] == 0]
    assert p0 == list(range(47, 63))
    assert all(r["value"] == b"%d" % r["offset"] for r in got if r["partition"] == 0)
    assert [r["offset"] for r in got if r["partition"] == 1] == [0, 1, 2]
    got = rows(tmp_path, startingOffsets='{"t": {"0": -1, "1": -2}}')
    assert [(r["partition"], r["offset"]) for r in got] == [(1, 0), (1, 1), (1, 2)]
    got = rows(tmp_path, startingOffsets="latest")
    assert got == []
    # Splitting one partition into several ranges changes nothing in the result.
    opts = parse_options({"path": str(tmp_path), "maxRecordsPerPartition": "7"}, streaming=False)
    parts = LightgateBatchReader(opts).partitions()
    assert len(parts) == 15 + 1
    offs = sorted(
        r["offset"]
        for p in parts
        for rb in read_range(opts, p)
        for r in rb.to_pylist()
        if r["partition"] == 0
    )
    assert offs == list(range(100))
    # Timestamps: first offset with timestamp >= ts.
    log = tmp_path / "log"
    assert offset_for_timestamp(log, "t", 0, 12_003) == 63
    assert offset_for_timestamp(log, "t", 0, 12_005) == 65
    assert offset_for_timestamp(log, "t", 0, 99_999) is None
    got = rows(tmp_path, topics="t", startingTimestamp="17003")
    assert [r["offset"] for r in got if r["partition"] == 0] == list(range(88, 100))
    assert [r["offset"] for r in got if r["partition"] == 1] == []


def test_torn_tail_is_invisible(tmp_path: Path) -> None:
    w = LogWriter(tmp_path, {"t": 1})
    w.append("t", 0, [Rec(b"t/a", b"a", 1)] * 3)
    nxt = w.batch_bytes("t", 0, [Rec(b"t/a", b"b", 2)] * 4)
    seg = w.segment[("t", 0)]
    log = tmp_path / "log"
    tail = PartitionTail(log, "t", 0)
    assert tail.advance() == 3
    with open(seg, "ab") as f:
        f.write(nxt[:30])  # header incomplete
    assert tail.advance() == 3 and len(rows(tmp_path)) == 3
    with open(seg, "ab") as f:
        f.write(nxt[30:-1])  # all but the last byte: length runs past the end
    assert tail.advance() == 3 and len(rows(tmp_path)) == 3
    with open(seg, "ab") as f:
        f.write(b"\x00")  # complete length, wrong CRC (last byte zero instead of the real one)
    if nxt[-1] != 0:
        assert tail.advance() == 3 and len(rows(tmp_path)) == 3
    with open(seg, "r+b") as f:
        f.seek(-1, 2)
        f.write(nxt[-1:])
    assert tail.advance() == 7 and len(rows(tmp_path)) == 7
    first_len = seg.stat().st_size - len(nxt)
    assert tail.hint_for(3) == (0, first_len)  # where the next micro-batch will start
    assert [b.base_offset for b in iter_batches(log, "t", 0, 3, None, tail.hint_for(3))] == [3]


def test_mqtt_filter_semantics(tmp_path: Path) -> None:
    cases = [
        ("a/+/c", "a/b/c", True),
        ("a/+/c", "a/b/d", False),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("a/#", "ab", False),
        ("#", "x/y", True),
        ("#", "$SYS/x", False),
        ("+/x", "$a/x", False),
        ("+/+", "/x", True),
        ("a.b/(c)", "a.b/(c)", True),
        ("a.b/(c)", "aXb/(c)", False),
        ("+", "a/b", False),
    ]
    for flt, topic, want in cases:
        assert topic_matches(flt, topic) is want, (flt, topic)
    assert [filter_plan(f)[0] for f in ("#", "a/b", "a/b/#", "a/+/#", "+")] == [
        "all",
        "equal",
        "prefix",
        "regex",
        "regex",
    ]
    for bad in ("a/#/b", "a+", "", "a/b#"):
        with pytest.raises(FilterError):
            filter_regex(bad)
    assert topics_for_filter("a/+/c", ["a", "b"]) == ["a"]
    assert topics_for_filter("+/c", ["a", "b"]) == ["a", "b"]
    w = LogWriter(tmp_path, {"a": 1, "b": 1})
    w.append("a", 0, [mqtt_rec(t, b"", "c", 0, 1) for t in ("a/1/c", "a/2/d", "a/3/c", "a")])
    w.append("b", 0, [mqtt_rec(t, b"", "c", 0, 1) for t in ("b/1/c",)])
    assert [r["mqtt_topic"] for r in rows(tmp_path, mqttTopicFilter="+/+/c")] == [
        "a/1/c",
        "a/3/c",
        "b/1/c",
    ]
    assert len(rows(tmp_path, mqttTopicFilter="#")) == 5
    assert [r["mqtt_topic"] for r in rows(tmp_path, mqttTopicFilter="a/1/c")] == ["a/1/c"]
    assert [r["mqtt_topic"] for r in rows(tmp_path, mqttTopicFilter="a/#")] == [
        "a/1/c",
        "a/2/d",
        "a/3/c",
        "a",
    ]


def test_option_errors(tmp_path: Path) -> None:
    with pytest.raises(OptionError, match="unknown option"):
        parse_options({"path": "x", "startingOffset": "earliest"}, streaming=False)
    with pytest.raises(OptionError, match="startingOffsets"):
        parse_options({"path": "x", "startingOffsets": "{bad"}, streaming=False)
    with pytest.raises(OptionError, match="endingOffsets"):
        parse_options({"path": "x", "endingOffsets": "earliest"}, streaming=False)
    with pytest.raises(OptionError, match="batch queries only"):
        parse_options({"path": "x", "endingOffsets": "latest"}, streaming=True)
    with pytest.raises(OptionError, match="maxRecordsPerTrigger"):
        parse_options({"path": "x", "maxRecordsPerTrigger": "0"}, streaming=True)
    from spark_analytics.logdir import LogDirError

    with pytest.raises(LogDirError, match="does not exist"):
        rows(tmp_path / "nope")
    with pytest.raises(LogDirError, match="no log/"):
        rows(tmp_path)
    LogWriter(tmp_path, {"t": 1})
    with pytest.raises(LogDirError, match="not found"):
        rows(tmp_path, topics="zzz")


def test_read_none_partition() -> None:
    opts = parse_options({"path": "/nonexistent"}, streaming=False)
    assert list(read_range(opts, LogRange("t", 0, 0, 0, None))) == []


def test_escaped_first_level(tmp_path: Path) -> None:
    mapping = pytest.importorskip("store.mapping")
    if not hasattr(mapping, "escape_level"):
        pytest.skip("store.mapping has no escape_level yet")
    log_topic = mapping.escape_level("my plant")
    assert log_topic != "my plant"
    w = LogWriter(tmp_path, {log_topic: 1, "other": 1})
    w.append(log_topic, 0, [mqtt_rec("my plant/line 1", b"1", "c", 0, 1), Rec(b"x/y", b"2", 2)])
    w.append("other", 0, [mqtt_rec("other/a", b"3", "c", 0, 1)])
    got = rows(tmp_path, mqttTopicFilter="my plant/#")
    assert [(r["topic"], r["mqtt_topic"]) for r in got] == [(log_topic, "my plant/line 1")]
    got = rows(tmp_path, topics=log_topic)
    assert [r["mqtt_topic"] for r in got] == ["my plant/line 1", log_topic]


def test_tail_hints_any_offset(tmp_path: Path) -> None:
    """Micro-batches cut mid-log (maxRecordsPerTrigger) still start reading near their offset."""
    w = LogWriter(tmp_path, {"t": 1})
    for i in range(60):  # ~60 batches of ~50 KB: 3 MB, so hints every ~1 MiB
        w.append("t", 0, [Rec(b"t/x", bytes(1000), i)] * 50)
        if i == 40:
            w.roll("t", 0)
    log = tmp_path / "log"
    tail = PartitionTail(log, "t", 0)
    assert tail.advance() == 3000
    assert 4 <= len(tail.hints) <= 8
    for offset in (0, 1, 1234, 2049, 2050, 2999, 3000):
        hint = tail.hint_for(offset)
        assert hint is not None
        plain = [b.base_offset for b in iter_batches(log, "t", 0, offset)]
        hinted = [b.base_offset for b in iter_batches(log, "t", 0, offset, None, hint)]
        assert hinted == plain, offset
        seg_base, pos = hint
        assert seg_base == (2050 if offset >= 2050 else 0)
        batch_pos = (offset // 50) * 50 * 1070  # ~1070 bytes per record, 50 per batch
        assert batch_pos - pos < (1 << 20) + 60_000 or seg_base == 2050
