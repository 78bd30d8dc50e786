"""Malformed or out-of-spec packets: each raises RemoteProtocolError with the right reason code."""

from __future__ import annotations

import pytest

from mqtt_proxy.codec import (
    Connect,
    LocalProtocolError,
    Parser,
    Publish,
    RemoteProtocolError,
    Subscribe,
    TopicSubscription,
    encode,
)

CONNECT4 = encode(Connect("c"), 4)
CONNECT5 = encode(Connect("c", protocol_level=5), 5)


def _err(data: bytes, version: int | None = 4, **kw: object) -> RemoteProtocolError:
    parser = Parser(version=version, **kw)  # type: ignore[arg-type]
    with pytest.raises(RemoteProtocolError) as ei:
        parser.feed(data)
    # the parser is dead afterwards: the same error again
    with pytest.raises(RemoteProtocolError):
        parser.feed(b"\xc0\x00")
    return ei.value


@pytest.mark.parametrize(
    "data,code",
    [
        # wrong remaining length: PINGREQ with a body, PUBACK too long/short, CONNECT trailing
        (b"\xc0\x01\x00", 0x81),
        (b"\x40\x03\x00\x01\x00", 0x81),
        (b"\x40\x01\x00", 0x81),
        (CONNECT4[:1] + bytes([CONNECT4[1] + 1]) + CONNECT4[2:] + b"\x00", 0x81),
        # remaining length varint: five bytes, non-minimal
        (b"\x30\xff\xff\xff\xff\x01", 0x81),
        (b"\x30\x80\x00", 0x81),
        # reserved flags: PUBACK with flags, PUBREL/SUBSCRIBE without 0b0010
        (b"\x41\x02\x00\x01", 0x81),
        (b"\x60\x02\x00\x01", 0x81),
        (b"\x80\x06\x00\x01\x00\x01a\x00", 0x81),
        # reserved packet types 0 and 15 (AUTH) in 3.1.1
        (b"\x00\x00", 0x81),
        (b"\xf0\x00", 0x81),
        # invalid UTF-8 in a topic; U+0000 in a topic; control character (strict policy)
        (b"\x30\x04\x00\x02\xc3\x28", 0x81),
        (b"\x30\x04\x00\x02a\x00", 0x81),
        (b"\x30\x04\x00\x02a\x01", 0x81),
        # UTF-8 encoded surrogate U+D800
        (b"\x30\x05\x00\x03\xed\xa0\x80", 0x81),
        # wildcards in PUBLISH topic; empty topic in v3
        (b"\x30\x05\x00\x03a/+", 0x90),
        (b"\x30\x05\x00\x03a/#", 0x90),
        (b"\x30\x02\x00\x00", 0x90),
        # QoS 3, packet id 0, DUP on QoS 0
        (b"\x36\x05\x00\x01a\x00\x01", 0x81),
        (b"\x32\x05\x00\x01a\x00\x00", 0x81),
        (b"\x38\x03\x00\x01a", 0x81),
        # SUBSCRIBE: no filters, bad filters, QoS 3, reserved option bits (v3)
        (b"\x82\x02\x00\x01", 0x82),
        (b"\x82\x06\x00\x01\x00\x01#\x03", 0x81),
        (b"\x82\x06\x00\x01\x00\x01#\x04", 0x81),
        (b"\x82\x07\x00\x01\x00\x02a#\x00", 0x8F),
        (b"\x82\x08\x00\x01\x00\x03#/a\x00", 0x8F),
        (b"\x82\x07\x00\x01\x00\x02a+\x00", 0x8F),
        (b"\x82\x0c\x00\x01\x00\x07$share/\x00", 0x8F),
        (b"\x82\x0d\x00\x01\x00\x08$share/g\x00", 0x8F),
        (b"\xa2\x02\x00\x01", 0x82),
        # a second CONNECT is parsed (the Connection refuses it) but a bad one is not
        (b"\x10\x02\x00\x00", 0x81),
    ],
)
def test_bad_v311(data: bytes, code: int) -> None:
    assert _err(data).reason_code == code


@pytest.mark.parametrize(
    "data,code",
    [
        # property not allowed in PUBLISH (Session Expiry), unknown property id 0x7f
        (b"\x30\x09\x00\x01a\x05\x11\x00\x00\x00\x01", 0x81),
        (b"\x30\x06\x00\x01a\x02\x7f\x00", 0x81),
        # duplicated property (Topic Alias twice); Topic Alias 0 (Topic Alias invalid)
        (b"\x30\x09\x00\x00\x06\x23\x00\x01\x23\x00\x02", 0x82),
        (b"\x30\x07\x00\x01a\x03\x23\x00\x00", 0x94),
        # empty topic without alias
        (b"\x30\x03\x00\x00\x00", 0x82),
        # property length past the end
        (b"\x30\x05\x00\x01a\x09\x01", 0x81),
        # payload format indicator 2
        (b"\x30\x06\x00\x01a\x02\x01\x02", 0x82),
        # reason code not allowed in PUBACK, in DISCONNECT
        (b"\x40\x03\x00\x01\x05", 0x81),
        (b"\xe0\x01\x01", 0x81),
        # SUBSCRIBE: retain handling 3, reserved bits, no local on a shared subscription
        (b"\x82\x07\x00\x01\x00\x00\x01a\x30", 0x81),
        (b"\x82\x07\x00\x01\x00\x00\x01a\x40", 0x81),
        (b"\x82\x10\x00\x01\x00\x00\x0a$share/g/a\x04", 0x82),
        # two subscription identifiers in SUBSCRIBE
        (b"\x82\x0b\x00\x01\x04\x0b\x01\x0b\x02\x00\x01a\x00", 0x82),
    ],
)
def test_bad_v5(data: bytes, code: int) -> None:
    assert _err(data, 5).reason_code == code


