"""MQTT publish/subscribe end to end over real sockets (paho v3.1.1 and v5).

Area names: qos, wildcards, `$` rules, overlap, v5 options, shared, alias,
properties, expiry. Every test talks to a running gateway through the `broker` fixture.
"""

from __future__ import annotations

import socket
import time

import pytest
from mqtt_helpers import (
    CONNECT,
    PUBLISH,
    SUBSCRIBE,
    V5,
    V311,
    Client,
    props,
    read_packets,
    split_packets,
)


def _sub(broker, cid, filt, qos=0, version=V311, **kw):
    c = Client(broker.port, cid, version).connect()
    c.subscribe(filt, qos, **kw)
    return c


@pytest.mark.parametrize("version", [V311, V5])
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_01_qos_roundtrip(broker, version, qos):
    sub = _sub(broker, f"s-{version}-{qos}", "q/t", qos, version)
    pub = Client(broker.port, f"p-{version}-{qos}", version).connect()
    for i in range(20):
        pub.publish("q/t", f"m{i}", qos)
    got = sub.expect(20)
    assert [m.payload for m in got] == [f"m{i}".encode() for i in range(20)]
    assert {m.qos for m in got} == {qos}
    sub.expect_none(0.3)
    sub.disconnect()
    pub.disconnect()


@pytest.mark.parametrize("pub_qos,sub_qos", [(2, 1), (1, 0), (2, 0), (0, 2), (1, 2)])
def test_02_delivered_qos_is_min(broker, pub_qos, sub_qos):
    sub = _sub(broker, "s", "min/t", sub_qos)
    pub = Client(broker.port, "p").connect()
    pub.publish("min/t", b"x", pub_qos)
    (m,) = sub.expect(1)
    assert m.qos == min(pub_qos, sub_qos)


def test_03_wildcards(broker):
    plus = _sub(broker, "plus", "w/+/t")
    hash_ = _sub(broker, "hash", "w/#")
    pub = Client(broker.port, "p").connect()
    for topic in ("w/a/t", "w/b/t", "w/a/x", "w", "w/a/t/deeper", "other/a/t"):
        pub.publish(topic, topic, 1)
    assert sorted(m.topic for m in plus.expect(2)) == ["w/a/t", "w/b/t"]
    plus.expect_none(0.3)
    assert sorted(m.topic for m in hash_.expect(5)) == sorted(
        ["w/a/t", "w/b/t", "w/a/x", "w", "w/a/t/deeper"]
    )
    hash_.expect_none(0.3)


def test_04_dollar_topics_not_matched_by_leading_wildcard(broker):
    allsub = _sub(broker, "all", "#")
    plus = _sub(broker, "plus", "+/info")
    sys_ = _sub(broker, "sys", "$SYS/broker/version")
    (m,) = sys_.expect(1)
    assert m.topic == "$SYS/broker/version" and m.payload.startswith(b"lightgate")
    allsub.expect_none(0.5)
    plus.expect_none(0.1)
    pub = Client(broker.port, "p").connect()
    pub.publish("$foo/info", b"never stored", 1)  # `$` topics are not device data
    pub.publish("dev/info", b"ok", 1)
    assert [m.topic for m in plus.expect(1)] == ["dev/info"]
    assert [m.topic for m in allsub.expect(1)] == ["dev/info"]
    allsub.expect_none(0.3)


def test_05_overlap_v3_one_copy_at_max_qos(broker):
    c = Client(broker.port, "ov3").connect()
    c.subscribe("ov/#", 0)
    c.subscribe("ov/+/x", 2)
    c.subscribe("ov/a/x", 1)
    pub = Client(broker.port, "p").connect()
    pub.publish("ov/a/x", b"1", 2)
    pub.publish("ov/b", b"2", 2)
    got = c.expect(2)
    by_topic = {m.topic: m for m in got}
    assert by_topic["ov/a/x"].qos == 2
    assert by_topic["ov/b"].qos == 0
    c.expect_none(0.5)


def test_06_overlap_v5_subscription_identifiers(broker):
    c = Client(broker.port, "ov5", V5).connect()
    c.subscribe("si/#", 1, props=props(SUBSCRIBE, SubscriptionIdentifier=7))
    c.subscribe("si/+", 0, props=props(SUBSCRIBE, SubscriptionIdentifier=9))
    pub = Client(broker.port, "p", V5).connect()
    pub.publish("si/a", b"x", 1)
    pub.publish("si/a/b", b"y", 1)
    got = {m.topic: m for m in c.expect(2)}
    assert sorted(got["si/a"].sub_ids) == [7, 9] and got["si/a"].qos == 1
    assert got["si/a/b"].sub_ids == [7]
    c.expect_none(0.5)


