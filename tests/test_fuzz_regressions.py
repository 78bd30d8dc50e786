"""Crashers the socket fuzzer found, as the exact bytes: each must leave the gateway serving,
its log without a traceback, and the client with the answer the spec gives.

One gateway for the module; after each case its new log lines are checked for crash markers and
an MQTT publish→subscribe round trip (paho) and a Kafka produce→fetch (aiokafka) must work.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from socket_fuzzer import CRASH_MARKERS, kafka_round_trip, mqtt_round_trip

pytestmark = pytest.mark.timeout(120)


class Gw:
    def __init__(self, proc: GatewayProcess) -> None:
        self.proc = proc
        self.log_pos = 0

    def send(self, listener: str, data: bytes | list[bytes], wait: float = 3.0) -> bytes:
        """Write `data` (a list: one write each, 0.1 s apart) on a fresh connection, return what
        comes back until the gateway closes (or is quiet for `wait` seconds)."""
        with socket.create_connection(self.proc.endpoints[listener], timeout=wait) as s:
            for i, chunk in enumerate([data] if isinstance(data, bytes) else data):
                if i:
                    time.sleep(0.1)
                s.sendall(chunk)
            out = b""
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    chunk = s.recv(65536)
                except (TimeoutError, ConnectionResetError):
                    break
                if not chunk:
                    break
                out += chunk
            return out

    def assert_healthy(self) -> None:
        time.sleep(0.2)  # let the gateway log what the last connection did
        text = self.proc.log_text()
        new, self.log_pos = text[self.log_pos :], len(text)
        crashes = [ln for ln in new.splitlines() if any(m in ln for m in CRASH_MARKERS)]
        assert not crashes, new
        assert self.proc.proc is not None and self.proc.proc.poll() is None
        host, port = self.proc.endpoints["mqtt"]
        mqtt_round_trip(host, port, v5=True)
        asyncio.run(kafka_round_trip(*self.proc.endpoints["kafka"]))


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gw]:
    proc = GatewayProcess(Path(tmp_path_factory.mktemp("fuzzreg")) / "data").start()
    try:
        yield Gw(proc)
    finally:
        try:
            proc.stop()
        except Exception:
            proc.kill()


# MQTT 3.1.1 CONNECT: client id "fz1", clean session, keep alive 60
CONNECT_V4 = bytes.fromhex("100f00044d5154540402003c0003") + b"fz1"
# MQTT 5 CONNECT: the same with an empty property block
CONNECT_V5 = bytes.fromhex("101000044d5154540502003c000003") + b"fz1"
SUBSCRIBE_V5 = bytes.fromhex("820a0001000004") + b"fz/a" + b"\x01"  # pid 1, QoS 1
PUBLISH_V4_Q1 = bytes.fromhex("32090004") + b"fz/a" + b"\x00\x07" + b"x"  # pid 7
DISCONNECT = bytes.fromhex("e000")


@pytest.mark.parametrize(
    "data",
    [
        # seed 1 batch 0: CONNECT and DISCONNECT in one chunk; answering the CONNECT raised
        # "server may not send CONNACK in state DISCONNECTED" out of data_received
        CONNECT_V4 + DISCONNECT,
        CONNECT_V5 + SUBSCRIBE_V5 + DISCONNECT,
        CONNECT_V4 + PUBLISH_V4_Q1 + DISCONNECT,
        # ... and with more bytes after the DISCONNECT (a protocol error on top)
        CONNECT_V4 + DISCONNECT + bytes.fromhex("c000"),
        CONNECT_V5 + DISCONNECT + bytes.fromhex("8203000100"),
    ],
    ids=["v4-connect-disconnect", "v5-subscribe", "v4-publish-q1", "v4-trailing", "v5-trailing"],
)
def test_packets_answered_after_the_clients_disconnect(gw: Gw, data: bytes) -> None:
    reply = gw.send("mqtt", data)
    # nothing is owed to a client that said DISCONNECT; whatever was sent parses as MQTT
    assert reply[:1] in (b"", b"\x20")
    gw.assert_healthy()


def test_garbage_and_half_packets_on_every_listener(gw: Gw) -> None:
    """The shapes of the fuzzer's failures, short: each listener closes, nothing is logged."""
    gw.send("mqtt", CONNECT_V4[:7], wait=0.5)
    gw.send("ws", b"GET /mqtt HTTP/1.1\r\n\r\n", wait=1)
    gw.send("kafka", struct.pack(">i", 6) + struct.pack(">hhi", 18, 3, 1)[:6], wait=0.5)
    gw.assert_healthy()


