# ruff: noqa: F811  (the `broker` fixture is imported, then named as a test argument)
"""Issue 4 bullets the other MQTT end-to-end files left uncovered, over real sockets against a
running gateway: MQTT 3.1 (`MQIsdp`, level 3), the WebSocket subprotocol rules, outbound QoS 2
resend (PUBREL / DUP PUBLISH) on reconnect, session expiry removing state, every v5 property
reaching Kafka headers, and a delayed will that is pending across a gateway restart."""

from __future__ import annotations

import json
import socket
import time

import paho.mqtt.client as mqtt
import pytest
from mqtt_broker import broker  # noqa: F401 - the fixture
from mqtt_helpers import (
    CONNECT,
    DISCONNECT,
    PUBLISH,
    V5,
    WILLMESSAGE,
    Client,
    props,
    raw,
    read_packets,
    split_packets,
)

V31 = mqtt.MQTTv31


def connect_packet(cid: bytes, flags: int = 0x02, name: bytes = b"MQTT", level: int = 4) -> bytes:
    body = len(name).to_bytes(2, "big") + name + bytes([level, flags, 0, 60])
    body += len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def subscribe_packet(filt: bytes, qos: int, pid: int = 1) -> bytes:
    body = pid.to_bytes(2, "big") + len(filt).to_bytes(2, "big") + filt + bytes([qos])
    return bytes([0x82, len(body)]) + body


def assert_silent(s: socket.socket, wait: float = 0.5) -> None:
    s.settimeout(wait)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return
    raise AssertionError(f"unexpected bytes {data!r}")


def publish_fields(pkt: bytes) -> tuple[int, bytes, bytes]:
    """(packet id, topic, payload) of a QoS 1/2 3.1.1 PUBLISH with a one-byte remaining length."""
    tlen = int.from_bytes(pkt[2:4], "big")
    topic = pkt[4 : 4 + tlen]
    pid = int.from_bytes(pkt[4 + tlen : 6 + tlen], "big")
    return pid, topic, pkt[6 + tlen :]


def test_50_mqtt31_mqisdp_level3(broker):
    """MQTT 3.1 (`MQIsdp`, level 3): paho's v3.1 client publishes and subscribes, a persistent
    3.1 session gets what it missed, and CONNACK never sets 3.1.1's session-present bit."""
    sub = Client(broker.port, "m31-sub", V31).connect(clean=False)
    assert [getattr(c, "value", c) for c in sub.subscribe("m31/#", 2)] == [2]
    pub = Client(broker.port, "m31-pub", V31).connect()
    for i, qos in enumerate((0, 1, 2)):
        pub.publish(f"m31/{i}", f"live{i}", qos)
    got = sorted(sub.expect(3), key=lambda m: m.topic)  # three topics: no order among them
    assert [(m.topic, m.payload, m.qos) for m in got] == [
        (f"m31/{i}", f"live{i}".encode(), i) for i in range(3)
    ]
    sub.disconnect()
    for i in range(5):
        pub.publish("m31/off", f"off{i}", 1)
    sub = Client(broker.port, "m31-sub", V31).connect(clean=False)
    assert [m.payload for m in sub.expect(5)] == [f"off{i}".encode() for i in range(5)]
    sub.expect_none(0.3)
    sub.disconnect()

    # On the wire: a 3.1 CONNACK's first byte is reserved (0) even when the session resumes.
    s = raw(broker.port)
    s.sendall(connect_packet(b"m31-raw", flags=0x00, name=b"MQIsdp", level=3))
    assert read_packets(s, 1) == [b"\x20\x02\x00\x00"]
    s.sendall(subscribe_packet(b"m31raw/t", 1))
    assert read_packets(s, 1) == [b"\x90\x03\x00\x01\x01"]
    s.sendall(b"\xe0\x00")  # DISCONNECT
    s.close()
    pub.publish("m31raw/t", b"while away", 1)
    s = raw(broker.port)
    s.sendall(connect_packet(b"m31-raw", flags=0x00, name=b"MQIsdp", level=3))
    connack, publish = read_packets(s, 2)
    assert connack == b"\x20\x02\x00\x00"  # resumed (the PUBLISH proves it), bit not set
    assert publish[0] & 0xF6 == 0x32 and publish.endswith(b"while away")
    s.sendall(b"\x40\x02" + publish_fields(publish)[0].to_bytes(2, "big"))  # PUBACK
    s.close()
    pub.disconnect()


