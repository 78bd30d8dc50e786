"""The sans-IO connection state machine: a linked client/server pair, bytes in, events out."""

from __future__ import annotations

import pytest

from mqtt_proxy.codec import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    LocalProtocolError,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    RemoteProtocolError,
    Suback,
    Subscribe,
    TopicSubscription,
    Unsuback,
    Unsubscribe,
    chunk_kind,
    encode,
    make_properties,
)
from mqtt_proxy.codec.connection import (
    CLIENT,
    CONNECTED,
    CONNECTING,
    DISCONNECTED,
    SERVER,
    TRANSITIONS,
    Connection,
    State,
)


def pair(
    version: int = 4, connect_props: dict | None = None, connack_props: dict | None = None
) -> tuple[Connection, Connection]:
    """A connected (client, server) pair; every byte goes through both state machines."""
    client, server = Connection(CLIENT), Connection(SERVER)
    c = Connect("dev", protocol_level=version, properties=make_properties(**(connect_props or {})))
    assert server.receive_data(client.send(c)) == [c]
    assert server.state is CONNECTING
    ack = Connack(properties=make_properties(**(connack_props or {})))
    assert client.receive_data(server.send(ack)) == [ack]
    assert client.state is server.state is CONNECTED
    return client, server


def xfer(sender: Connection, receiver: Connection, event: object) -> list:
    return receiver.receive_data(sender.send(event))


# (state, sender, event, exact bytes, next state), v3.1.1 unless the event is v5-only
TABLE = [
    (CONNECTED, CLIENT, Publish("a", b"x"), b"\x30\x04\x00\x01ax", CONNECTED),
    (
        CONNECTED,
        SERVER,
        Publish("a", b"x", 1, packet_id=1),
        b"\x32\x06\x00\x01a\x00\x01x",
        CONNECTED,
    ),
    (
        CONNECTED,
        CLIENT,
        Subscribe(1, [TopicSubscription("a")]),
        b"\x82\x06\x00\x01\x00\x01a\x00",
        CONNECTED,
    ),
    (CONNECTED, SERVER, Suback(1, [0]), b"\x90\x03\x00\x01\x00", CONNECTED),
    (CONNECTED, CLIENT, Unsubscribe(1, ["a"]), b"\xa2\x05\x00\x01\x00\x01a", CONNECTED),
    (CONNECTED, SERVER, Unsuback(1), b"\xb0\x02\x00\x01", CONNECTED),
    (CONNECTED, CLIENT, Pingreq(), b"\xc0\x00", CONNECTED),
    (CONNECTED, SERVER, Pingresp(), b"\xd0\x00", CONNECTED),
    (CONNECTED, CLIENT, Pubrel(4), b"\x62\x02\x00\x04", CONNECTED),
    (CONNECTED, SERVER, Pubcomp(4), b"\x70\x02\x00\x04", CONNECTED),
    (CONNECTED, CLIENT, Disconnect(), b"\xe0\x00", DISCONNECTED),
]


@pytest.mark.parametrize("state,sender,event,data,nxt", TABLE)
def test_table_both_ways(
    state: State, sender: object, event: object, data: bytes, nxt: State
) -> None:
    client, server = pair()
    src, dst = (client, server) if sender is CLIENT else (server, client)
    assert src.state is state
    assert src.send(event) == data
    assert dst.receive_data(data) == [event]
    assert src.state is dst.state is nxt


@pytest.mark.parametrize(
    "event",
    [Suback(1, [0]), Unsuback(1), Pingresp(), Connack()],
    ids=lambda e: type(e).__name__,
)
def test_server_only_packets_from_client(event: object) -> None:
    client, server = pair()
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(event, 4))  # type: ignore[arg-type]
    assert ei.value.reason_code == 0x82
    assert "client may not send" in str(ei.value) and "CONNECTED" in str(ei.value)
    with pytest.raises(LocalProtocolError):
        client.send(event)


@pytest.mark.parametrize(
    "event", [Subscribe(1, [TopicSubscription("a")]), Pingreq(), Connect("x")], ids=repr
)
def test_client_only_packets_from_server(event: object) -> None:
    client, server = pair()
    with pytest.raises(RemoteProtocolError):
        client.receive_data(encode(event, 4))  # type: ignore[arg-type]


def test_second_connect() -> None:
    client, server = pair(5)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Connect("dev", protocol_level=5), 5))
    assert "CONNECT in state CONNECTED" in str(ei.value)
    assert server.error_bytes(ei.value) == b"\xe0\x01\x82"  # v5 DISCONNECT protocol error
    assert server.state is DISCONNECTED