def _kafka_frame(body_hex: str) -> bytes:
    body = bytes.fromhex(body_hex)
    return struct.pack(">i", len(body)) + body


def test_create_topics_and_partitions_beyond_the_limit_are_refused(gw: Gw) -> None:
    """Found as an IndexError in GroupCommit.flush that left every producer of that tick
    waiting forever: CreateTopics with 32767 partitions ran out of file descriptors half way and
    left the topic registered with unloaded partitions; a produce to one of them broke the
    flush. Now the count is bounded (store.config.MAX_PARTITIONS) and a create that fails
    anyway is undone."""
    from aiokafka.protocol.admin import CreatePartitionsResponse_v0, CreateTopicsResponse_v2

    # CreateTopics v2, correlation id 1, client "fz": topic "big", 32767 partitions, factor 1
    reply = gw.send("kafka", _kafka_frame(
        "0013" "0002" "00000001" "0002" "667a"  # api key 19 v2, correlation id, client id
        "00000001" "0003" "626967" "00007fff" "0001"  # [topic "big", 32767 partitions, factor 1]
        "00000000" "00000000" "00002710" "00"  # no assignments, configs; 10 s; not validate-only
    ), wait=1)  # fmt: skip
    (topic, error, _msg), *_ = CreateTopicsResponse_v2.decode(reply[8:]).topic_errors
    assert (topic, error) == ("big", 37)  # INVALID_PARTITIONS
    # CreatePartitions v0, correlation id 2: "health" to 100000 partitions
    reply = gw.send("kafka", _kafka_frame(
        "0025" "0000" "00000002" "0002" "667a"
        "00000001" "0006" "6865616c7468" "000186a0" "ffffffff"  # [health: 100000, no assignment]
        "00002710" "00"  # timeout 10 s, validate_only false
    ), wait=1)  # fmt: skip
    (_name, error, _msg), *_ = CreatePartitionsResponse_v0.decode(reply[8:]).topic_errors
    assert error in (37, 3)  # INVALID_PARTITIONS (UNKNOWN_TOPIC before the first health check)
    gw.assert_healthy()


@pytest.mark.parametrize(
    "body_hex",
    [
        # Metadata v10 naming a topic by id only (name null): v10/v11 responses have no null
        # name, so encoding the UNKNOWN_TOPIC_ID answer raised TypeError
        "0003"
        "000a"
        "00000003"
        "0002667a"
        "00"  # api 3 v10, correlation id 3, "fz", no tags
        "02"
        "00000000000000000000000000000001"
        "00"
        "00"  # [topic id ...01, name null]
        "000000"
        "00",  # no auto-create, no authorized operations; no tags
        # DescribeLogDirs v1 asking for partition -1 of "health": UnknownTopicOrPartitionError
        "0023"
        "0001"
        "00000003"
        "0002667a"  # api 35 v1, correlation id 3, "fz"
        "00000001"
        "0006"
        "6865616c7468"
        "00000001"
        "ffffffff",  # [health: [-1]]
        # ListOffsets v2, read_committed, a time lookup on a partition that does not exist:
        # the LSO check ran on the error too (UnknownTopicOrPartitionError; seed 2957979978)
        "0002"
        "0002"
        "00000003"
        "0002667a"  # api 2 v2, correlation id 3, "fz"
        "ffffffff"
        "01"  # replica -1, isolation read_committed
        "00000001"
        "0006"
        "6e6f73756368"
        "00000001"
        "00000003"
        "00000000000003e8",  # [nosuch: [partition 3 at t=1000]]
    ],
    ids=[
        "metadata-v10-null-name",
        "describe-log-dirs-partition-minus-1",
        "list-offsets-committed-unknown-partition",
    ],
)
def test_kafka_requests_answered_not_crashed(gw: Gw, body_hex: str) -> None:
    reply = gw.send("kafka", _kafka_frame(body_hex), wait=1)
    assert len(reply) > 8 and struct.unpack_from(">ii", reply) == (len(reply) - 4, 3)
    gw.assert_healthy()


