"""QoS 2 flows: outbound QoS 2 resent (PUBREL / DUP PUBLISH) on reconnect, a QoS 2 PUBLISH to a
`$` topic completes, and a shared subscription hands an unfinished QoS 2 message over."""

from __future__ import annotations

from mqtt_helpers import (
    V5,
    Client,
    raw,
    read_packets,
    split_packets,
)
from mqtt_raw import (
    assert_silent,
    connect_flags_packet,
    connect_packet,
    packet,
    publish_fields,
    s16,
    subscribe_packet,
)


def test_52_outbound_qos2_resumed_after_reconnect(broker):
    """Outbound QoS 2 across a reconnect: a released message gets its PUBREL again, an
    unacknowledged one its PUBLISH with DUP and the same packet id; once both complete nothing
    is delivered a second time, not even after another reconnect."""
    persistent = connect_flags_packet(b"q2out", flags=0x00)
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


def test_64_shared_qos2_handover(broker):
    """A `$share` member gets QoS 2 messages, sends no PUBREC and disconnects: the other member
    gets every one of them at QoS 2 and completes the flow; nothing is delivered twice."""
    v5_sub = b"\x00\x01\x00" + s16(b"$share/g2/sq2/t") + b"\x02"
    a = raw(broker.port)
    a.sendall(connect_packet(b"sq2-a", 5))
    assert read_packets(a, 1)[0][0] == 0x20
    a.sendall(packet(0x82, v5_sub))
    assert read_packets(a, 1)[0] == b"\x90\x04\x00\x01\x00\x02"
    b = Client(broker.port, "sq2-b", V5).connect()
    b.subscribe("$share/g2/sq2/t", 2)
    pub = Client(broker.port, "sq2-pub", V5).connect()
    n = 6
    for i in range(n):
        pub.publish("sq2/t", f"m{i}", 2)
    # A gets its share (round robin) and leaves it unfinished.
    a.settimeout(5)
    got_a, buf = [], b""
    while not got_a:
        chunk = a.recv(65536)
        assert chunk
        got_a, buf = split_packets(buf + chunk)
    assert all(p[0] & 0xF6 == 0x34 for p in got_a), got_a
    a.close()
    got_b = b.expect(n, timeout=10)
    assert sorted(m.payload for m in got_b) == [f"m{i}".encode() for i in range(n)]
    assert all(m.qos == 2 for m in got_b)
    b.expect_none(0.5)
    for c in (b, pub):
        c.disconnect()