def test_packet_before_connect_gets_no_connack_v3() -> None:
    server = Connection(SERVER)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(b"\xc0\x00")
    assert server.error_bytes(ei.value) == b""  # v3 has no code for it: just close


def test_unsupported_version_connack() -> None:
    server = Connection(SERVER)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(b"\x10\x0d\x00\x04MQTT\x06\x02\x00\x0a\x00\x01c")
    assert server.error_bytes(ei.value) == b"\x20\x02\x00\x01"  # v3 CONNACK code 1


def test_v5_connect_error_connack() -> None:
    server = Connection(SERVER)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(b"\x10\x10\x00\x04MQTT\x05\x02\x00\x0a\x03\x21\x00\x00\x00\x01c")
    assert server.error_bytes(ei.value) == b"\x20\x03\x00\x82\x00"  # CONNACK protocol error


def test_oversize_after_connect_v5() -> None:
    client, server = pair(5, connack_props={"maximum_packet_size": 64})
    with pytest.raises(LocalProtocolError):  # the client knows the server's limit
        client.send(Publish("a", b"x" * 100))
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("a", b"x" * 100), 5))
    assert server.error_bytes(ei.value) == b"\xe0\x01\x95"


def test_connack_refused() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    xfer(client, server, Connect("c", protocol_level=5))
    assert xfer(server, client, Connack(reason_code=0x87)) == [Connack(reason_code=0x87)]
    assert client.state is server.state is DISCONNECTED
    with pytest.raises(LocalProtocolError):
        server.send(Pingresp())


def test_early_client_packets_allowed() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    data = client.send(Connect("c")) + client.send(Publish("a", b"1"))
    assert [type(p).__name__ for p in server.receive_data(data)] == ["Connect", "Publish"]
    assert server.state is CONNECTING
    with pytest.raises(LocalProtocolError):  # but the server answers only after CONNACK
        server.send(Publish("a", b"1"))


def test_enhanced_auth() -> None:
    client, server = Connection(CLIENT), Connection(SERVER)
    m = make_properties(authentication_method="SCRAM")
    xfer(client, server, Connect("c", protocol_level=5, properties=m))
    xfer(server, client, Auth(0x18, m))
    xfer(client, server, Auth(0x18, m))
    xfer(server, client, Connack(properties=m))
    assert server.state is CONNECTED
    xfer(client, server, Auth(0x19, m))  # re-authentication
    assert server.state is CONNECTED


def test_server_disconnect_v3_is_local_error() -> None:
    client, server = pair(4)
    with pytest.raises(LocalProtocolError):
        server.send(Disconnect())
    client, server = pair(5)
    assert xfer(server, client, Disconnect(0x8E)) == [Disconnect(0x8E)]


def test_inbound_topic_alias() -> None:
    client, server = pair(5, connack_props={"topic_alias_maximum": 2})
    a1 = make_properties(topic_alias=1)
    got = xfer(client, server, Publish("x/y", b"1", properties=a1))
    assert got[0].topic == "x/y"
    got = xfer(client, server, Publish("", b"2", properties=a1))
    assert got[0].topic == "x/y" and got[0].payload == b"2"
    # alias beyond the maximum: 0x94; unknown alias: 0x82
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("z", properties=make_properties(topic_alias=3)), 5))
    assert ei.value.reason_code == 0x94
    _, server = pair(5, connack_props={"topic_alias_maximum": 2})
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("", properties=make_properties(topic_alias=2)), 5))
    assert ei.value.reason_code == 0x82


def test_topic_alias_off_by_default() -> None:
    _, server = pair(5)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("z", properties=make_properties(topic_alias=1)), 5))
    assert ei.value.reason_code == 0x94
    assert server.error_bytes(ei.value) == b"\xe0\x01\x94"


def test_outbound_topic_alias() -> None:
    client, server = pair(5, connect_props={"topic_alias_maximum": 1})
    assert server.outbound_topic_alias("a") == (1, True)
    assert server.outbound_topic_alias("a") == (1, False)
    assert server.outbound_topic_alias("b") == (None, True)
    xfer(server, client, Publish("a", properties=make_properties(topic_alias=1)))
    with pytest.raises(LocalProtocolError):
        server.send(Publish("a", properties=make_properties(topic_alias=2)))


