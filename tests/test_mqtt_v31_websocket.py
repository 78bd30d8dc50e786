"""Other ways in: MQTT 3.1 (`MQIsdp`, level 3) and MQTT over WebSocket (subprotocol rules, framing)."""

from __future__ import annotations

import paho.mqtt.client as mqtt
import pytest
from mqtt_helpers import (
    Client,
    raw,
    read_packets,
    split_packets,
)
from mqtt_raw import (
    connect_flags_packet,
    publish_fields,
    subscribe_packet,
)

V31 = mqtt.MQTTv31


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
    s.sendall(connect_flags_packet(b"m31-raw", flags=0x00, name=b"MQIsdp", level=3))
    assert read_packets(s, 1) == [b"\x20\x02\x00\x00"]
    s.sendall(subscribe_packet(b"m31raw/t", 1))
    assert read_packets(s, 1) == [b"\x90\x03\x00\x01\x01"]
    s.sendall(b"\xe0\x00")  # DISCONNECT
    s.close()
    pub.publish("m31raw/t", b"while away", 1)
    s = raw(broker.port)
    s.sendall(connect_flags_packet(b"m31-raw", flags=0x00, name=b"MQIsdp", level=3))
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
        ws.send(connect_flags_packet(b"ws-v31", name=b"MQIsdp", level=3))
        assert ws.recv(timeout=5) == b"\x20\x02\x00\x00"

    with ws_connect(url, subprotocols=["mqtt"], open_timeout=5) as ws:
        assert ws.subprotocol == "mqtt"
        pkt = connect_flags_packet(b"ws-frames")
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