def test_packet_before_connect() -> None:
    e = _err(b"\x30\x03\x00\x01a", None)
    assert e.reason_code == 0x82 and "before CONNECT" in str(e)
    assert _err(b"\xc0\x00", None).reason_code == 0x82


def test_protocol_mismatch() -> None:
    # level 6 -> 0x84 (v3 CONNACK code 1 on the wire); MQIsdp with level 4; MQTT with level 3
    bad_level = CONNECT4[:8] + b"\x06" + CONNECT4[9:]
    e = _err(bad_level, None)
    assert (e.reason_code, e.protocol_level) == (0x84, 6)
    e = _err(b"\x10\x0f\x00\x06MQIsdp\x04\x02\x00\x0a\x00\x01c", None)
    assert (e.reason_code, e.protocol_level) == (0x84, 4)
    assert _err(CONNECT4[:8] + b"\x03" + CONNECT4[9:], None).reason_code == 0x84
    # not an MQTT protocol name at all
    assert _err(b"\x10\x0d\x00\x04HTTP\x04\x02\x00\x0a\x00\x01c", None).reason_code == 0x82
    # v5 CONNECT with a malformed property keeps the level for the CONNACK reply
    bad5 = b"\x10\x10\x00\x04MQTT\x05\x02\x00\x0a\x03\x21\x00\x00\x00\x01c"
    e = _err(bad5, None)
    assert (e.reason_code, e.protocol_level) == (0x82, 5)


def test_connect_flag_rules() -> None:
    base = bytearray(CONNECT4)
    for flags in (0x03, 0x08, 0x20, 0x1C, 0x42):  # reserved; will QoS/retain w/o will; QoS 3; pw
        data = bytes(base[:9]) + bytes([flags]) + bytes(base[10:])
        assert _err(data, None).reason_code == 0x81, hex(flags)


def test_oversize_refused_before_body() -> None:
    parser = Parser(version=4, max_packet_size=100)
    # only the fixed header of a 1 MiB PUBLISH: refused at once, body never buffered
    with pytest.raises(RemoteProtocolError) as ei:
        parser.feed(b"\x30\x80\x80\x40")
    assert ei.value.reason_code == 0x95
    assert parser.buffered == 0
    # exactly the limit is fine: 100 bytes total = 2 header + 98
    ok = encode(Publish("t", b"x" * 95), 4)
    assert len(ok) == 100
    assert len(Parser(version=4, max_packet_size=100).feed(ok)) == 1


def test_packets_before_error_are_kept() -> None:
    good = encode(Publish("a", b"1"), 4)
    with pytest.raises(RemoteProtocolError) as ei:
        Parser(version=4).feed(good + good + b"\x00\x00")
    assert len(ei.value.packets) == 2


def test_lax_utf8_policy_allows_controls_not_nul() -> None:
    assert Parser(version=4, strict_utf8=False).feed(b"\x30\x04\x00\x02a\x01")[0].topic == "a\x01"
    assert _err(b"\x30\x04\x00\x02a\x00", 4, strict_utf8=False).reason_code == 0x81


@pytest.mark.parametrize(
    "make",
    [
        lambda: Publish("a/+"),
        lambda: Publish("a", qos=3),
        lambda: Publish("a", qos=1),
        lambda: Publish("a", packet_id=5),
        lambda: Publish("a", dup=True),
        lambda: Publish(""),
        lambda: Subscribe(1, []),
        lambda: TopicSubscription("a/#/b"),
        lambda: TopicSubscription("$share/g/a", no_local=True),
        lambda: Connect("c", protocol_level=6),
        lambda: Connect("c", password=b"x"),
    ],
)
def test_local_errors(make: object) -> None:
    with pytest.raises(LocalProtocolError):
        make()  # type: ignore[operator]


def test_v3_cannot_encode_v5_only() -> None:
    from mqtt_proxy.codec import Auth, Connack, Puback

    with pytest.raises(LocalProtocolError):
        encode(Auth(), 4)
    with pytest.raises(LocalProtocolError):
        encode(Puback(1, 0x80), 4)
    with pytest.raises(LocalProtocolError):
        encode(Connack(reason_code=0x8F), 4)  # no v3 code: the server just closes


@pytest.mark.parametrize("step", [65536, 1000, 65537])
def test_large_packet_gathered_in_chunks(step: int) -> None:
    big = encode(Publish("t", b"x" * (1 << 20)), 4)
    small = encode(Publish("u", b"y"), 4)
    data = small + big + small
    parser = Parser(version=4, max_packet_size=2 << 20)
    out = []
    for i in range(0, len(data), step):
        out += parser.feed(data[i : i + step])
        assert parser.buffered < len(big) + step
    assert [p.topic for p in out] == ["u", "t", "u"]
    assert out[1].payload == b"x" * (1 << 20)
    assert parser.buffered == 0