def test_51_websocket_subprotocol_and_framing(broker):
    """WebSocket on `/mqtt`: the `mqtt` subprotocol is echoed, an upgrade without it is refused,
    one MQTT packet may span frames and one frame may hold several packets, text frames close."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus
    from websockets.sync.client import connect as ws_connect

    url = f"ws://127.0.0.1:{broker.ws_port}/mqtt"
    for subprotocols in (["chat"], None):
        with pytest.raises(InvalidStatus) as exc:
            ws_connect(url, subprotocols=subprotocols, open_timeout=5)
        assert exc.value.response.status_code == 400

    # MQTT 3.1 clients offer `mqttv3.1`: accepted and echoed, and MQIsdp works over it.
    with ws_connect(url, subprotocols=["mqttv3.1"], open_timeout=5) as ws:
        assert ws.subprotocol == "mqttv3.1"
        ws.send(connect_packet(b"ws-v31", name=b"MQIsdp", level=3))
        assert ws.recv(timeout=5) == b"\x20\x02\x00\x00"

    with ws_connect(url, subprotocols=["mqtt"], open_timeout=5) as ws:
        assert ws.subprotocol == "mqtt"
        pkt = connect_packet(b"ws-frames")
        ws.send(pkt[:3])  # CONNECT split over three binary frames
        ws.send(pkt[3:9])
        ws.send(pkt[9:])
        assert ws.recv(timeout=5) == b"\x20\x02\x00\x00"
        ws.send(subscribe_packet(b"wsf/t", 1) + b"\xc0\x00")  # SUBSCRIBE + PINGREQ, one frame
        data = b""
        while len(data) < 7:
            data += ws.recv(timeout=5)
        assert data == b"\x90\x03\x00\x01\x01" + b"\xd0\x00"
        pub = Client(broker.port, "wsf-pub").connect()
        pub.publish("wsf/t", b"to ws", 1)
        (publish,), rest = split_packets(ws.recv(timeout=5))
        assert not rest and publish[0] & 0xF6 == 0x32 and publish.endswith(b"to ws")
        ws.send(b"\x40\x02" + publish_fields(publish)[0].to_bytes(2, "big"))  # PUBACK
        ws.send("text frames are not MQTT")  # MQTT 5.0 §6.0: binary frames only
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=5)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1003
        pub.disconnect()


def test_52_outbound_qos2_resumed_after_reconnect(broker):
    """Outbound QoS 2 across a reconnect: a released message gets its PUBREL again, an
    unacknowledged one its PUBLISH with DUP and the same packet id; once both complete nothing
    is delivered a second time, not even after another reconnect."""
    persistent = connect_packet(b"q2out", flags=0x00)
    s = raw(broker.port)
    s.sendall(persistent)
    assert read_packets(s, 1) == [b"\x20\x02\x00\x00"]
    s.sendall(subscribe_packet(b"q2o/t", 2))
    assert read_packets(s, 1) == [b"\x90\x03\x00\x01\x02"]
    pub = Client(broker.port, "q2o-pub").connect()
    pub.publish("q2o/t", b"one", 2)
    pub.publish("q2o/t", b"two", 2)
    first, second = read_packets(s, 2)
    assert [p[0] for p in (first, second)] == [0x34, 0x34]
    pid1, _, body1 = publish_fields(first)
    pid2, _, body2 = publish_fields(second)
    assert (body1, body2) == (b"one", b"two") and pid1 != pid2
    s.sendall(b"\x50\x02" + pid1.to_bytes(2, "big"))  # PUBREC the first only
    assert read_packets(s, 1) == [b"\x62\x02" + pid1.to_bytes(2, "big")]  # PUBREL
    s.close()  # no PUBCOMP for the first, no PUBREC for the second

    s = raw(broker.port)
    s.sendall(persistent)
    connack, rel, again = read_packets(s, 3)
    assert connack == b"\x20\x02\x01\x00"  # session present
    assert rel == b"\x62\x02" + pid1.to_bytes(2, "big")  # PUBREL re-sent, not the PUBLISH
    assert again[0] == 0x3C and again[1:] == second[1:]  # DUP, same packet id and bytes
    s.sendall(b"\x70\x02" + pid1.to_bytes(2, "big"))  # PUBCOMP 1
    s.sendall(b"\x50\x02" + pid2.to_bytes(2, "big"))  # PUBREC 2
    assert read_packets(s, 1) == [b"\x62\x02" + pid2.to_bytes(2, "big")]
    s.sendall(b"\x70\x02" + pid2.to_bytes(2, "big"))  # PUBCOMP 2
    assert_silent(s)
    s.sendall(b"\xe0\x00")
    s.close()

    s = raw(broker.port)
    s.sendall(persistent)
    assert read_packets(s, 1) == [b"\x20\x02\x01\x00"]
    assert_silent(s)  # both exchanges completed: nothing in flight, nothing re-read
    pub.publish("q2o/t", b"three", 2)
    (third,) = read_packets(s, 1)
    assert third[0] == 0x34 and publish_fields(third)[2] == b"three"
    s.close()
    pub.disconnect()


def test_53_session_expiry_removes_state(broker):
    """An expired v5 session is gone: no session present, nothing it would have queued, no
    subscription. DISCONNECT with Session Expiry 0 ends a session at once. A session that has
    not expired keeps all of it (the control)."""
    short = props(CONNECT, SessionExpiryInterval=2)
    long_ = props(CONNECT, SessionExpiryInterval=60)
    gone = Client(broker.port, "sx-gone", V5).connect(props=short)
    gone.subscribe("sx/t", 1)
    gone.disconnect()
    ended = Client(broker.port, "sx-ended", V5).connect(props=long_)
    ended.subscribe("sx/t", 1)
    ended.disconnect(props=props(DISCONNECT, SessionExpiryInterval=0))
    kept = Client(broker.port, "sx-kept", V5).connect(props=long_)
    kept.subscribe("sx/t", 1)
    kept.disconnect()
    pub = Client(broker.port, "sx-pub", V5).connect()
    pub.publish("sx/t", b"before expiry", 1)
    time.sleep(3.5)

    kept = Client(broker.port, "sx-kept", V5).connect(clean=False, props=long_)
    assert kept.session_present
    assert [m.payload for m in kept.expect(1)] == [b"before expiry"]
    for cid in ("sx-gone", "sx-ended"):
        c = Client(broker.port, cid, V5).connect(clean=False, props=long_)
        assert not c.session_present, cid
        c.expect_none(0.5)  # the queued message went with the session
        pub.publish("sx/t", f"after {cid}", 1)
        assert kept.expect(1)[0].payload == f"after {cid}".encode()
        c.expect_none(0.5)  # and so did the subscription
        c.disconnect()


def test_54_v5_properties_reach_kafka_headers(broker):
    """Every MQTT 5 PUBLISH property is carried through the store to Kafka consumers as the
    `mqtt.*` headers of INTERFACES.md; user properties become plain headers."""
    if not hasattr(broker, "gw"):
        pytest.skip("needs `lightgate serve` (the in-process broker has no Kafka listener)")
    import kafka

    pub = Client(broker.port, "kh-dev", V5).connect()
    p = props(
        PUBLISH,
        PayloadFormatIndicator=1,
        MessageExpiryInterval=3600,
        ContentType="application/json",
        ResponseTopic="kh/reply",
        CorrelationData=b"\x00\xffid",
        UserProperty=[("site", "north"), ("line", "7")],
    )
    pub.publish("kh/sensor/1", b'{"t": 21}', 1, props=p)
    pub.publish("kh/sensor/2", b"plain", 2)
    pub.disconnect()
    consumer = kafka.KafkaConsumer(
        "kh", bootstrap_servers=f"127.0.0.1:{broker.gw.port('kafka')}",
        auto_offset_reset="earliest", consumer_timeout_ms=15_000,
    )  # fmt: skip
    try:
        got = {}
        for rec in consumer:
            got[rec.key] = rec
            if len(got) == 2:
                break
    finally:
        consumer.close()
    rec = got[b"kh/sensor/1"]
    assert rec.value == b'{"t": 21}'
    h = dict(rec.headers)
    assert h["mqtt.qos"] == b"1" and h["mqtt.client_id"] == b"kh-dev"
    assert h["mqtt.payload_format"] == b"1"
    assert h["mqtt.message_expiry"] == b"3600"
    assert h["mqtt.content_type"] == b"application/json"
    assert h["mqtt.response_topic"] == b"kh/reply"
    assert h["mqtt.correlation_data"] == b"\x00\xffid"
    assert h["site"] == b"north" and h["line"] == b"7"
    plain = dict(got[b"kh/sensor/2"].headers)
    assert plain["mqtt.qos"] == b"2"
    assert not [k for k in plain if k not in ("mqtt.qos", "mqtt.client_id")]


def _wait_device_event(broker, client_id: str, event: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in broker.records("__lightgate_device_events"):
            if r.key == client_id.encode() and json.loads(r.value)["event"] == event:
                return
        time.sleep(0.05)
    raise AssertionError(f"no {event} event for {client_id}")


@pytest.mark.restart
def test_55_delayed_will_pending_across_restart(broker):
    """A v5 will waiting out its Will Delay when the gateway restarts is still published after
    that delay, with its properties (not only at session expiry, and not lost)."""
    wp = props(
        WILLMESSAGE,
        WillDelayInterval=6,
        ContentType="text/plain",
        UserProperty=[("reason", "power")],
    )
    a = Client(broker.port, "wl-dev", V5).connect(
        props=props(CONNECT, SessionExpiryInterval=600),
        will=("wl/dev", b"offline", 1, True),
        will_props=wp,
    )
    a.kill()
    _wait_device_event(broker, "wl-dev", "disconnect")  # the gateway saw the abnormal close
    broker.restart()
    watcher = Client(broker.port, "wl-watch", V5).connect()
    watcher.subscribe("wl/#", 1)
    m = watcher.expect(1, timeout=20)[0]  # retained, so it counts whenever it was published
    assert (m.topic, m.payload) == ("wl/dev", b"offline")
    assert m.props.ContentType == "text/plain"
    assert m.user_props == {"reason": "power"}
    # The gateway is still healthy for everyone else afterwards.
    other = Client(broker.port, "wl-other").connect()
    other.subscribe("wlx/t", 1)
    Client(broker.port, "wl-pub").connect().publish("wlx/t", b"fine", 1)
    assert other.expect(1)[0].payload == b"fine"


@pytest.mark.restart
def test_56_session_online_at_restart_expires_from_the_stop(broker):
    """A persistent session that was online when the gateway stopped counts its expiry from then,
    not from an earlier disconnect of the same session (that stale time expired it at once)."""
    cp = props(CONNECT, SessionExpiryInterval=8)
    c = Client(broker.port, "onr-dev", V5).connect(props=cp)
    c.subscribe("onr/t", 1)
    c.disconnect()
    c = Client(broker.port, "onr-dev", V5).connect(clean=False, props=cp)
    assert c.session_present
    time.sleep(9)  # online for longer than the session expiry since that disconnect
    c.paho.loop_stop()  # still connected when the gateway stops; no reconnect to the old port
    broker.restart()
    c = Client(broker.port, "onr-dev", V5).connect(clean=False, props=cp)
    assert c.session_present
    Client(broker.port, "onr-pub").connect().publish("onr/t", b"still subscribed", 1)
    assert c.expect(1)[0].payload == b"still subscribed"


def test_57_qos2_publish_to_dollar_topic_completes(broker):
    """A QoS 2 PUBLISH to a `$` topic is not stored, but its flow completes: PUBREC 0x00, then
    the PUBREL finds the id (PUBCOMP 0x00, not 0x92) in v5; v3.1.1 gets PUBREC and PUBCOMP."""
    for level in (5, 4):
        s = raw(broker.port)
        body = b"\x00\x04MQTT" + bytes([level, 0x02, 0, 60])
        body += b"\x00" if level == 5 else b""  # v5: empty CONNECT properties
        body += b"\x00\x05dq2-%d" % level
        s.sendall(bytes([0x10, len(body)]) + body)
        assert read_packets(s, 1)[0][0] == 0x20  # CONNACK
        topic = b"$internal/x"
        pub = len(topic).to_bytes(2, "big") + topic + b"\x00\x07"
        pub += (b"\x00" if level == 5 else b"") + b"payload"
        s.sendall(bytes([0x34, len(pub)]) + pub)
        pubrec = read_packets(s, 1)[0]
        assert pubrec[0] == 0x50 and pubrec[2:4] == b"\x00\x07", pubrec
        assert len(pubrec) == 4 or pubrec[4] == 0x00, pubrec  # success (v5 may omit the code)
        s.sendall(b"\x62\x02\x00\x07")  # PUBREL 7
        pubcomp = read_packets(s, 1)[0]
        assert pubcomp[0] == 0x70 and pubcomp[2:4] == b"\x00\x07", pubcomp
        assert len(pubcomp) == 4 or pubcomp[4] == 0x00, pubcomp  # not 0x92 (id not found)
        s.close()
