"""Golden bytes for the sans-IO MQTT codec: one comment per field, checked both ways.

The paho streams were captured from paho-mqtt 2.2 talking to a tiny local socket (the capture
script is reproduced in `test_paho_live_capture`, which re-runs it and compares).
"""

from __future__ import annotations

import socket
import threading

import pytest

from mqtt_proxy.codec import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Parser,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    TopicSubscription,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
    make_properties,
)

# paho-mqtt 2.2, MQTT 3.1.1: CONNECT (user, password, will), PUBLISH QoS 1, SUBSCRIBE, PUBLISH
# QoS 0, DISCONNECT.
PAHO_V311 = (
    b"\x10\x30"  # CONNECT, remaining length 48
    b"\x00\x04MQTT"  # protocol name
    b"\x04"  # protocol level 4 (3.1.1)
    b"\xee"  # flags: user, password, will retain, will QoS 1, will, clean session
    b"\x00\x3c"  # keep alive 60 s
    b"\x00\x0bpaho-golden"  # client id
    b"\x00\x08dev/will"  # will topic
    b"\x00\x03bye"  # will payload
    b"\x00\x04user"  # user name
    b"\x00\x02pw"  # password
    b"\x32\x0c"  # PUBLISH QoS 1, remaining length 12
    b"\x00\x03a/b"  # topic
    b"\x00\x01"  # packet id 1
    b"hello"  # payload
    b"\x82\x08"  # SUBSCRIBE (flags 0b0010), remaining length 8
    b"\x00\x02"  # packet id 2
    b"\x00\x03s/#"  # filter
    b"\x02"  # options: QoS 2
    b"\x30\x07"  # PUBLISH QoS 0, remaining length 7
    b"\x00\x03a/b"  # topic
    b"hi"  # payload
    b"\xe0\x00"  # DISCONNECT
)

PAHO_V311_EVENTS = [
    Connect(
        "paho-golden",
        clean_start=True,
        keep_alive=60,
        username="user",
        password=b"pw",
        will=Will("dev/will", b"bye", qos=1, retain=True),
        protocol_level=4,
    ),
    Publish("a/b", b"hello", qos=1, packet_id=1),
    Subscribe(2, [TopicSubscription("s/#", 2)]),
    Publish("a/b", b"hi"),
    Disconnect(),
]

# paho-mqtt 2.2, MQTT 5.0: the same session with properties.
PAHO_V5 = (
    b"\x10\x37"  # CONNECT, remaining length 55
    b"\x00\x04MQTT"  # protocol name
    b"\x05"  # protocol level 5
    b"\xee"  # flags as above
    b"\x00\x3c"  # keep alive 60 s
    b"\x05"  # property length 5
    b"\x11\x00\x00\x00\x1e"  # Session Expiry Interval 30
    b"\x00\x0bpaho-golden"  # client id
    b"\x00"  # will property length 0
    b"\x00\x08dev/will"  # will topic
    b"\x00\x03bye"  # will payload
    b"\x00\x04user"  # user name
    b"\x00\x02pw"  # password
    b"\x32\x21"  # PUBLISH QoS 1, remaining length 33
    b"\x00\x03a/b"  # topic
    b"\x00\x01"  # packet id 1
    b"\x14"  # property length 20
    b"\x03\x00\x0atext/plain"  # Content Type
    b"\x26\x00\x01k\x00\x01v"  # User Property k=v
    b"hello"  # payload
    b"\x82\x0d"  # SUBSCRIBE, remaining length 13
    b"\x00\x02"  # packet id 2
    b"\x02\x0b\x07"  # property length 2: Subscription Identifier 7
    b"\x00\x05s/+/t"  # filter
    b"\x1e"  # options: retain handling 1, retain as published, no local, QoS 2
    b"\x30\x08"  # PUBLISH QoS 0, remaining length 8
    b"\x00\x03a/b"  # topic
    b"\x00"  # property length 0
    b"hi"  # payload
    b"\xe0\x00"  # DISCONNECT, normal (reason and properties omitted)
)