def test_07_no_local(broker):
    c = Client(broker.port, "nl", V5).connect()
    c.subscribe("nl/t", 1, noLocal=True)
    other = Client(broker.port, "nl-other", V5).connect()
    c.publish("nl/t", b"mine", 1)
    other.publish("nl/t", b"theirs", 1)
    assert [m.payload for m in c.expect(1)] == [b"theirs"]
    c.expect_none(0.3)


def test_08_retain_as_published_and_retain_handling(broker):
    pub = Client(broker.port, "p", V5).connect()
    pub.publish("rap/t", b"kept", 1, retain=True)
    rap = Client(broker.port, "rap", V5).connect()
    rap.subscribe("rap/t", 1, retainAsPublished=True)
    plain = Client(broker.port, "plain", V5).connect()
    plain.subscribe("rap/t", 1)
    never = Client(broker.port, "never", V5).connect()
    never.subscribe("rap/t", 1, retainHandling=2)
    onlynew = Client(broker.port, "onlynew", V5).connect()
    onlynew.subscribe("rap/t", 1, retainHandling=1)
    for c in (rap, plain, onlynew):
        (m,) = c.expect(1)
        assert m.retain and m.payload == b"kept"  # retained on subscribe: RETAIN=1
    never.expect_none(0.3)
    onlynew.subscribe("rap/t", 1, retainHandling=1)  # exists already: no retained again
    onlynew.expect_none(0.3)
    pub.publish("rap/t", b"live", 1, retain=True)
    assert rap.expect(1)[0].retain is True
    assert plain.expect(1)[0].retain is False
    assert never.expect(1)[0].retain is False


def test_09_shared_subscription_one_member_each(broker):
    members = [_sub(broker, f"m{i}", "$share/g/sh/#", 1, V5) for i in range(3)]
    normal = _sub(broker, "normal", "sh/#", 1)
    pub = Client(broker.port, "p").connect()
    for i in range(30):
        pub.publish(f"sh/{i % 3}", str(i), 1)
    assert len(normal.expect(30)) == 30
    total = []
    deadline = time.monotonic() + 10
    while len(total) < 30 and time.monotonic() < deadline:
        for m in members:
            while not m.messages.empty():
                total.append(m.messages.get().payload)
        time.sleep(0.05)
    assert sorted(total, key=int) == [str(i).encode() for i in range(30)]
    for m in members:
        m.expect_none(0.1)


def test_10_topic_alias_inbound(broker):
    sub = _sub(broker, "s", "al/#", 0, V5)
    pub = Client(broker.port, "p", V5).connect()
    pub.publish("al/long/topic", b"1", 1, props=props(PUBLISH, TopicAlias=3))
    pub.publish("", b"2", 1, props=props(PUBLISH, TopicAlias=3))
    got = sub.expect(2)
    assert [(m.topic, m.payload) for m in got] == [("al/long/topic", b"1"), ("al/long/topic", b"2")]


def test_11_v5_properties_carried(broker):
    sub = _sub(broker, "s", "pr/t", 1, V5)
    v3 = _sub(broker, "s3", "pr/t", 1, V311)
    pub = Client(broker.port, "p", V5).connect()
    p = props(
        PUBLISH,
        PayloadFormatIndicator=1,
        ContentType="application/json",
        ResponseTopic="pr/reply",
        CorrelationData=b"\x01\x02",
        UserProperty=[("site", "a"), ("line", "7")],
        MessageExpiryInterval=3600,
    )
    pub.publish("pr/t", b'{"t": 21}', 1, props=p)
    (m,) = sub.expect(1)
    mp = m.props
    assert mp.PayloadFormatIndicator == 1
    assert mp.ContentType == "application/json"
    assert mp.ResponseTopic == "pr/reply"
    assert mp.CorrelationData == b"\x01\x02"
    assert m.user_props == {"site": "a", "line": "7"}
    assert 3590 <= mp.MessageExpiryInterval <= 3600
    assert v3.expect(1)[0].payload == b'{"t": 21}'


