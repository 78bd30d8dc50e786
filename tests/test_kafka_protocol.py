"""Sans-IO Kafka codec: frames from aiokafka's own encoder in, kio entities out, and back."""

from __future__ import annotations

import random
import struct

import pytest
from aiokafka.protocol.admin import ApiVersionResponse_v0, ApiVersionResponse_v1
from aiokafka.protocol.api import RequestHeader_v1
from aiokafka.protocol.metadata import MetadataRequest_v1, MetadataRequest_v5
from aiokafka.protocol.produce import ProduceRequest_v3

from store.kafka import protocol as p


def frame(request, correlation_id: int = 7, client_id: str = "test") -> bytes:
    """Encode with aiokafka (an independent implementation) exactly as its connection does."""
    body = request.build_request_header(correlation_id, client_id).encode() + request.encode()
    return struct.pack(">i", len(body)) + body


def test_frame_reader_splits_any_chunking() -> None:
    frames = [frame(MetadataRequest_v1(["t"]), i) for i in range(5)]
    stream = b"".join(frames)
    rng = random.Random(1)
    for _ in range(20):
        reader, got, pos = p.FrameReader(1024), [], 0
        while pos < len(stream):
            step = rng.randint(1, 9)
            got += reader.feed(stream[pos : pos + step])
            pos += step
        assert got == [f[4:] for f in frames]
        assert reader.buffered == 0


@pytest.mark.parametrize("size", [2**31 - 1, 1025, -1])
def test_frame_reader_rejects_absurd_sizes_before_buffering(size: int) -> None:
    reader = p.FrameReader(1024)
    with pytest.raises(p.FrameTooLarge):
        reader.feed(struct.pack(">i", size) + b"x" * 10)
    assert reader.buffered == 0


def test_decode_produce_v3_from_aiokafka() -> None:
    req = ProduceRequest_v3(None, 1, 1500, [("topic-a", [(2, b"batch-bytes")])])
    decoded = p.decode_request(frame(req)[4:])
    assert (decoded.api_key, decoded.api_version, decoded.correlation_id) == (0, 3, 7)
    assert decoded.client_id == "test"
    body = decoded.body
    assert body.acks == 1 and body.timeout.total_seconds() == 1.5
    assert body.topic_data[0].name == "topic-a"
    assert body.topic_data[0].partition_data[0].index == 2
    assert body.topic_data[0].partition_data[0].records == b"batch-bytes"


def test_decode_metadata_null_topics_means_all() -> None:
    assert p.decode_request(frame(MetadataRequest_v1(None))[4:]).body.topics is None
    decoded = p.decode_request(frame(MetadataRequest_v5(["a", "b"], False))[4:])
    assert [t.name for t in decoded.body.topics] == ["a", "b"]
    assert decoded.body.allow_auto_topic_creation is False


def test_api_versions_response_decodes_in_aiokafka() -> None:
    req = p.decode_request(struct.pack(">hhih", 18, 1, 42, -1))
    mod = p.response_module(18, 1)
    keys = tuple(
        p.build(mod.ApiVersion, api_key=k, min_version=lo, max_version=hi)
        for k, (lo, hi) in p.SUPPORTED_VERSIONS.items()
    )
    data = p.encode_response(req, p.build(mod.ApiVersionsResponse, error_code=0, api_keys=keys,
                                          throttle_time=0))  # fmt: skip
    assert struct.unpack_from(">ii", data) == (len(data) - 4, 42)
    resp = ApiVersionResponse_v1.decode(data[8:])
    assert resp.error_code == 0
    assert {k: (lo, hi) for k, lo, hi in resp.api_versions} == p.SUPPORTED_VERSIONS


def test_kip511_newer_api_versions_gets_v0_error_with_ranges() -> None:
    # ApiVersions v99 with a flexible header: only the correlation id matters.
    req = p.decode_request(struct.pack(">hhih", 18, 99, 5, 3) + b"abc\x00" + b"\x01\x02")
    assert req.body is None and req.api_version == 99
    data = p.api_versions_error_frame(req.correlation_id)
    assert struct.unpack_from(">ii", data) == (len(data) - 4, 5)
    resp = ApiVersionResponse_v0.decode(data[8:])
    assert resp.error_code == 35  # UNSUPPORTED_VERSION
    assert {k: (lo, hi) for k, lo, hi in resp.api_versions}[18] == p.SUPPORTED_VERSIONS[18]


@pytest.mark.parametrize(
    "head",
    [struct.pack(">hhi", 99, 0, 1), struct.pack(">hhi", 0, 2, 1), struct.pack(">hhi", 1, 13, 1)],
)
def test_unknown_api_or_version_is_a_remote_error(head: bytes) -> None:
    with pytest.raises(p.RemoteProtocolError) as info:
        p.decode_request(head + b"\x00\x00")
    assert info.value.correlation_id == 1


def test_every_truncation_and_random_garbage_only_raises_remote_error() -> None:
    full = frame(ProduceRequest_v3("tx", -1, 100, [("t", [(0, b"x" * 30)])]))[4:]
    for cut in range(len(full)):
        with pytest.raises(p.RemoteProtocolError):
            p.decode_request(full[:cut])
    rng = random.Random(7)
    for _ in range(3000):
        data = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        if rng.random() < 0.7:  # keep a plausible header so the body parsers get exercised
            key = rng.choice(list(p.SUPPORTED_VERSIONS))
            lo, hi = p.SUPPORTED_VERSIONS[key]
            data = struct.pack(">hhi", key, rng.randint(lo, hi), 1) + data
        try:
            p.decode_request(data)
        except p.RemoteProtocolError:
            pass


def test_build_drops_fields_a_version_lacks_and_converts_types() -> None:
    mod0, mod5 = p.response_module(0, 3), p.response_module(0, 5)
    a = p.build(mod0.PartitionProduceResponse, index=1, error_code=2, base_offset=3,
                log_append_time=-1, log_start_offset=9)  # fmt: skip
    b = p.build(mod5.PartitionProduceResponse, index=1, error_code=2, base_offset=3,
                log_append_time=-1, log_start_offset=9)  # fmt: skip
    assert not hasattr(a, "log_start_offset") and b.log_start_offset == 9
    assert a.error_code == p.ErrorCode.corrupt_message


def test_header_matches_aiokafka_header() -> None:
    raw = frame(MetadataRequest_v1(["x"]), 99, "cid")[4:]
    hdr = RequestHeader_v1(MetadataRequest_v1(["x"]), 99, "cid").encode()
    assert raw.startswith(hdr)
    assert p.decode_request(raw).client_id == "cid"
