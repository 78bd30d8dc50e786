"""Property-based tests of the Kafka codec (store/kafka/protocol.py) and of the broker behind it.

- Every request of every supported API version, as kio generates it from Kafka's schemas
  (hypothesis `from_type`), decodes to itself whichever way the stream is chunked.
- Whatever bytes arrive, `FrameReader` and `decode_request` raise nothing but
  `RemoteProtocolError` (the connection is closed; Kafka's broker does the same).
- Every random valid request (fuzz_inputs.kafka_session: topic, group and partition values from
  small pools so that the handlers reach real state) gets a response that encodes, or a
  `CloseConnection`: never an exception out of a handler.

`LIGHTGATE_FUZZ_SCALE=N` multiplies the number of examples (`make fuzz` sets it).
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import struct
from pathlib import Path
from typing import Any

import fuzz_inputs as fi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka_helpers import running_gateway
from kio.serial import entity_writer
from kio.static.constants import EntityType
from kio.static.primitive import Records

from store.kafka import protocol as p
from store.kafka.broker import ConnInfo
from store.kafka.handlers_produce import stage_produce

SCALE = max(1, int(os.environ.get("LIGHTGATE_FUZZ_SCALE", "1")))
st.register_type_strategy(Records, st.builds(fi.record_batch, st.randoms(use_true_random=False)))

API_VERSIONS = [(k, v) for k, (lo, hi) in sorted(p.SUPPORTED_VERSIONS.items()) for v in range(lo, hi + 1)]  # fmt: skip


def _frame(api_key: int, version: int, body: Any, correlation_id: int = 7) -> bytes:
    cls = p._entity_class(api_key, version, EntityType.request)
    header_cls = cls.__header_schema__  # type: ignore[attr-defined]
    out = io.BytesIO()
    entity_writer(header_cls)(out, header_cls(request_api_key=api_key, request_api_version=version,
                                              correlation_id=correlation_id, client_id="fz"))  # fmt: skip
    entity_writer(cls)(out, body)
    data = out.getvalue()
    return struct.pack(">i", len(data)) + data


@st.composite
def requests(draw: Any) -> tuple[int, int, Any]:
    key, version = draw(st.sampled_from(API_VERSIONS))
    cls = p._entity_class(key, version, EntityType.request)
    return key, version, draw(st.from_type(cls))


@settings(deadline=None, max_examples=80 * SCALE, suppress_health_check=list(HealthCheck))
@given(st.lists(requests(), min_size=1, max_size=3), st.integers(1, 50))
def test_every_request_round_trips_in_any_chunking(reqs: list[Any], step: int) -> None:
    stream = b"".join(_frame(k, v, body, i) for i, (k, v, body) in enumerate(reqs))
    reader, frames = p.FrameReader(1 << 20), []
    for i in range(0, len(stream), step):
        frames += reader.feed(stream[i : i + step])
    assert reader.buffered == 0 and len(frames) == len(reqs)
    for i, (frame, (key, version, body)) in enumerate(zip(frames, reqs, strict=True)):
        got = p.decode_request(frame)
        assert (got.api_key, got.api_version, got.correlation_id) == (key, version, i)
        assert got.body == body


def _only_remote_errors(data: bytes, step: int) -> None:
    reader = p.FrameReader(4096)
    try:
        for i in range(0, len(data), step):
            for frame in reader.feed(data[i : i + step]):
                p.decode_request(frame)
    except p.RemoteProtocolError:
        pass


@settings(deadline=None, max_examples=500 * SCALE)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_random_bytes_only_raise_remote_protocol_error(data: bytes, step: int) -> None:
    _only_remote_errors(data, step)


@settings(deadline=None, max_examples=300 * SCALE)
@given(st.integers(0, 2**64), st.integers(1, 64))
def test_mutated_requests_only_raise_remote_protocol_error(seed: int, step: int) -> None:
    rng = random.Random(seed)
    _only_remote_errors(b"".join(fi.mutate(rng, fi.kafka_session(rng), "kafka")), step)


@settings(deadline=None, max_examples=50 * SCALE)
@given(st.sampled_from(API_VERSIONS).flatmap(
    lambda kv: st.tuples(st.just(kv), st.from_type(p._entity_class(*kv, EntityType.response)))))  # fmt: skip
def test_every_response_encodes_with_its_header(case: tuple[tuple[int, int], Any]) -> None:
    (key, version), body = case
    req = p.Request(key, version, 99, "fz", None, 0)
    data = p.encode_response(req, body)
    (size, cid) = struct.unpack_from(">ii", data)
    assert (size, cid) == (len(data) - 4, 99)


@pytest.fixture(scope="module")
def loop_and_broker(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One Store + KafkaServer for the module (driven by hand: handlers called directly)."""
    loop = asyncio.new_event_loop()
    cm = running_gateway(Path(tmp_path_factory.mktemp("kfuzz")) / "data", partitions=2,
                         fsync="never")  # fmt: skip
    gw = loop.run_until_complete(cm.__aenter__())
    gw.store.ensure_topic("fz")
    failures: list[Any] = []
    loop.set_exception_handler(lambda _loop, ctx: failures.append(ctx))
    try:
        yield loop, gw.server.broker, ConnInfo("127.0.0.1", "127.0.0.1", gw.server.port), failures
    finally:
        loop.run_until_complete(cm.__aexit__(None, None, None))
        loop.close()


SASL_KEYS = (17, 36)  # SaslHandshake, SaslAuthenticate


async def _answer(broker: Any, conn: ConnInfo, req: p.Request) -> None:
    try:
        if req.api_key in SASL_KEYS:  # answered by the connection itself (server.py), not the
            return  # broker: fuzzed in tests/test_kafka_sasl_core.py and the socket fuzzer
        if req.api_key == 0:  # produce is staged synchronously by the server, as here
            staged = stage_produce(broker, req, conn)
            for f in staged.waits:
                await asyncio.wait_for(asyncio.shield(f), 10)
            response = staged.response()
        else:
            response = await asyncio.wait_for(broker.handle(req, conn), 10)
    except p.CloseConnection:
        return
    if response is not None:
        p.encode_response(req, response)


@settings(deadline=None, max_examples=200 * SCALE, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**64))
def test_every_valid_request_gets_an_answer_that_encodes(loop_and_broker: Any, seed: int) -> None:
    loop, broker, conn, failures = loop_and_broker
    for frame in fi.kafka_session(random.Random(seed)):
        req = p.decode_request(frame[4:])
        if req.body is not None:
            loop.run_until_complete(_answer(broker, conn, req))
    loop.run_until_complete(asyncio.sleep(0))  # callbacks of this session (group commit, ...)
    assert not failures, failures
