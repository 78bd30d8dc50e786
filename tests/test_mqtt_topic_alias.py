"""MQTT 5 topic aliases end to end: server-assigned on outbound PUBLISH, and inbound checks.

Subscribers are paho v5 (paho-mqtt 2.2 does not resolve aliases: it hands the application an
empty topic and the TopicAlias property, so the test maps them as an application must) and raw
sockets that read the bytes on the wire with a decoder written here
(not the gateway's codec). Publishers are paho. The
`broker` fixture runs each test against `lightgate serve` in one process and in the split shape
(`mqtt_processes=1`).
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

from mqtt_broker import InProcessBroker
from mqtt_helpers import CONNECT, V5, V311, Client, props, raw, read_packets, split_packets
from mqtt_raw import packet, s16, varint

# -- a raw v5 client: hand-built packets, hand-decoded PUBLISH -------------------------------


def v5_connect(client_id: str, alias_max: int = 0, expiry: int = 0, clean: bool = True) -> bytes:
    p = b""
    if alias_max:
        p += b"\x22" + struct.pack(">H", alias_max)  # Topic Alias Maximum
    if expiry:
        p += b"\x11" + struct.pack(">I", expiry)  # Session Expiry Interval
    body = s16(b"MQTT") + bytes((5, 0x02 if clean else 0)) + b"\x00\x3c" + varint(len(p)) + p
    return packet(0x10, body + s16(client_id.encode()))


def v5_subscribe(filt: str, qos: int, pid: int = 1) -> bytes:
    return packet(0x82, struct.pack(">H", pid) + b"\x00" + s16(filt.encode()) + bytes((qos,)))


def decode_publish(pkt: bytes) -> dict[str, Any]:
    """A v5 PUBLISH -> topic (as on the wire, maybe ""), alias (or None), payload, qos, dup, pid."""
    assert pkt[0] >> 4 == 3, pkt
    qos = (pkt[0] >> 1) & 3
    i = 1
    while pkt[i] & 0x80:
        i += 1
    i += 1
    n = struct.unpack_from(">H", pkt, i)[0]
    topic = pkt[i + 2 : i + 2 + n].decode()
    i += 2 + n
    pid = 0
    if qos:
        pid = struct.unpack_from(">H", pkt, i)[0]
        i += 2
    plen = 0
    shift = 0
    while True:
        b = pkt[i]
        i += 1
        plen |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    end = i + plen
    alias = None
    while i < end:  # these tests only send properties the gateway carries as is: none
        assert pkt[i] == 0x23, f"unexpected property 0x{pkt[i]:02x}"
        alias = struct.unpack_from(">H", pkt, i + 1)[0]
        i += 3
    return {
        "topic": topic,
        "alias": alias,
        "payload": pkt[end:],
        "qos": qos,
        "dup": bool(pkt[0] & 8),
        "pid": pid,
    }


def raw_v5(port: int, client_id: str, filt: str, qos: int = 0, **connect: Any) -> socket.socket:
    s = raw(port)
    s.sendall(v5_connect(client_id, **connect))
    (ack,) = read_packets(s, 1)
    assert ack[0] == 0x20 and ack[3] == 0, ack
    if filt:
        s.sendall(v5_subscribe(filt, qos))
        (suback,) = read_packets(s, 1)
        assert suback[0] == 0x90 and suback[-1] == qos, suback
    return s


def check_aliases(got: list[dict[str, Any]], topics: list[str], maximum: int) -> None:
    """Each delivered PUBLISH resolves to `topics[i]`, as a client with `maximum` aliases maps
    them: the first use of an alias names its topic, later ones send an empty topic."""
    mapping: dict[int, str] = {}
    for g, want in zip(got, topics, strict=True):
        a = g["alias"]
        if a is None:
            assert g["topic"] == want
            continue
        assert 1 <= a <= maximum
        if g["topic"]:
            mapping[a] = g["topic"]
        assert mapping.get(a) == want, (g, want)


def paho_resolve(got: list[Any], mapping: dict[int, str]) -> list[str]:
    """The topics of paho's messages, aliases resolved as the application must with paho-mqtt
    2.2 (MQTT 5 §3.3.2.3.4: a topic name with an alias sets it, an empty one uses it)."""
    out = []
    for m in got:
        alias = getattr(m.props, "TopicAlias", None)
        if alias is not None and m.topic:
            mapping[alias] = m.topic
        out.append(m.topic or mapping[alias])
    return out


# -- tests -----------------------------------------------------------------------------------


def test_01_wire_first_names_then_empty(broker):  # noqa: F811
    """On the wire: topic + alias on first use, then empty topic + alias; past the client's
    maximum, full topics without an alias; clients that did not ask get none."""
    s = raw_v5(broker.port, "alias2", "ra/#", alias_max=2)
    plain5 = raw_v5(broker.port, "plain5", "ra/#")  # v5, no Topic Alias Maximum
    v3 = Client(broker.port, "v3", V311).connect()
    v3.subscribe("ra/#", 0)
    pub = Client(broker.port, "pub", V5).connect()
    topics = ["ra/a", "ra/a", "ra/b", "ra/b", "ra/c", "ra/c", "ra/a", "ra/b"]
    for i, t in enumerate(topics):
        pub.publish(t, f"m{i}".encode(), 0)
    got = [decode_publish(p) for p in read_packets(s, len(topics))]
    # Order is kept per topic (MQTT's promise), not across the topics of a wildcard.
    want = [topics[int(g["payload"][1:])] for g in got]
    assert sorted(g["payload"] for g in got) == sorted(f"m{i}".encode() for i in range(8))
    check_aliases(got, want, 2)
    by_topic: dict[str, list[dict[str, Any]]] = {}
    for g, t in zip(got, want, strict=True):
        by_topic.setdefault(t, []).append(g)
    aliased = [t for t, gs in by_topic.items() if gs[0]["alias"] is not None]
    assert len(aliased) == 2  # the maximum, all used: the third topic has none
    for t in aliased:
        first, *later = by_topic[t]
        assert first["topic"] == t  # first use names the topic
        assert later and all(g["topic"] == "" and g["alias"] == first["alias"] for g in later)
    assert len({by_topic[t][0]["alias"] for t in aliased}) == 2
    for g in [decode_publish(p) for p in read_packets(plain5, len(topics))]:
        assert g["alias"] is None and g["topic"].startswith("ra/")
    assert sorted(m.topic for m in v3.expect(len(topics))) == sorted(topics)
    s.close()
    plain5.close()


def test_02_paho_many_topics_more_than_aliases(broker):  # noqa: F811
    """paho v5 with TopicAliasMaximum gets every message with its topic or an alias that maps
    to it, with more topics than aliases; the gateway writes fewer bytes than full topic names
    would need."""
    sub = Client(broker.port, "pahosub", V5).connect(props=props(CONNECT, TopicAliasMaximum=5))
    sub.subscribe("dev/+/telemetry", 0)
    pub = Client(broker.port, "pub", V5).connect()
    before = broker.stats()
    want = []
    for i in range(300):
        topic = f"dev/{i % 20}/telemetry"
        payload = i.to_bytes(4, "big") * 16  # 64 bytes of telemetry
        pub.publish(topic, payload, 0)
        want.append((topic, payload))
    got = sub.expect(len(want), timeout=30)
    mapping: dict[int, str] = {}
    resolved = paho_resolve(got, mapping)
    assert set(mapping) == {1, 2, 3, 4, 5}
    assert sorted(zip((m.payload for m in got), resolved, strict=True)) == sorted(
        (p, t) for t, p in want
    )
    # Without aliases each PUBLISH is 2 + 2 + len(topic) + 1 + 64 bytes.
    full = sum(5 + len(t) + len(p) for t, p in want)
    deadline = time.monotonic() + 10
    while True:  # the split shape reports the proxy's counters with a delay
        after = broker.stats()
        sent = after["bytes_sent"] - before["bytes_sent"]
        if after["messages_sent"] - before["messages_sent"] >= len(want):
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.2)
    # Five topics took aliases 1..5: each first PUBLISH is 3 bytes longer (the alias), the 14
    # later ones 12 or 13 shorter (no 15- or 16-byte topic name, a 3-byte alias)
    assert full - 5 * (14 * 13 - 3) <= sent <= full - 5 * (14 * 12 - 3), (sent, full)


def test_03_qos1_resend_after_reconnect_carries_the_topic(broker):  # noqa: F811
    """In-flight QoS 1 messages resent on a new connection carry their topic (aliases do not
    outlive the connection), and the new connection starts its aliases over."""
    s = raw_v5(broker.port, "q1", "rq/#", 1, alias_max=10, expiry=300, clean=False)
    pub = Client(broker.port, "pub", V5).connect()
    pub.publish("rq/x", b"1", 1)
    pub.publish("rq/x", b"2", 1)
    got = [decode_publish(p) for p in read_packets(s, 2)]
    assert got[0]["topic"] == "rq/x" and got[0]["alias"]
    assert got[1]["topic"] == "" and got[1]["alias"] == got[0]["alias"]
    s.close()  # unacked: both are in flight
    time.sleep(0.3)
    s = raw(broker.port)
    s.sendall(v5_connect("q1", alias_max=10, expiry=300, clean=False))
    ack, *resent = read_packets(s, 3)
    assert ack[0] == 0x20 and ack[2] == 1  # session present
    resent_d = [decode_publish(p) for p in resent]
    for g, payload in zip(resent_d, (b"1", b"2"), strict=True):
        assert (g["topic"], g["alias"], g["payload"], g["dup"]) == ("rq/x", None, payload, True)
        s.sendall(b"\x40\x02" + struct.pack(">H", g["pid"]))  # PUBACK
    pub.publish("rq/x", b"3", 1)
    pub.publish("rq/x", b"4", 1)
    fresh = [decode_publish(p) for p in read_packets(s, 2)]
    assert fresh[0]["topic"] == "rq/x" and fresh[0]["alias"]  # named again on this connection
    assert fresh[1]["topic"] == "" and fresh[1]["alias"] == fresh[0]["alias"]
    assert [g["payload"] for g in fresh] == [b"3", b"4"]
    s.close()


def test_04_inbound_alias_limits(broker):  # noqa: F811
    """Inbound: CONNACK announces our Topic Alias Maximum; an alias above it is 0x94."""
    s = raw(broker.port)
    s.sendall(v5_connect("in"))
    (ack,) = read_packets(s, 1)
    assert b"\x22\x00\x40" in ack[5:]  # Topic Alias Maximum 64 in CONNACK's properties
    good = packet(0x30, s16(b"in/t") + b"\x03\x23\x00\x40" + b"x")  # alias 64: fine
    again = packet(0x30, s16(b"") + b"\x03\x23\x00\x40" + b"y")
    over = packet(0x30, s16(b"in/t") + b"\x03\x23\x00\x41" + b"z")  # alias 65
    sub = Client(broker.port, "insub", V5).connect()
    sub.subscribe("in/#", 0)
    s.sendall(good + again + over)
    (disc,) = read_packets(s, 1)
    assert disc == b"\xe0\x01\x94"  # DISCONNECT, Topic Alias invalid
    assert [(m.topic, m.payload) for m in sub.expect(2)] == [("in/t", b"x"), ("in/t", b"y")]
    s.close()


def test_05_off_by_config(tmp_path: Path) -> None:
    """topic_alias_out = false: no alias even for a client that asks."""
    b = InProcessBroker(tmp_path / "data", {"topic_alias_out": False}).start()
    try:
        s = raw_v5(b.port, "off", "of/#", alias_max=10)
        pub = Client(b.port, "pub", V5).connect()
        for i in range(3):
            pub.publish("of/t", str(i).encode(), 0)
        for g in [decode_publish(p) for p in read_packets(s, 3)]:
            assert (g["topic"], g["alias"]) == ("of/t", None)
        s.close()
    finally:
        b.stop()


def test_06_book_full_promotes_hot_topics(tmp_path: Path) -> None:
    """More topics than the gateway numbers (max_topic_alias_out = 2): early topics take the
    numbers, a later hot topic is promoted, and paho still resolves every message."""
    b = InProcessBroker(tmp_path / "data", {"max_topic_alias_out": 2}).start()
    try:
        sub = Client(b.port, "ps", V5).connect(props=props(CONNECT, TopicAliasMaximum=10))
        sub.subscribe("bk/#", 0)
        s = raw_v5(b.port, "rawbk", "bk/#", alias_max=10)
        pub = Client(b.port, "pub", V5).connect()
        topics = ["bk/cold1", "bk/cold2"] + ["bk/hot"] * 4200 + ["bk/cold1", "bk/hot", "bk/hot"]
        for i, t in enumerate(topics):
            pub.publish(t, str(i).encode(), 0)
        got = sub.expect(len(topics), timeout=60)
        resolved = paho_resolve(got, {})
        assert sorted(zip((int(m.payload) for m in got), resolved, strict=True)) == list(
            enumerate(topics)
        )
        wire: list[bytes] = []
        buf = b""
        while len(wire) < len(topics):  # whole packets, in whatever chunks they come
            chunk = s.recv(65536)
            assert chunk, f"closed after {len(wire)} packets"
            pkts, buf = split_packets(buf + chunk)
            wire += pkts
        assert len(wire) == len(topics) and not buf
        dec = [decode_publish(p) for p in wire]
        check_aliases(dec, [topics[int(g["payload"])] for g in dec], 2)
        hot = [g for g in dec if topics[int(g["payload"])] == "bk/hot"]
        assert hot[0]["alias"] is None  # the book was full when bk/hot first came
        assert hot[-1]["alias"] is not None and hot[-1]["topic"] == ""  # promoted since
        s.close()
    finally:
        b.stop()


def test_07_retained_and_shared_paths(broker):  # noqa: F811
    """Retained messages sent on SUBSCRIBE and `$share` deliveries take aliases too."""
    pub = Client(broker.port, "pub", V5).connect()
    pub.publish("rt/a", b"r1", 1, retain=True)
    pub.publish("rt/b", b"r2", 1, retain=True)
    s = raw_v5(broker.port, "ret", "", alias_max=5)
    s.sendall(v5_subscribe("rt/#", 0))
    suback, *retained = read_packets(s, 3)
    assert suback[0] == 0x90
    got = sorted((decode_publish(p) for p in retained), key=lambda g: g["payload"])
    assert [(g["topic"], g["payload"]) for g in got] == [("rt/a", b"r1"), ("rt/b", b"r2")]
    assert all(g["alias"] for g in got) and retained[0][0] & 1  # retain flag kept
    pub.publish("rt/a", b"live", 0)
    (live,) = [decode_publish(p) for p in read_packets(s, 1)]
    assert (live["topic"], live["alias"]) == ("", got[0]["alias"])
    s.close()
    sh = raw_v5(broker.port, "shr", "$share/g/sh/#", 1, alias_max=5)
    for i in range(3):
        pub.publish("sh/t", str(i).encode(), 1)
    gs = [decode_publish(p) for p in read_packets(sh, 3)]
    assert [g["payload"] for g in gs] == [b"0", b"1", b"2"]
    assert gs[0]["topic"] == "sh/t" and gs[0]["alias"]
    assert all(g["topic"] == "" and g["alias"] == gs[0]["alias"] for g in gs[1:])
    sh.close()
