"""Golden bytes of the core link's bodies (store.wire, lightqueue.wire), one comment per field.

The bytes are what the link carried before the bodies moved out of store/remote.py and
lightqueue/remote.py (recorded from both versions for the same calls, identical), so a proxy and
a core built from either side of that move still understand each other. Sans-IO: no socket.
"""

from __future__ import annotations

import pytest

from lightqueue import wire as lw
from lightqueue.model import ReadResult, StoredMessage
from store import wire as sw
from store.config import StoreError, UnknownTopicOrPartitionError
from store.log import OffsetOutOfRangeError
from store.mapping import MqttProperties


def test_store_request_bodies() -> None:
    assert sw.encode_ensure_topic("newt", True) == bytes.fromhex(
        "0004" "6e657774"  # str "newt"
        "01"  # u8 force
    )  # fmt: skip
    assert sw.decode_ensure_topic(bytes.fromhex("0004 6e657774 01")) == ("newt", True)
    read = bytes.fromhex(
        "0003" "646576"  # str log topic "dev"
        "00000001"  # u32 partition
        "000000000000004d"  # i64 offset 77
        "000003e8"  # u32 max bytes 1000
    )  # fmt: skip
    assert sw.encode_read("dev", 1, 77, 1000) == read
    assert sw.decode_read(read) == ("dev", 1, 77, 1000)
    assert sw.encode_offsets_request("dev", 1) == bytes.fromhex("0003 646576 00000001")
    assert sw.decode_offsets(bytes.fromhex("0000000000000005 0000000000000009")) == (5, 9)


def test_store_append_and_durable() -> None:
    batch = b"\xaa" * 5
    body = sw.encode_append(2, True, [("dev", 1, batch), ("bad", 0, bytearray(batch))])
    assert body == bytes.fromhex(
        "00000002"  # u32 token
        "01"  # u8 sync
        "0002"  # u16 n
        "0003" "646576" "00000001" "00000005" "aaaaaaaaaa"  # str topic, u32 partition, u32 size, bytes
        "0003" "626164" "00000000" "00000005" "aaaaaaaaaa"
    )  # fmt: skip
    assert sw.decode_append(body) == (2, True, [("dev", 1, batch), ("bad", 0, batch)])
    out: list[bytes] = []
    sw.append_ok(out, 42)
    sw.append_failed(out, "no such")
    reply = b"".join(out)
    assert reply == bytes.fromhex(
        "000000000000002a" "0000"  # i64 base offset 42, str "" (no error)
        "ffffffffffffffff" "0007" "6e6f2073756368"  # i64 -1, str "no such"
    )  # fmt: skip
    assert sw.decode_append_reply(reply, 2) == [(42, ""), (-1, "no such")]
    assert sw.encode_durable(7) == bytes.fromhex("00000007 0000")  # u32 token, str "" = durable
    assert sw.decode_durable(sw.encode_durable(7, "disk")) == (7, "disk")
    with pytest.raises(sw.WireError, match="truncated APPEND") as exc:
        sw.decode_append(body[:-1])
    assert exc.value.rpc_code == 3  # the link answers BAD_REQUEST


def test_store_errors_travel_as_codes() -> None:
    for exc, code in (
        (OffsetOutOfRangeError("t", 0, 5, 0, 1), sw.OFFSET_OUT_OF_RANGE),
        (UnknownTopicOrPartitionError("t"), sw.UNKNOWN_TOPIC),
        (StoreError("full"), sw.STORE_ERROR),
    ):
        assert sw.error_code(exc) == code
        assert type(sw.store_error(code, str(exc), "t", 0, 5)) is type(exc)


def test_light_queue_read_and_messages() -> None:
    entries = [("dev", 1, 5), None, ("fab", 0, 7)]
    reply = lw.encode_read_reply(ReadResult(entries, 1, 4, 2))
    assert reply == bytes.fromhex(
        "0000000000000001" "0000000000000004" "0000000000000002"  # i64 start, next, first
        "0002" "0003" "646576" "0003" "666162"  # topics: u16 n, str "dev", str "fab"
        "00000003"  # entries: u32 n, then u16 topic index | u32 partition | i64 offset
        "0000" "00000001" "0000000000000005"
        "ffff" "00000000" "0000000000000000"  # index 0xFFFF: a void entry
        "0001" "00000000" "0000000000000007"
    )  # fmt: skip
    assert lw.decode_read_reply(reply) == ReadResult(entries, 1, 4, 2)
    assert lw.encode_read("a/b", 3, 100) == bytes.fromhex("0003 612f62 0000000000000003 00000064")
    props = MqttProperties(1, 60, "text/plain", "r/t", b"\x01", (("k", "v"),))
    msg = StoredMessage("t/x", b"pl", 1, "cid", True, props, 99, "t", 0, 7)
    body = lw.encode_messages([msg, None])
    assert body.startswith(
        bytes.fromhex(
            "00000002"  # u32 n
            "03" "01" "0000000000000063"  # u8 flags (present | retain), u8 qos, i64 ts 99
            "0003" "742f78" "00000002" "706c"  # str topic, u32 len | payload
            "0003" "636964" "0001" "74"  # str client id, str log topic
            "00000000" "0000000000000007"  # u32 partition, i64 offset
            "00000025"  # u32 len | lightqueue.codec properties (37 bytes)
        )
    )  # fmt: skip
    assert body.endswith(bytes.fromhex("00 00 0000000000000000"))  # the absent message: flags 0
    assert lw.decode_messages(body) == [msg, None]


def test_light_queue_pushed_entries() -> None:
    entries = [("dev", 1, 5), None, ("fab", 0, 7)]
    body = lw.encode_pushed([("q1", 10, entries)])
    assert body[:14] == bytes.fromhex(
        "0001"  # u16 n queues
        "0002" "7131"  # str queue "q1"
        "000000000000000a"  # i64 first sequence
    )  # fmt: skip
    assert body[14:] == lw.encode_resolve(entries)  # then topics | entries, as READ
    assert lw.decode_pushed(body) == [("q1", 10, entries)]
    with pytest.raises(sw.WireError):
        lw.decode_resolve(lw.encode_resolve(entries)[:-1])
