"""Every refusal reaches the client: a close with input still unread must not reset the
connection before the client has read the DISCONNECT or CONNACK in flight (mqtt_proxy/connection/linger.py).

Repeated on purpose: the reset that swallowed the DISCONNECT happened about one run in three (the
Paho v5 interoperability suite's `test_flow_control2`), so one passing round proves little.
Raw sockets: a client library would hide which bytes arrived before the error.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import split_packets
from mqtt_raw import connect_packet, packet, read_until_packet, s16
from tls_helpers import make_pki

Factory = Callable[..., GatewayProcess]
ROUNDS = 30
RECEIVE_MAXIMUM = 4


def _qos2_publish_v5(pid: int, payload: bytes) -> bytes:
    return packet(0x34, s16(b"flood/x") + pid.to_bytes(2, "big") + b"\x00" + payload)


def _qos0_publish_v5(payload: bytes) -> bytes:
    return packet(0x30, s16(b"flood/x") + b"\x00" + payload)


def _flood_past_receive_maximum(s: socket.socket) -> bytes:
    """CONNECT, then 400 QoS 2 PUBLISH never released (far past Receive Maximum), one write
    each as a client library sends them: most arrive after the gateway has decided to close,
    which is what used to reset the connection. The answer is the DISCONNECT the client reads."""
    s.sendall(connect_packet(b"flooder", level=5))
    connack = read_until_packet(s, 0x20)
    assert connack and connack[0][0] == 0x20 and connack[0][3] == 0, connack
    payload = b"p" * 200
    for pid in range(1, 401):
        s.sendall(_qos2_publish_v5(pid, payload))  # BrokenPipeError here is the bug too
    got = read_until_packet(s, 0xE0)
    disconnects = [p for p in got if p[0] == 0xE0]
    assert disconnects, f"no DISCONNECT among {[hex(p[0]) for p in got]}"
    return disconnects[0]


@pytest.fixture
def gw(gateway_factory: Factory) -> GatewayProcess:
    return gateway_factory(None, "--set", f"receive_maximum={RECEIVE_MAXIMUM}")


def test_disconnect_0x93_read_every_time(gw: GatewayProcess) -> None:
    for i in range(ROUNDS):
        with socket.create_connection(("127.0.0.1", gw.port("mqtt"))) as s:
            d = _flood_past_receive_maximum(s)
            assert d[2] == 0x93, f"round {i}: {d!r}"  # Receive Maximum exceeded


def test_connack_refusal_read_by_a_client_that_keeps_sending(gw: GatewayProcess) -> None:
    """A CONNECT refused (an authentication method we do not offer: 0x8C) followed at once by
    100 KiB of PUBLISH, one write each: the client reads its CONNACK every time."""
    props = b"\x15" + s16(b"SCRAM-SHA-1")
    body = s16(b"MQTT") + bytes([5, 0x02]) + (60).to_bytes(2, "big")
    body += bytes([len(props)]) + props + s16(b"refused")
    publish = _qos0_publish_v5(b"q" * 500)
    for i in range(ROUNDS):
        with socket.create_connection(("127.0.0.1", gw.port("mqtt"))) as s:
            s.sendall(packet(0x10, body))
            for _ in range(200):
                s.sendall(publish)
            got = read_until_packet(s, 0x20)
            assert got and got[0][0] == 0x20 and got[0][3] == 0x8C, f"round {i}: {got}"


def test_disconnect_read_over_tls(gateway_factory: Factory, tmp_path: Path) -> None:
    """TLS cannot half-close: the gateway drains until the client closes (or the linger ends)."""
    pki = make_pki(tmp_path / "pki")
    gw = gateway_factory(
        None, "--mqtts-port", "0", "--set", f"receive_maximum={RECEIVE_MAXIMUM}",
        "--set", f"tls_cert={pki.server_cert}", "--set", f"tls_key={pki.server_key}",
    )  # fmt: skip
    ctx = ssl.create_default_context(cafile=pki.ca)
    for i in range(ROUNDS // 3):
        raw = socket.create_connection(("127.0.0.1", gw.port("mqtts")))
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            d = _flood_past_receive_maximum(s)
            assert d[2] == 0x93, f"round {i}: {d!r}"


def _ws_round(port: int) -> list[bytes]:
    """One WebSocket client flooding past Receive Maximum; the MQTT packets it read before
    the gateway's Close frame."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, BytesMessage, CloseConnection, Request

    ws = WSConnection(ConnectionType.CLIENT)
    mqtt_in = b""
    events: list[object] = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(10)

        def pump() -> None:
            nonlocal mqtt_in
            data = s.recv(65536)  # ConnectionResetError here is the bug
            ws.receive_data(data or None)
            for ev in ws.events():
                events.append(ev)
                if isinstance(ev, BytesMessage):
                    mqtt_in += bytes(ev.data)

        s.sendall(ws.send(Request(host="127.0.0.1", target="/mqtt", subprotocols=["mqtt"])))
        while not any(isinstance(e, AcceptConnection) for e in events):
            pump()
        s.sendall(ws.send(BytesMessage(connect_packet(b"wsflood", level=5))))
        while not split_packets(mqtt_in)[0]:
            pump()
        for pid in range(1, 401):
            s.sendall(ws.send(BytesMessage(_qos2_publish_v5(pid, b"w" * 200))))
        while not any(isinstance(e, CloseConnection) for e in events):
            pump()
    return split_packets(mqtt_in)[0]


def test_disconnect_read_over_websocket(gw: GatewayProcess) -> None:
    """WebSocket: the DISCONNECT in a binary frame, then our Close frame; the gateway waits for
    the client's Close while dropping its frames."""
    for i in range(ROUNDS // 3):
        pkts = _ws_round(gw.port("ws"))
        disconnects = [p for p in pkts if p[0] == 0xE0]
        assert disconnects and disconnects[0][2] == 0x93, f"round {i}: {pkts}"
