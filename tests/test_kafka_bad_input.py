"""Raw frames against a running KafkaServer: errors Kafka returns, connections it closes, and
idempotent-producer sequence rules — the server must keep serving throughout."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from aiokafka.protocol.admin import ApiVersionResponse_v0
from aiokafka.protocol.fetch import FetchRequest_v4
from aiokafka.protocol.metadata import MetadataRequest_v1
from aiokafka.protocol.offset import OffsetRequest_v1
from aiokafka.protocol.produce import ProduceRequest_v7
from aiokafka.protocol.transaction import InitProducerIdRequest_v0
from kafka_helpers import Gateway, RawClient, garble_records, make_batch, running_gateway

from store.record_batch import CONTROL_MASK, TRANSACTIONAL_MASK, build_batch

pytestmark = pytest.mark.timeout(60)

CORRUPT_MESSAGE, UNKNOWN_TOPIC, OUT_OF_RANGE, INVALID_RECORD = 2, 3, 1, 87
OUT_OF_ORDER, INVALID_EPOCH, REQUIRED_ACKS = 45, 47, 21


async def still_serving(gw: Gateway) -> None:
    client = await RawClient.connect(gw.server.port)
    resp = await client.request(MetadataRequest_v1(None))
    assert resp.brokers[0][2] == gw.server.port
    await client.close()


def produce_req(topic: str, partition: int, batch: bytes, acks: int = 1) -> ProduceRequest_v7:
    return ProduceRequest_v7(None, acks, 5000, [(topic, [(partition, batch)])])


def partition_result(resp) -> tuple[int, int]:
    _topic, parts = resp.topics[0]
    _p, error, offset = parts[0][:3]
    return error, offset


@pytest.fixture
async def gw(tmp_path: Path):
    async with running_gateway(tmp_path / "data", partitions=2) as gateway:
        gateway.store.ensure_topic("t")
        yield gateway


async def test_unknown_api_key_and_version_close_only_that_connection(gw: Gateway) -> None:
    for head in (struct.pack(">hhi", 77, 0, 1), struct.pack(">hhi", 0, 1, 1)):  # Produce v1
        client = await RawClient.connect(gw.server.port)
        await client.send_raw(struct.pack(">i", len(head) + 2) + head + b"\xff\xff")
        assert await client.closed_by_peer()
        await client.close()
    await still_serving(gw)
    assert gw.server.stats()["kafka_protocol_errors_total"] == 2


async def test_kip511_api_versions_from_the_future(gw: Gateway) -> None:
    client = await RawClient.connect(gw.server.port)
    body = struct.pack(">hhih", 18, 42, 9, 4) + b"test" + b"\x00\x05junk\x00"
    await client.send_raw(struct.pack(">i", len(body)) + body)
    frame = await client.read_frame()
    assert struct.unpack_from(">i", frame)[0] == 9
    resp = ApiVersionResponse_v0.decode(frame[4:])
    assert resp.error_code == 35
    assert (18, 0, 4) in [tuple(x) for x in resp.api_versions]
    # the connection stays usable, as for a real broker
    assert (await client.request(MetadataRequest_v1(["t"]))).topics[0][1] == "t"
    await client.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00\x00\x00\x03abc",  # frame shorter than a request header
        struct.pack(">i", 12) + struct.pack(">hhi", 3, 1, 5) + b"\x00\x09ab",  # truncated body
        struct.pack(">i", 0x7FFFFFF0),  # 2 GiB announced: rejected before buffering
        struct.pack(">i", -5),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    ],
)
async def test_garbage_closes_connection_and_server_survives(gw: Gateway, garbage: bytes) -> None:
    client = await RawClient.connect(gw.server.port)
    await client.send_raw(garbage)
    assert await client.closed_by_peer()
    await client.close()
    await still_serving(gw)


async def test_partial_frame_then_disconnect(gw: Gateway) -> None:
    client = await RawClient.connect(gw.server.port)
    await client.send_raw(struct.pack(">i", 5000) + b"x" * 100)
    await client.close()
    await still_serving(gw)


async def test_frame_over_configured_max_is_rejected(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "d", max_frame_bytes=4096) as small:
        client = await RawClient.connect(small.server.port)
        await client.send_raw(struct.pack(">i", 9000) + make_batch([b"x" * 8000])[:100])
        assert await client.closed_by_peer()
        await still_serving(small)


async def _corrupt_message_then_fine(gw: Gateway, batch: bytes) -> None:
    """`batch` is refused with CORRUPT_MESSAGE, nothing is stored, and the next one is fine."""
    client = await RawClient.connect(gw.server.port)
    resp = await client.request(produce_req("t", 0, batch))
    assert partition_result(resp)[0] == CORRUPT_MESSAGE
    assert gw.store.high_watermark("t", 0) == 0
    ok = await client.request(produce_req("t", 0, make_batch([b"fine"])))
    assert partition_result(ok) == (0, 0)
    await client.close()


async def test_corrupt_crc_is_corrupt_message_and_nothing_is_stored(gw: Gateway) -> None:
    batch = bytearray(make_batch([b"hello", b"world"]))
    batch[-1] ^= 0xFF
    await _corrupt_message_then_fine(gw, bytes(batch))


async def test_garbled_records_under_a_valid_crc_are_corrupt_message(gw: Gateway) -> None:
    """Kafka's broker decodes the records too: a batch whose CRC was recomputed over garbage
    would stop every consumer (and the light-queue dispatcher) that reads it."""
    await _corrupt_message_then_fine(gw, garble_records(make_batch([b"hello", b"world"])))


async def test_unknown_topic_partition_and_offset_errors(gw: Gateway) -> None:
    client = await RawClient.connect(gw.server.port)
    batch = make_batch([b"v"])
    assert partition_result(await client.request(produce_req("nope", 0, batch)))[0] == UNKNOWN_TOPIC
    assert partition_result(await client.request(produce_req("t", 7, batch)))[0] == UNKNOWN_TOPIC
    assert (
        partition_result(await client.request(produce_req("t", 0, batch, acks=2)))[0]
        == REQUIRED_ACKS
    )
    two = make_batch([b"a"]) + make_batch([b"b"])
    assert partition_result(await client.request(produce_req("t", 0, two)))[0] == INVALID_RECORD

    fetch = await client.request(
        FetchRequest_v4(-1, 0, 1, 1 << 20, 0, [("t", [(0, 99, 1 << 20)]), ("zz", [(0, 0, 100)])])
    )
    errors = {topic: parts[0][1] for topic, parts in fetch.topics}
    assert errors == {"t": OUT_OF_RANGE, "zz": UNKNOWN_TOPIC}
    offsets = await client.request(OffsetRequest_v1(-1, [("t", [(9, -1)])]))
    assert offsets.topics[0][1][0][1] == UNKNOWN_TOPIC
    await client.close()


async def test_acks_zero_gets_no_response(gw: Gateway) -> None:
    client = await RawClient.connect(gw.server.port)
    req = produce_req("t", 0, make_batch([b"fire-and-forget"]), acks=0)
    body = req.build_request_header(1, "raw").encode() + req.encode()
    await client.send_raw(struct.pack(">i", len(body)) + body)
    resp = await client.request(MetadataRequest_v1(["t"]))  # the next answer is Metadata's
    assert resp.topics[0][1] == "t"
    assert gw.store.high_watermark("t", 0) == 1
    await client.close()


async def test_acks_zero_error_drops_the_connection(gw: Gateway) -> None:
    client = await RawClient.connect(gw.server.port)
    req = produce_req("no-such-topic", 0, make_batch([b"lost"]), acks=0)
    body = req.build_request_header(1, "raw").encode() + req.encode()
    await client.send_raw(struct.pack(">i", len(body)) + body)
    assert await client.closed_by_peer()  # as Kafka: the producer learns by the disconnect
    await client.close()
    await still_serving(gw)


async def test_fetch_response_is_capped_by_server_limit(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "d", fetch_max_bytes=1000) as gw:
        gw.store.ensure_topic("t")
        client = await RawClient.connect(gw.server.port)
        for i in range(5):
            await client.request(produce_req("t", 0, make_batch([bytes([i]) * 600])))
        resp = await client.request(
            FetchRequest_v4(-1, 0, 1, 1 << 30, 0, [("t", [(0, 0, 1 << 30)])])
        )
        records = resp.topics[0][1][0][-1]
        assert 600 < len(records) < 1400  # one whole batch (KIP-74), not all five
        await client.close()


async def test_idempotent_sequences_duplicates_and_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running_gateway(data) as gw:
        gw.store.ensure_topic("t")
        client = await RawClient.connect(gw.server.port)
        init = await client.request(InitProducerIdRequest_v0(None, 60000))
        pid, epoch = init.producer_id, init.producer_epoch
        assert init.error_code == 0 and pid >= 0 and epoch == 0

        def batch(seq: int, n: int = 2, ep: int = epoch) -> bytes:
            return make_batch([b"x"] * n, producer_id=pid, producer_epoch=ep, base_sequence=seq)

        assert partition_result(await client.request(produce_req("t", 0, batch(0)))) == (0, 0)
        assert partition_result(await client.request(produce_req("t", 0, batch(2)))) == (0, 2)
        # a retry of either earlier batch: the original offset, stored once
        assert partition_result(await client.request(produce_req("t", 0, batch(0)))) == (0, 0)
        assert partition_result(await client.request(produce_req("t", 0, batch(2)))) == (0, 2)
        assert gw.store.high_watermark("t", 0) == 4
        assert (
            partition_result(await client.request(produce_req("t", 0, batch(9))))[0] == OUT_OF_ORDER
        )
        await client.close()

    async with running_gateway(data) as gw:  # state rebuilt from the snapshot and the log
        client = await RawClient.connect(gw.server.port)
        assert partition_result(await client.request(produce_req("t", 0, batch(2)))) == (0, 2)
        assert (
            partition_result(await client.request(produce_req("t", 0, batch(5))))[0] == OUT_OF_ORDER
        )
        assert partition_result(await client.request(produce_req("t", 0, batch(4)))) == (0, 4)
        assert gw.store.high_watermark("t", 0) == 6
        # a newer epoch must restart at 0; an older one is fenced
        assert (
            partition_result(await client.request(produce_req("t", 0, batch(3, ep=1))))[0]
            == OUT_OF_ORDER
        )
        assert partition_result(await client.request(produce_req("t", 0, batch(0, ep=1)))) == (0, 6)
        assert (
            partition_result(await client.request(produce_req("t", 0, batch(6, ep=0))))[0]
            == INVALID_EPOCH
        )
        await client.close()


async def test_producer_state_rebuilt_from_log_without_snapshot(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with running_gateway(data) as gw:
        gw.store.ensure_topic("t")
        client = await RawClient.connect(gw.server.port)
        pid = (await client.request(InitProducerIdRequest_v0(None, 60000))).producer_id
        b0 = make_batch([b"a"], producer_id=pid, producer_epoch=0, base_sequence=0)
        assert partition_result(await client.request(produce_req("t", 0, b0))) == (0, 0)
        await client.close()
    (data / "kafka" / "producers.json").unlink()  # lose the snapshot: the log is the truth
    async with running_gateway(data) as gw:
        client = await RawClient.connect(gw.server.port)
        assert partition_result(await client.request(produce_req("t", 0, b0))) == (0, 0)
        assert gw.store.high_watermark("t", 0) == 1
        new_pid = (await client.request(InitProducerIdRequest_v0(None, 60000))).producer_id
        assert new_pid > pid  # never re-issued
        await client.close()


async def test_transactional_misuse_is_refused_cleanly(gw: Gateway) -> None:
    """Transactions (tests/test_kafka_txn.py) with broken inputs: each gets its Kafka error."""
    client = await RawClient.connect(gw.server.port)
    resp = await client.request(InitProducerIdRequest_v0("tx-1", 10_000_000))
    assert resp.error_code == 50  # INVALID_TRANSACTION_TIMEOUT (max 900000)
    await client.request(InitProducerIdRequest_v0("tx-1", 60000))
    init = await client.request(InitProducerIdRequest_v0("tx-1", 60000))  # epoch 1
    assert (init.error_code, init.producer_epoch) == (0, 1)
    pid, epoch = init.producer_id, init.producer_epoch
    txn_batch = bytes(build_batch([(0, None, b"x", [])], producer_id=pid, producer_epoch=epoch,
                                  base_sequence=0, attributes=TRANSACTIONAL_MASK))  # fmt: skip
    # a transactional batch without a transactional id, and a client's control batch
    assert partition_result(await client.request(produce_req("t", 0, txn_batch)))[0] == 87
    control = bytes(
        build_batch(
            [(0, b"\0\0\0\1", b"\0\0\0\0\0\0", [])],
            producer_id=pid,
            producer_epoch=epoch,
            attributes=CONTROL_MASK | TRANSACTIONAL_MASK,
        )
    )
    assert partition_result(await client.request(produce_req("t", 0, control)))[0] == 87
    # transactional produce to a partition the transaction did not add: INVALID_TXN_STATE
    req = ProduceRequest_v7("tx-1", 1, 5000, [("t", [(0, txn_batch)])])
    assert partition_result(await client.request(req))[0] == 48
    # a stale epoch: INVALID_PRODUCER_EPOCH
    stale = bytes(build_batch([(0, None, b"x", [])], producer_id=pid, producer_epoch=epoch - 1,
                              base_sequence=0, attributes=TRANSACTIONAL_MASK))  # fmt: skip
    req = ProduceRequest_v7("tx-1", 1, 5000, [("t", [(0, stale)])])
    assert partition_result(await client.request(req))[0] == 47
    assert gw.store.high_watermark("t", 0) == 0
    await client.close()