def test_12_message_expiry_offline(broker):
    sub = Client(broker.port, "exp", V5).connect(
        clean=True, props=props(CONNECT, SessionExpiryInterval=300)
    )
    sub.subscribe("ex/t", 1)
    sub.disconnect()
    pub = Client(broker.port, "p", V5).connect()
    pub.publish("ex/t", b"short", 1, props=props(PUBLISH, MessageExpiryInterval=1))
    pub.publish("ex/t", b"long", 1, props=props(PUBLISH, MessageExpiryInterval=600))
    time.sleep(2.2)
    sub = Client(broker.port, "exp", V5).connect(
        clean=False, props=props(CONNECT, SessionExpiryInterval=300)
    )
    got = sub.expect(1)
    assert [m.payload for m in got] == [b"long"]
    assert got[0].props.MessageExpiryInterval <= 598
    sub.expect_none(0.3)


def test_13_unsubscribe(broker):
    c = _sub(broker, "u", "un/t", 1)
    pub = Client(broker.port, "p").connect()
    pub.publish("un/t", b"1", 1)
    c.expect(1)
    c.unsubscribe("un/t")
    pub.publish("un/t", b"2", 1)
    c.expect_none(0.5)


def test_14_acl_hook_suback_code(embedded):
    broker = embedded
    broker.server.authorize_subscribe = lambda cid, f: not f.startswith("secret")
    broker.server.authorize_publish = lambda cid, t: not t.startswith("secret")
    v3 = Client(broker.port, "acl3").connect()
    assert [getattr(c, "value", c) for c in v3.subscribe("secret/#", 1)] == [0x80]
    v5 = Client(broker.port, "acl5", V5).connect()
    assert [c.value for c in v5.subscribe("secret/#", 1)] == [0x87]
    assert [c.value for c in v5.subscribe("open/#", 1)] == [1]


def _v5_connect(cid: bytes, receive_max: int | None = None, max_packet: int | None = None) -> bytes:
    props = b""
    if receive_max is not None:
        props += b"\x21" + receive_max.to_bytes(2, "big")
    if max_packet is not None:
        props += b"\x27" + max_packet.to_bytes(4, "big")
    body = b"\x00\x04MQTT\x05\x02\x00\x3c" + bytes([len(props)]) + props
    body += len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def _v5_subscribe(filt: bytes, qos: int, pid: int = 1) -> bytes:
    body = pid.to_bytes(2, "big") + b"\x00" + len(filt).to_bytes(2, "big") + filt + bytes([qos])
    return bytes([0x82, len(body)]) + body


def _raw_v5(broker, cid: bytes, **kw) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", broker.port))
    s.sendall(_v5_connect(cid, **kw))
    (connack,) = read_packets(s, 1)
    assert connack[0] == 0x20 and connack[3] == 0
    return s


def test_15_outbound_receive_maximum(broker):
    s = _raw_v5(broker, b"rm2", receive_max=2)
    s.sendall(_v5_subscribe(b"rm/t", 1))
    assert read_packets(s, 1)[0][0] == 0x90
    pub = Client(broker.port, "p").connect()
    for i in range(5):
        pub.publish("rm/t", f"{i}", 1)
    first = read_packets(s, 2)
    assert [p[0] & 0xF6 for p in first] == [0x32, 0x32]
    s.settimeout(0.5)
    with pytest.raises(TimeoutError):
        s.recv(100)  # window of 2 is full: nothing more until an ack
    pid = first[0][2 + 2 + 4 : 2 + 2 + 4 + 2]
    s.sendall(b"\x40\x02" + pid)  # PUBACK the first
    (third,) = read_packets(s, 1)
    assert third.endswith(b"2")


def test_15b_puback_pumps_only_a_reader_with_more_to_send(tmp_path):
    """A caught-up QoS 1 reader's PUBACK pumps nothing (each cost a pump that found nothing);
    the PUBACK of a reader held back by its window still sends the rest. In-process, to count
    the pumps of the real delivery."""
    from mqtt_broker import InProcessBroker

    b = InProcessBroker(tmp_path / "data").start()
    try:
        d = b.server.delivery
        pumps: list[str] = []
        pump = d._pump

        def counted(qs):
            pumps.append(qs.name)
            pump(qs)

        b.call(setattr, d, "_pump", counted)
        s = _raw_v5(b, b"ack1", receive_max=2)
        s.sendall(_v5_subscribe(b"pa/t", 1))
        assert read_packets(s, 1)[0][0] == 0x90
        pub = Client(b.port, "p").connect()
        pid_at = 2 + 2 + 4  # fixed header, topic length, "pa/t"
        pub.publish("pa/t", b"0", 1)
        (m,) = read_packets(s, 1)
        time.sleep(0.2)
        before = b.call(len, pumps)
        s.sendall(b"\x40\x02" + m[pid_at : pid_at + 2])
        time.sleep(0.3)
        assert b.call(len, pumps) == before  # caught up: no pump for the ack
        for i in range(1, 4):
            pub.publish("pa/t", str(i).encode(), 1)
        first = read_packets(s, 2)
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(100)  # window of 2 full
        before = b.call(len, pumps)
        s.sendall(b"\x40\x02" + first[0][pid_at : pid_at + 2])
        (third,) = read_packets(s, 1)
        assert third.endswith(b"3") and b.call(len, pumps) > before
        s.close()
    finally:
        b.stop()


