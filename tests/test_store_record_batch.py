"""RecordBatch v2 codec and MQTT mapping: round trips (hypothesis), golden checks, refusals."""

from __future__ import annotations

import cramjam
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store.mapping import (
    MqttMessage,
    MqttProperties,
    TopicMappingError,
    escape_level,
    first_level_for,
    headers_for,
    is_valid_log_topic,
    log_topic_for,
    mqtt_view,
    murmur2,
    murmur2_py,
    partition_for_key,
)
from store.record_batch import (
    CRC_OFFSET,
    HEADER_SIZE,
    build_batch,
    build_uncompressed,
    check_batch,
    iter_batches,
    iter_records,
    parse_header,
    set_base_offset,
    split_batches,
)
from store.record_encoding import (
    CODEC_GZIP,
    CODEC_LZ4,
    CODEC_NONE,
    CODEC_SNAPPY,
    CODEC_ZSTD,
    InvalidRecordError,
    decompress,
)

timestamps = st.integers(min_value=0, max_value=2**41)
blobs = st.none() | st.binary(max_size=300)
header_lists = st.lists(st.tuples(st.text(max_size=20), blobs), max_size=4)
record_lists = st.lists(st.tuples(timestamps, blobs, blobs, header_lists), min_size=1, max_size=30)
codecs = st.sampled_from([CODEC_NONE, CODEC_GZIP, CODEC_SNAPPY, CODEC_LZ4, CODEC_ZSTD])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record_lists, st.integers(min_value=0, max_value=2**62), codecs, st.booleans())
def test_build_parse_round_trip(recs: list, base: int, codec: int, cython: bool) -> None:
    buf = build_batch(recs, base_offset=base, codec=codec)
    h = check_batch(buf)
    assert (h.base_offset, h.record_count, h.compression) == (base, len(recs), codec)
    assert h.max_timestamp == max(r[0] for r in recs) and h.size == len(buf)
    got = list(iter_records(bytes(buf), use_cython=cython))
    assert [r.offset for r in got] == list(range(base, base + len(recs)))
    assert [(r.timestamp, r.key, r.value, r.headers) for r in got] == [
        (ts, k, v, list(hs)) for ts, k, v, hs in recs
    ]


@settings(max_examples=60, deadline=None)
@given(record_lists)
def test_cython_builder_is_byte_identical(recs: list) -> None:
    """The fast builder used for MQTT appends writes exactly what the reference builder does."""
    recs = [(ts, k, v, list(hs)) for ts, k, v, hs in recs]
    assert bytes(build_uncompressed(recs)) == bytes(build_batch(recs))


@settings(max_examples=40, deadline=None)
@given(record_lists, st.integers(min_value=0, max_value=2**40))
def test_base_offset_rewrite_keeps_crc(recs: list, new_base: int) -> None:
    buf = build_batch(recs)
    before = bytes(buf[8:])
    set_base_offset(buf, new_base)
    assert check_batch(buf).base_offset == new_base and bytes(buf[8:]) == before


def test_every_bit_flip_after_the_crc_is_caught() -> None:
    buf = build_batch([(1, b"key", b"value", [("h", b"x")]), (2, None, b"v2", [])])
    for i in range(CRC_OFFSET, len(buf)):
        bad = bytearray(buf)
        bad[i] ^= 0x10
        with pytest.raises(InvalidRecordError):
            check_batch(bad)


def test_split_and_iter_batches_stop_at_partial() -> None:
    a, b = build_batch([(1, None, b"a", [])]), build_batch([(2, None, b"bb", [])] * 3)
    both = bytes(a + b)
    assert [h.record_count for h in split_batches(both)] == [1, 3]
    assert list(iter_batches(both)) == [(0, len(a)), (len(a), len(b))]
    assert list(iter_batches(both[:-1])) == [(0, len(a))]
    with pytest.raises(InvalidRecordError):
        split_batches(both[:-1])
    bad_count = bytearray(a)
    bad_count[HEADER_SIZE - 1] = 2  # record count 2 but last offset delta 0
    with pytest.raises(InvalidRecordError):
        check_batch(bad_count)