PAHO_V5_EVENTS = [
    Connect(
        "paho-golden",
        keep_alive=60,
        username="user",
        password=b"pw",
        will=Will("dev/will", b"bye", qos=1, retain=True),
        protocol_level=5,
        properties=make_properties(session_expiry_interval=30),
    ),
    Publish(
        "a/b",
        b"hello",
        qos=1,
        packet_id=1,
        properties=make_properties(content_type="text/plain", user_properties=[("k", "v")]),
    ),
    Subscribe(
        2,
        [TopicSubscription("s/+/t", 2, True, True, 1)],
        make_properties(subscription_identifiers=(7,)),
    ),
    Publish("a/b", b"hi"),
    Disconnect(),
]


@pytest.mark.parametrize(
    "stream,events,version", [(PAHO_V311, PAHO_V311_EVENTS, 4), (PAHO_V5, PAHO_V5_EVENTS, 5)]
)
def test_paho_streams(stream: bytes, events: list, version: int) -> None:
    parser = Parser()
    assert parser.feed(stream) == events
    assert parser.version == version
    assert b"".join(encode(e, version) for e in events) == stream
    # one byte at a time gives the same events
    p2 = Parser()
    out = []
    for i in range(len(stream)):
        out += p2.feed(stream[i : i + 1])
    assert out == events


# (event, version, exact bytes) for the server-sent side and the rest of the packet set.
GOLDEN = [
    (Connack(), 4, b"\x20\x02\x00\x00"),  # CONNACK, flags 0, return code 0
    (Connack(True), 4, b"\x20\x02\x01\x00"),  # session present
    (Connack(reason_code=0x86), 4, b"\x20\x02\x00\x04"),  # v5 0x86 -> v3 code 4
    (Connack(reason_code=0x84), 3, b"\x20\x02\x00\x01"),  # 3.1: unacceptable protocol version
    (Connack(), 5, b"\x20\x03\x00\x00\x00"),  # flags, reason, property length 0
    (
        Connack(properties=make_properties(topic_alias_maximum=10, receive_maximum=64)),
        5,
        b"\x20\x09\x00\x00\x06"  # CONNACK, rl 9, flags, reason, property length 6
        b"\x21\x00\x40"  # Receive Maximum 64
        b"\x22\x00\x0a",  # Topic Alias Maximum 10
    ),
    (Puback(7), 4, b"\x40\x02\x00\x07"),  # PUBACK packet id 7
    (Puback(7), 5, b"\x40\x02\x00\x07"),  # v5 success, no properties: reason omitted
    (Puback(7, 0x10), 5, b"\x40\x03\x00\x07\x10"),  # reason 0x10 no matching subscribers
    (Pubrec(8), 4, b"\x50\x02\x00\x08"),  # PUBREC
    (Pubrel(8), 4, b"\x62\x02\x00\x08"),  # PUBREL, flags 0b0010
    (Pubcomp(8), 4, b"\x70\x02\x00\x08"),  # PUBCOMP
    (Pubrel(9, 0x92), 5, b"\x62\x03\x00\x09\x92"),  # packet id not found
    (Suback(2, [0, 1, 0x80]), 4, b"\x90\x05\x00\x02\x00\x01\x80"),  # SUBACK granted/failure
    (Suback(2, [2, 0x87]), 5, b"\x90\x05\x00\x02\x00\x02\x87"),  # prop len 0, codes
    (Unsubscribe(3, ["a/#"]), 4, b"\xa2\x07\x00\x03\x00\x03a/#"),  # UNSUBSCRIBE flags 0b0010
    (Unsubscribe(3, ["a"]), 5, b"\xa2\x06\x00\x03\x00\x00\x01a"),  # prop len 0
    (Unsuback(3), 4, b"\xb0\x02\x00\x03"),  # UNSUBACK
    (Unsuback(3, [0x11]), 5, b"\xb0\x04\x00\x03\x00\x11"),  # prop len 0, no sub existed
    (Pingreq(), 4, b"\xc0\x00"),
    (Pingresp(), 4, b"\xd0\x00"),
    (Disconnect(), 4, b"\xe0\x00"),
    (Disconnect(0x8E), 5, b"\xe0\x01\x8e"),  # session taken over, properties omitted
    (
        Disconnect(0x95, make_properties(reason_string="big")),
        5,
        b"\xe0\x08\x95\x06"  # DISCONNECT rl 8, reason 0x95, property length 6
        b"\x1f\x00\x03big",  # Reason String
    ),
    (Auth(), 5, b"\xf0\x00"),  # AUTH success, all omitted
    (
        Auth(0x18, make_properties(authentication_method="X")),
        5,
        b"\xf0\x06\x18\x04"  # AUTH continue, property length 4
        b"\x15\x00\x01X",  # Authentication Method
    ),
    (
        Connect("c", protocol_level=3, keep_alive=10),
        3,
        b"\x10\x0f\x00\x06MQIsdp"  # CONNECT rl 15, protocol name MQIsdp
        b"\x03\x02\x00\x0a"  # level 3, clean session, keep alive 10
        b"\x00\x01c",  # client id
    ),
    (
        Publish("t", b"", qos=2, retain=True, dup=True, packet_id=0x1234),
        4,
        b"\x3d\x05\x00\x01t\x12\x34",  # PUBLISH dup|qos2|retain, topic, packet id, no payload
    ),
    (
        Publish("", b"p", properties=make_properties(topic_alias=1)),
        5,
        b"\x30\x07\x00\x00"  # PUBLISH, empty topic
        b"\x03\x23\x00\x01"  # property length 3: Topic Alias 1
        b"p",
    ),
]