def test_receive_maximum_inbound() -> None:
    client, server = pair(5, connack_props={"receive_maximum": 2})
    for pid in (1, 2):
        xfer(client, server, Publish("a", b"", 1, packet_id=pid))
    # a DUP retransmission of an id in flight does not count again
    server.receive_data(encode(Publish("a", b"", 1, dup=True, packet_id=2), 5))
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("a", b"", 1, packet_id=3), 5))
    assert ei.value.reason_code == 0x93
    # acknowledging frees the slot
    client, server = pair(5, connack_props={"receive_maximum": 1})
    xfer(client, server, Publish("a", b"", 2, packet_id=1))
    xfer(server, client, Pubrec(1))
    xfer(client, server, Pubrel(1))
    xfer(server, client, Pubcomp(1))
    xfer(client, server, Publish("a", b"", 1, packet_id=2))
    xfer(server, client, Puback(2))
    xfer(client, server, Publish("a", b"", 1, packet_id=3))


def test_receive_maximum_outbound() -> None:
    client, server = pair(5, connect_props={"receive_maximum": 1})
    assert server.send_quota == 1
    xfer(server, client, Publish("a", b"", 1, packet_id=9))
    assert server.send_quota == 0
    with pytest.raises(LocalProtocolError):
        server.send(Publish("a", b"", 1, packet_id=10))
    xfer(client, server, Puback(9))
    assert server.send_quota == 1
    server.publish_sent(11)  # a template written without send()
    assert server.send_quota == 0


def test_errors_keep_earlier_packets() -> None:
    _, server = pair(4)
    data = encode(Publish("a", b"1"), 4) + encode(Suback(1, [0]), 4)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(data)
    assert ei.value.packets == [Publish("a", b"1")]


def test_every_state_in_table() -> None:
    assert set(TRANSITIONS) == set(State)
    assert TRANSITIONS[DISCONNECTED] == {}


def test_maximum_qos_and_retain_available() -> None:
    client, server = pair(5, connack_props={"maximum_qos": 1, "retain_available": 0})
    xfer(client, server, Publish("a", b"", 1, packet_id=1))
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("a", b"", 2, packet_id=2), 5))
    assert ei.value.reason_code == 0x9B
    _, server = pair(5, connack_props={"retain_available": 0})
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Publish("a", b"", retain=True), 5))
    assert ei.value.reason_code == 0x9A


def test_disconnect_session_expiry_after_zero() -> None:
    client, server = pair(5)  # CONNECT without Session Expiry Interval: 0
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(encode(Disconnect(0, make_properties(session_expiry_interval=60)), 5))
    assert ei.value.reason_code == 0x82
    client, server = pair(5, connect_props={"session_expiry_interval": 10})
    xfer(client, server, Disconnect(0, make_properties(session_expiry_interval=60)))
    assert server.state is DISCONNECTED


def test_packets_after_disconnect() -> None:
    _, server = pair(4)
    with pytest.raises(RemoteProtocolError) as ei:
        server.receive_data(b"\xe0\x00\xc0\x00")
    assert ei.value.packets == [Disconnect()]


def test_failed_send_keeps_state() -> None:
    client, server = pair(4)
    with pytest.raises(LocalProtocolError):
        client.send(Disconnect(0x8E))  # v3 cannot carry a reason code
    assert client.state is CONNECTED  # a refused send changes nothing


def test_table_rows_are_reachable() -> None:
    for state, rows in TRANSITIONS.items():
        for (role, kind), nxt in rows.items():
            assert role in (CLIENT, SERVER) and isinstance(nxt, State), (state, kind)


def test_v3_chunk_of_pubacks_completes_what_was_sent() -> None:
    """A 3.1.1 read chunk of PUBACKs only (a QoS 1 reader) still takes its ids out of flight when
    they were sent through `send`: the same ids can go out again (and nothing is left over)."""
    client, server = pair(4)
    for pid in (7, 8, 9):
        xfer(server, client, Publish("a", b"x", 1, packet_id=pid))
    chunk = b"".join(encode(Puback(pid)) for pid in (7, 8, 9))
    assert server.receive_data(chunk) == [Puback(7), Puback(8), Puback(9)]
    for pid in (7, 8, 9):  # raised "already in flight" had the acks not completed them
        xfer(server, client, Publish("a", b"y", 1, packet_id=pid))
    assert server.receive_data(chunk) == [Puback(7), Puback(8), Puback(9)]
    assert server.send_quota == server.peer_receive_maximum


@pytest.mark.parametrize("n", [1, 2, 16, 17, 300])
def test_chunk_kind(n: int) -> None:
    """A chunk's one packet type, short (loop) or long (set): a different packet anywhere makes
    it mixed."""
    pubs = [Publish("a", b"x", 0)] * n
    assert chunk_kind(pubs) is Publish and chunk_kind([Puback(1)] * n) is Puback
    for i in (0, n // 2, n - 1):
        mixed = list(pubs)
        mixed[i] = Puback(1)
        assert chunk_kind(mixed) is (Puback if n == 1 else None)
    assert chunk_kind([]) is None