async def test_a_cancelled_admin_request_does_not_strand_fsync_waiters(tmp_path: Path) -> None:
    """Seed 3 batch 29: a Kafka client closed its connection while its DeleteRecords waited for
    the store to quiesce; the cancellation went through `GroupCommit.drain`'s gather into the
    running fsync future, `_sync_done` raised CancelledError in a callback and the producers
    waiting on that fsync were never acknowledged. The same sequence, in-process."""
    from kafka_helpers import make_batch

    from store import Store, StoreConfig

    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    failures: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: failures.append(ctx))
    try:
        store.ensure_topic("t", 1)
        await store.append_batch("t", 0, make_batch([b"a"])).durable
        pending = store.append_batch("t", 0, make_batch([b"b"]))  # its fsync is what is cut
        admin = asyncio.create_task(store.delete_records("t", 0, 1))
        for _ in range(3):  # into drain's wait for the fsync
            await asyncio.sleep(0)
        admin.cancel()  # what KafkaServer does to a closed connection's requests
        await asyncio.wait_for(pending.durable, 10)
        await asyncio.sleep(0.1)
        assert not failures, failures
    finally:
        await store.close()


WS_UPGRADE = (
    b"GET /mqtt HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Protocol: mqtt\r\n\r\n"
)


def test_websocket_ping_after_our_close(gw: Gw) -> None:
    """Seed 3 batch 9: a ping behind a frame that made us close (a text frame: close 1003) was
    answered with a pong in state LOCAL_CLOSING, which wsproto refuses (LocalProtocolError out
    of data_received)."""
    text_a = bytes.fromhex("818100000000") + b"A"  # FIN text frame "A", zero mask
    ping = bytes.fromhex("898000000000")  # FIN ping, empty, zero mask
    reply = gw.send("ws", [WS_UPGRADE, text_a + ping])
    assert reply.startswith(b"HTTP/1.1 101 ")
    assert b"\x88\x02\x03\xeb" in reply  # close frame, code 1003 (unsupported data)
    gw.assert_healthy()


def test_connack_over_the_clients_maximum_packet_size(gw: Gw) -> None:
    """Seed 3 batch 33: a v5 client with Maximum Packet Size 20 and an empty client id; the
    CONNACK with its properties (assigned client id, limits) is longer, and the codec's refusal
    to send it escaped as LocalProtocolError. Now the CONNACK goes without properties."""
    connect = bytes.fromhex(
        "1012"
        "00044d515454"
        "05"
        "02"
        "003c"  # CONNECT v5, clean start, keep alive 60
        "05"
        "2700000014"  # properties: Maximum Packet Size 20
        "0000"  # client id ""
    )
    reply = gw.send("mqtt", [connect, bytes.fromhex("c000"), DISCONNECT], wait=1)
    assert reply == bytes.fromhex("2003000000d000")  # CONNACK (no properties), PINGRESP
    gw.assert_healthy()


def test_null_for_an_array_that_is_not_nullable(gw: Gw) -> None:
    """Seed 4 batch 4: kio reads a -1 array length as None even where the schema says the
    array is not nullable, and AlterConfigs iterated over None (TypeError in the handler). Kafka
    refuses such a request as invalid and closes the connection; so do we, with one log line."""
    reply = gw.send("kafka", _kafka_frame(
        "0021" "0000" "00000005" "0002667a"  # AlterConfigs v0, correlation id 5, "fz"
        "ffffffff" "00"  # resources: null (-1), validate_only false
    ), wait=1)  # fmt: skip
    assert reply == b""
    assert "null resources (not nullable)" in gw.proc.log_text()
    gw.assert_healthy()


def test_websocket_upgrade_with_a_host_that_is_not_idna(gw: Gw) -> None:
    """Seed 9 batch 12: wsproto decodes the Host header as IDNA and raised UnicodeDecodeError
    out of data_received for a byte over 0x7f; it is a bad handshake (400)."""
    reply = gw.send("ws", WS_UPGRADE.replace(b"Host: 127.0.0.1", b"Host: 127.0.0.\x801"))
    assert reply.startswith(b"HTTP/1.1 400 ")
    gw.assert_healthy()