@pytest.mark.parametrize("event,version,data", GOLDEN)
def test_golden(event: object, version: int, data: bytes) -> None:
    assert encode(event, version) == data  # type: ignore[arg-type]
    parser = Parser(version=version)
    assert parser.feed(data) == [event]


def test_remaining_length_multibyte() -> None:
    # 200-byte payload: remaining length 2+1+200 = 203 = 0xCB 0x01
    data = encode(Publish("t", b"x" * 200), 4)
    assert data[:3] == b"\x30\xcb\x01"
    assert Parser(version=4).feed(data) == [Publish("t", b"x" * 200)]


def _paho_capture() -> bytes:
    """Run paho-mqtt against a local socket and return the bytes it sent (v3.1.1)."""
    mqtt = pytest.importorskip("paho.mqtt.client")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    got = bytearray()

    def serve() -> None:
        c, _ = srv.accept()
        c.settimeout(10.0)
        got.extend(c.recv(65536))
        c.sendall(b"\x20\x02\x00\x00")  # CONNACK accepted
        try:  # until the client's DISCONNECT (or EOF)
            while not got.endswith(b"\xe0\x00") and (d := c.recv(65536)):
                got.extend(d)
        except TimeoutError:
            pass
        c.close()

    t = threading.Thread(target=serve)
    t.start()
    connected = threading.Event()
    cl = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="paho-golden")
    cl.on_connect = lambda *a: connected.set()
    cl.username_pw_set("user", "pw")
    cl.will_set("dev/will", b"bye", qos=1, retain=True)
    cl.connect("127.0.0.1", srv.getsockname()[1], keepalive=60)
    cl.loop_start()
    assert connected.wait(10)
    cl.publish("a/b", b"hello", qos=1)
    cl.subscribe("s/#", qos=2)
    cl.publish("a/b", b"hi", qos=0)
    cl.disconnect()
    t.join(15)
    cl.loop_stop()
    srv.close()
    return bytes(got)


def test_paho_live_capture() -> None:
    assert _paho_capture() == PAHO_V311
