"""MQTT connection handling over real sockets: CONNECT negotiation, transports (TCP, TLS,
WebSocket), auth hook, keep alive, takeover, inbound PUBLISH to the store, and bad input."""

from __future__ import annotations

import socket
import ssl
import time

import pytest
from mqtt_helpers import CONNECT, V5, V311, Client, props


def raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    return s


def connect_v311(cid: bytes = b"raw", flags: int = 0x02, keepalive: int = 60) -> bytes:
    body = b"\x00\x04MQTT\x04" + bytes([flags]) + keepalive.to_bytes(2, "big")
    body += len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def connect_v5(cid: bytes = b"raw5") -> bytes:
    body = b"\x00\x04MQTT\x05\x02\x00\x3c\x00" + len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(4096)
        except (ConnectionResetError, TimeoutError):
            return out
        if not chunk:
            return out
        out += chunk


def stored(broker, topic: str) -> list[bytes]:
    """Payloads stored in the log for an MQTT topic, read back from the segment files."""
    from store.mapping import log_topic_for

    return [r.value for r in broker.records(log_topic_for(topic)) if r.key == topic.encode()]


@pytest.mark.parametrize("version", [V311, V5])
def test_01_connect_and_disconnect(embedded, version):
    c = Client(embedded.port, f"c-{version}", version).connect()
    assert embedded.server.stats()["clients_connected"] == 1
    c.disconnect()
    deadline = time.monotonic() + 5
    while embedded.server.stats()["clients_connected"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert embedded.server.stats()["clients_connected"] == 0


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_02_publish_is_stored_before_ack(broker, qos):
    c = Client(broker.port, "pub").connect()
    for i in range(10):
        c.publish("plant/line1/temp", f"{i}", qos)
    if qos == 0:
        time.sleep(0.3)
    # QoS 1/2 publish() returned after PUBACK/PUBCOMP: the record must already be in the log.
    assert stored(broker, "plant/line1/temp") == [str(i).encode() for i in range(10)]


def test_03_websocket_transport(broker):
    c = Client(broker.ws_port, "ws", V5, transport="websockets").connect()
    c.publish("ws/t", b"over ws", 1)
    assert stored(broker, "ws/t") == [b"over ws"]
    c.disconnect()


def test_04_websocket_rejects_other_paths_and_subprotocols(broker):
    s = raw(broker.ws_port)
    s.sendall(
        b"GET /other HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Protocol: mqtt\r\n\r\n"
    )
    assert read_all(s).startswith(b"HTTP/1.1 404")


def test_05_tls_transport(broker):
    c = Client(broker.tls_port, "tls", V311)
    ctx = ssl.create_default_context(cafile=str(broker.cert))
    ctx.check_hostname = False
    c.paho.tls_set_context(ctx)
    c.connect()
    c.publish("tls/t", b"secure", 1)
    assert stored(broker, "tls/t") == [b"secure"]
    c.disconnect()


def test_06_auth_hook(embedded):
    broker = embedded
    broker.server.authenticate = lambda cid, user, pw: user == "dev" and pw == b"secret"
    ok = Client(broker.port, "a1", V5).connect(username="dev", password="secret")
    ok.disconnect()
    bad5 = Client(broker.port, "a2", V5).connect(username="dev", password="nope", expect_ok=False)
    assert bad5.connack.value == 0x86
    bad3 = Client(broker.port, "a3", V311).connect(expect_ok=False)
    assert bad3.connack.value in (5, 0x87)  # v3 "not authorized"


def test_07_keepalive_timeout(broker):
    s = raw(broker.port)
    s.sendall(connect_v311(b"ka", keepalive=1))
    assert s.recv(4) == b"\x20\x02\x00\x00"
    t0 = time.monotonic()
    assert read_all(s) == b""
    assert 1.4 <= time.monotonic() - t0 <= 2.6


def test_08_pingreq_keeps_alive(broker):
    s = raw(broker.port)
    s.sendall(connect_v311(b"ping", keepalive=1))
    assert s.recv(4) == b"\x20\x02\x00\x00"
    for _ in range(4):
        time.sleep(0.5)
        s.sendall(b"\xc0\x00")
        assert s.recv(2) == b"\xd0\x00"


def test_09_server_keepalive_and_max(broker):
    c = Client(broker.port, "ska", V5).connect(keepalive=65535)
    assert c.connack_props.ServerKeepAlive == 600
    v3 = Client(broker.port, "ska3", V311).connect(keepalive=65535, expect_ok=False)
    assert v3.connack.value in (2, 0x85)  # identifier rejected, as Mosquitto


def test_10_assigned_client_id(broker):
    c = Client(broker.port, "", V5).connect()
    assert c.connack_props.AssignedClientIdentifier.startswith("lg-")
    Client(broker.port, "", V311).connect(clean=True).disconnect()
    s = raw(broker.port)
    s.sendall(connect_v311(b"", flags=0x00))  # 3.1.1: empty id needs clean session
    assert read_all(s) == b"\x20\x02\x00\x02"  # identifier rejected, then closed


def test_11_takeover(broker):
    first = Client(broker.port, "dup", V5).connect()
    second = Client(broker.port, "dup", V5).connect()
    assert first.disconnected.wait(5)
    assert first.disconnect_reason.value == 0x8E
    second.publish("to/t", b"x", 1)
    old3 = raw(broker.port)
    old3.sendall(connect_v311(b"dup3"))
    assert old3.recv(4) == b"\x20\x02\x00\x00"
    new3 = raw(broker.port)
    new3.sendall(connect_v311(b"dup3"))
    assert new3.recv(4) == b"\x20\x02\x00\x00"
    assert read_all(old3) == b""  # v3: closed without DISCONNECT


def test_12_session_expiry_capped(broker):
    c = Client(broker.port, "cap", V5).connect(
        props=props(CONNECT, SessionExpiryInterval=0xFFFFFFFF)
    )
    assert c.connack_props.SessionExpiryInterval == 7 * 24 * 3600


BAD_INPUT = [
    # (name, bytes after a good v5 CONNECT (None: instead of CONNECT), expected v5 reason)
    ("publish before connect", None, b"\x30\x05\x00\x01a" + b"xx", 0x82),
    ("second connect", True, connect_v5(b"again"), 0x82),
    ("reserved flags on subscribe", True, b"\x80\x06\x00\x01\x00\x01a\x00", 0x81),
    ("wildcard in publish topic", True, b"\x30\x06\x00\x03a/#\x00", 0x90),
    ("invalid utf-8 topic", True, b"\x30\x05\x00\x02\xff\xfe\x00", 0x81),
    ("remaining length too long", True, b"\x30\xff\xff\xff\xff\x01", 0x81),
    ("oversize packet", True, b"\x30\x80\x80\x80\x01", 0x95),
]


@pytest.mark.parametrize("name,after,data,reason", BAD_INPUT, ids=[b[0] for b in BAD_INPUT])
def test_13_bad_input_closes_only_that_client(broker, name, after, data, reason):
    bystander = Client(broker.port, "bystander", V5).connect()
    s = raw(broker.port)
    if after:
        s.sendall(connect_v5(b"bad"))
        assert s.recv(3)[:1] == b"\x20"
        s.recv(100)
    s.sendall(data)
    reply = read_all(s)
    if after:
        assert reply[:1] == b"\xe0" and reply[2] == reason, reply  # DISCONNECT with reason
    else:
        assert reply == b""  # nothing before CONNECT: just closed
    bystander.publish("still/ok", b"1", 1)
    assert not bystander.disconnected.is_set()


def test_14_protocol_version_mismatch(broker):
    s = raw(broker.port)
    body = b"\x00\x04MQTT\x06\x02\x00\x3c\x00\x01x"
    s.sendall(bytes([0x10, len(body)]) + body)
    assert read_all(s) == b"\x20\x02\x00\x01"  # unacceptable protocol version