async def test_offset_for_timestamp_inside_a_batch_cut_by_delete_records(tmp_path: Path) -> None:
    """Seed 9 batches 82-97: after DeleteRecords moved the log start into a batch, ListOffsets
    by timestamp found the batch's first record, below the start, and reading it raised
    OffsetOutOfRangeError in the handler."""
    from kafka_helpers import make_batch

    from store import Store, StoreConfig

    store = await Store.open(tmp_path / "data", StoreConfig(fsync="never"))
    try:
        store.ensure_topic("t", 1)
        await store.append_batch("t", 0, make_batch([b"a", b"b", b"c"], timestamp=1000)).durable
        assert store.offset_for_timestamp("t", 0, 0) == 0
        await store.delete_records("t", 0, 1)
        assert store.offset_for_timestamp("t", 0, 0) == 1
        assert store.read("t", 0, 1, 1 << 20)  # readable, unlike offset 0
    finally:
        await store.close()


async def test_delete_records_racing_delete_topic(tmp_path: Path) -> None:
    """Seed 13 batch 67: DeleteTopics and DeleteRecords of the same topic from two connections;
    DeleteRecords went on after the topic's directory was renamed away (FileNotFoundError in
    the handler). Now it answers UNKNOWN_TOPIC_OR_PARTITION, as for a topic that is gone."""
    from kafka_helpers import make_batch

    from store import Store, StoreConfig
    from store.config import UnknownTopicOrPartitionError

    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    try:
        store.ensure_topic("t", 1)
        await store.append_batch("t", 0, make_batch([b"a", b"b", b"c"])).durable
        store.append_batch("t", 0, make_batch([b"d"]))  # staged: both calls wait for it
        drop = asyncio.create_task(store.delete_topic("t"))
        cut = asyncio.create_task(store.delete_records("t", 0, 2))
        dropped, cut_result = await asyncio.gather(drop, cut, return_exceptions=True)
        assert dropped is None
        assert isinstance(cut_result, UnknownTopicOrPartitionError), cut_result
    finally:
        await store.close()


async def test_no_fsync_of_a_deleted_topics_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Seed 13 batch 67: unacknowledged writes (QoS 0, acks=0) leave their partition to the
    interval fsync; after DeleteTopics closed its files that fsync ran on fd -1 and logged a
    critical "partition offline until restart"."""
    from kafka_helpers import make_batch

    from store import Store, StoreConfig

    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always", fsync_interval_ms=20))
    try:
        store.ensure_topic("t", 1)
        store.append_batch("t", 0, make_batch([b"a"]), sync=False)
        await asyncio.sleep(0)  # written, its fsync left to the interval timer
        await store.delete_topic("t")
        await asyncio.sleep(0.3)  # several interval ticks
        assert not [r for r in caplog.records if r.levelname == "CRITICAL"], caplog.text
    finally:
        await store.close()


async def test_concurrent_delete_records_of_one_partition(tmp_path: Path) -> None:
    """Seed 14 batch 29: two DeleteRecords of one partition wrote its `log-start-offset`
    through the same temporary file from two threads; one rename found it gone
    (FileNotFoundError in the handler). The writes now queue in order, the last floor last."""
    from kafka_helpers import make_batch

    from store import Store, StoreConfig

    store = await Store.open(tmp_path / "data", StoreConfig(fsync="never"))
    try:
        store.ensure_topic("t", 1)
        await store.append_batch("t", 0, make_batch([b"x"] * 60)).durable
        for low in range(0, 60, 3):  # a race each round: make it likely to show
            got = await asyncio.gather(
                store.delete_records("t", 0, low + 1),
                store.delete_records("t", 0, low + 2),
                store.delete_records("t", 0, low + 3),
            )
            assert got[-1] == low + 3
            floor = (tmp_path / "data" / "log" / "t-0" / "log-start-offset").read_text()
            assert floor.strip() == str(low + 3)
    finally:
        await store.close()