def test_header_golden_fields() -> None:
    buf = build_batch([(1000, b"k", b"v", [])], base_offset=7, producer_id=9, producer_epoch=2)
    h = parse_header(buf)
    assert h.base_offset == 7 and h.batch_length == len(buf) - 12
    assert h.partition_leader_epoch == -1 and h.magic == 2 and h.attributes == 0
    assert (h.first_timestamp, h.max_timestamp, h.producer_id, h.producer_epoch) == (
        1000,
        1000,
        9,
        2,
    )
    assert h.base_sequence == -1 and h.record_count == 1 and h.last_offset == 7
    # Record: length 8 (zig-zag 16), attributes 0, ts delta 0, offset delta 0,
    # key length 1 (zig-zag 2) "k", value length 1 "v", 0 headers.
    want = bytes([16, 0, 0, 0, 2]) + b"k" + bytes([2]) + b"v" + bytes([0])
    assert bytes(buf[HEADER_SIZE:]) == want


def test_snappy_raw_and_xerial() -> None:
    data = b"hello snappy " * 100
    raw = bytes(cramjam.snappy.compress_raw(data))
    assert decompress(CODEC_SNAPPY, raw) == data
    half = len(data) // 2
    blocks = [bytes(cramjam.snappy.compress_raw(p)) for p in (data[:half], data[half:])]
    xerial = b"\x82SNAPPY\x00" + (1).to_bytes(4, "big") * 2
    xerial += b"".join(len(b).to_bytes(4, "big") + b for b in blocks)
    assert decompress(CODEC_SNAPPY, xerial) == data
    with pytest.raises(InvalidRecordError):
        decompress(CODEC_ZSTD, b"not zstd")


# --- mapping -------------------------------------------------------------------------------


def test_murmur2_matches_kafka() -> None:
    # Vectors from Kafka's UtilsTest.testMurmur2.
    cases = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, want in cases.items():
        assert murmur2(data) == want  # compiled when built
        assert murmur2_py(data) == want


@settings(deadline=None)  # no timing assertions: suites share 2 vCPUs
@given(st.binary(max_size=64), st.integers(min_value=1, max_value=64))
def test_partition_matches_kafka_python(key: bytes, n: int) -> None:
    from kafka.partitioner.default import murmur2 as kp_murmur2

    assert partition_for_key(key, n) == (kp_murmur2(key) & 0x7FFFFFFF) % n


@settings(deadline=None)
@given(st.text(max_size=300).filter(lambda s: "/" not in s))
def test_topic_escaping_round_trip(level: str) -> None:
    name = escape_level(level)
    assert is_valid_log_topic(name)
    if len(name) < 249 or not name.startswith("_h."):
        assert first_level_for(name) == level
    else:
        with pytest.raises(TopicMappingError):
            first_level_for(name)


def test_topic_mapping_examples() -> None:
    assert log_topic_for("factory/line1/temp") == "factory"
    assert log_topic_for("factory") == "factory"
    assert log_topic_for("/abs/path") == "_x."
    assert log_topic_for("my home/x") == "_x.my_20home"
    assert log_topic_for("a_b/x") == "a_b"
    assert log_topic_for("_x.y/z") == "_x._5fx.y"  # a level that looks escaped is escaped
    assert log_topic_for("..") == "_x..."
    assert first_level_for("_x.caf_c3_a9") == "café"
    with pytest.raises(TopicMappingError):
        first_level_for("_x._ZZ")
    for bad in ("$SYS/broker", "", "a/+", "#"):
        with pytest.raises(TopicMappingError):
            log_topic_for(bad)


def test_headers_and_reverse_mapping() -> None:
    props = MqttProperties(
        payload_format=1, message_expiry=60, content_type="json", response_topic="r/t",
        correlation_data=b"\x00\x01", user_properties=(("k", "v"), ("mqtt.qos", "evil")),
    )  # fmt: skip
    msg = MqttMessage("a/b", b"x", 2, "cid", retain=True, properties=props)
    hs = headers_for(msg)
    assert hs[:3] == [("mqtt.qos", b"2"), ("mqtt.client_id", b"cid"), ("mqtt.retain", b"1")]
    assert ("mqtt.user.mqtt.qos", b"evil") in hs and ("k", b"v") in hs
    v = mqtt_view("a", b"a/b", hs)
    assert (v.topic, v.qos, v.client_id, v.retain, v.properties) == ("a/b", 2, "cid", True, props)
    # Kafka-produced: key that does not map to the topic, or no key, → the topic's first level.
    assert mqtt_view("a", b"other/b", []).topic == "a"
    assert mqtt_view("a", None, [("x", b"1")]).properties == MqttProperties(
        user_properties=(("x", "1"),)
    )
    assert mqtt_view("_x.my_20home", None, []).topic == "my home"
    assert mqtt_view("a", b"$SYS/x", []).topic == "a" and mqtt_view("a", None, []).qos == 1