def test_15c_shared_member_ack_pumps_the_groups_redeliveries(broker):
    """A `$share` member whose own position is past the queue's end (it joined once the group
    had handed everything out) still gets what other members left unacknowledged when its
    PUBACK frees its window: acks credit the group, so they always pump it."""
    pid_at = 2 + 2 + len("sr/t")

    def member(cid: bytes) -> socket.socket:
        m = _raw_v5(broker, cid, receive_max=1)
        m.sendall(_v5_subscribe(b"$share/g/sr/t", 1))
        assert read_packets(m, 1)[0][0] == 0x90
        return m

    a, b = member(b"sra"), member(b"srb")
    pub = Client(broker.port, "p").connect()
    pub.publish("sr/t", b"0", 1)
    pub.publish("sr/t", b"1", 1)
    got = [p[-1:] for p in read_packets(a, 1) + read_packets(b, 1)]
    assert sorted(got) == [b"0", b"1"]  # one each, both unacknowledged: all handed out
    c = member(b"src")
    a.close()  # its message goes back to the group: to C
    (c1,) = read_packets(c, 1)
    assert c1[-1:] == got[0]
    b.close()  # its message goes back too; C's window (1) is full
    c.settimeout(0.5)
    with pytest.raises(TimeoutError):
        c.recv(100)
    c.sendall(b"\x40\x02" + c1[pid_at : pid_at + 2])
    (c2,) = read_packets(c, 1)  # on C's ack alone
    assert c2[-1:] == got[1]
    c.close()


def test_16_client_maximum_packet_size(broker):
    s = _raw_v5(broker, b"mps", max_packet=64)
    s.sendall(_v5_subscribe(b"mp/t", 0))
    assert read_packets(s, 1)[0][0] == 0x90
    pub = Client(broker.port, "p").connect()
    pub.publish("mp/t", b"x" * 200, 1)  # too large for this client: skipped
    pub.publish("mp/t", b"small", 1)
    (p,) = read_packets(s, 1)
    assert p.endswith(b"small")


def test_17_inbound_receive_maximum_exceeded(broker):
    s = _raw_v5(broker, b"flood")
    body = b"\x00\x04rx/a"
    pkts = b"".join(
        bytes([0x32, len(body) + 3]) + body + i.to_bytes(2, "big") + b"\x00" for i in range(1, 70)
    )
    s.sendall(pkts)  # 69 unacknowledged QoS 1 > our Receive Maximum of 64
    s.settimeout(5)
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    pkts_in, _ = split_packets(data)
    assert pkts_in[-1][0] == 0xE0 and pkts_in[-1][2] == 0x93  # DISCONNECT receive max exceeded


def test_18_backpressure_slow_reader_does_not_stall_others(broker):
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", broker.port))
    slow.sendall(_v5_connect(b"slow"))
    read_packets(slow, 1)
    slow.sendall(_v5_subscribe(b"bp/t", 0))
    read_packets(slow, 1)
    fast = _sub(broker, "fast", "bp/t", 0)
    pub = Client(broker.port, "p").connect()
    n = 600
    payload = b"y" * 8000
    for i in range(n):
        pub.publish("bp/t", i.to_bytes(4, "big") + payload, 0 if i < n - 1 else 1)
    got = fast.expect(n, timeout=30)  # the fast one is not held back by the slow one
    assert [int.from_bytes(m.payload[:4], "big") for m in got] == list(range(n))
    assert broker.stats()["write_pauses"] > 0  # the slow socket did push back
    # The slow reader was skipped while unwritable and resumed: everything arrives, in order.
    msgs = read_packets(slow, n, timeout=30)
    seqs = [int.from_bytes(p[-8004:-8000], "big") for p in msgs]
    assert seqs == list(range(n))


def test_19_shared_member_leaving_hands_over_unacked(broker):
    a = _raw_v5(broker, b"member-a")
    a.sendall(_v5_subscribe(b"$share/g/ho/t", 1))
    assert read_packets(a, 1)[0][0] == 0x90
    b = _sub(broker, "member-b", "$share/g/ho/t", 1, V5)
    pub = Client(broker.port, "p").connect()
    pub.publish("ho/t", b"one", 1)
    pub.publish("ho/t", b"two", 1)
    got_a = read_packets(a, 1)  # round robin: one of them went to A, which never acks
    a.close()
    got_b = b.expect(2, timeout=10)
    assert sorted(m.payload for m in got_b) == [b"one", b"two"]
    assert got_a[0].endswith((b"one", b"two"))


def test_20_many_readers_leave_in_any_order(tmp_path):
    """300 subscribers of one topic; every other one disconnects, in shuffled order: the queue's
    readers are exactly those left (membership is a dict now, O(1) per leave: a list.remove per
    disconnect scanned them all), each gets the next message, and one that comes back gets the
    one after."""
    import random

    from mqtt_broker import InProcessBroker

    b = InProcessBroker(tmp_path / "data").start()
    try:
        subs = []
        for i in range(300):
            s = _raw_v5(b, f"many-{i}".encode())
            s.sendall(_v5_subscribe(b"many/t", 0))
            assert read_packets(s, 1)[0][0] == 0x90
            subs.append(s)
        d = b.server.delivery
        assert b.call(lambda: len(d.queues["many/t"].subs)) == 300
        leaving = subs[1::2]
        random.Random(7).shuffle(leaving)
        for s in leaving:
            s.close()
        deadline = time.monotonic() + 10
        while b.call(lambda: len(d.queues["many/t"].subs)) != 150:
            assert time.monotonic() < deadline, "readers not detached"
            time.sleep(0.05)
        left = {id(x.session) for x in b.call(lambda: list(d.queues["many/t"].subs))}
        assert len(left) == 150
        pub = Client(b.port, "many-pub").connect()
        pub.publish("many/t", b"one", 0)
        for s in subs[0::2]:
            (m,) = read_packets(s, 1)
            assert m[0] & 0xF0 == 0x30 and m.endswith(b"one")
        back = _raw_v5(b, b"many-1")
        back.sendall(_v5_subscribe(b"many/t", 0))
        assert read_packets(back, 1)[0][0] == 0x90
        pub.publish("many/t", b"two", 0)
        (m,) = read_packets(back, 1)
        assert m.endswith(b"two")
        for s in subs[0::2]:
            assert read_packets(s, 1)[0].endswith(b"two")
        assert b.call(lambda: len(d.queues["many/t"].subs)) == 151
        for s in [*subs[0::2], back]:
            s.close()
        pub.disconnect()
    finally:
        b.stop()


def test_publish_gather_ms_puts_several_connections_publishes_in_one_round(tmp_path):
    """`publish_gather_ms`: a PUBLISH waits that long for others, from any connection, and all
    of them go through one round (one append, one dispatch round, one delivery pass). By
    default (0) each loop pass's PUBLISHes go at the end of that pass: two sent 30 ms apart
    from two connections were two rounds."""
    from mqtt_broker import InProcessBroker
    from mqtt_helpers import raw, read_packets
    from mqtt_raw import connect_packet, packet, s16, subscribe_packet

    b = InProcessBroker(tmp_path / "data", {"publish_gather_ms": 100}).start()
    try:
        rounds: list[list[str]] = []
        backend = b.server.backend
        publish = backend.publish

        def counted(msgs, *rest):
            rounds.append([m.topic for m in msgs])
            return publish(msgs, *rest)

        b.call(setattr, backend, "publish", counted)
        sub = raw(b.port)
        sub.sendall(connect_packet(b"gather-sub"))
        read_packets(sub, 1)
        sub.sendall(subscribe_packet(b"ga/#", 0))
        read_packets(sub, 1)
        pubs = []
        for cid in (b"gather-1", b"gather-2"):
            s = raw(b.port)
            s.sendall(connect_packet(cid))
            read_packets(s, 1)
            pubs.append(s)
        pubs[0].sendall(packet(0x30, s16(b"ga/1") + b"x"))
        time.sleep(0.03)
        pubs[1].sendall(packet(0x30, s16(b"ga/2") + b"y"))
        got = read_packets(sub, 2)
        assert [p[4:8] for p in got] == [b"ga/1", b"ga/2"]
        assert rounds == [["ga/1", "ga/2"]]
        for s in [sub, *pubs]:
            s.close()
    finally:
        b.stop()
