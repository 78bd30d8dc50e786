# ruff: noqa: F811  (the `broker` fixture is imported, then named as a test argument)
"""More issue 4 bullets over real sockets against a running gateway: nothing acknowledged is
lost when the gateway is SIGKILLed, `$SYS` counters move, wills on keep-alive timeout and at
session end, shared-subscription hand-over of an unfinished QoS 2 message, invalid topic aliases
and the announced Maximum Packet Size, and the publish ACL hook."""

from __future__ import annotations

import socket
import time

import pytest
from mqtt_broker import broker, embedded  # noqa: F401 - the fixtures
from mqtt_helpers import (
    CONNECT,
    V5,
    WILLMESSAGE,
    Client,
    props,
    raw,
    read_packets,
    read_varint,
    split_packets,
)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def s16(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def connect_packet(
    cid: bytes,
    level: int = 4,
    clean: bool = True,
    keepalive: int = 60,
    will: tuple[bytes, bytes, int] | None = None,
) -> bytes:
    flags = 0x02 if clean else 0x00
    if will is not None:
        flags |= 0x04 | (will[2] << 3)
    body = s16(b"MQTT") + bytes([level, flags]) + keepalive.to_bytes(2, "big")
    body += b"\x00" if level == 5 else b""  # v5: empty CONNECT properties
    body += s16(cid)
    if will is not None:
        body += b"\x00" if level == 5 else b""  # v5: empty will properties
        body += s16(will[0]) + s16(will[1])
    return packet(0x10, body)


def read_until_closed(s: socket.socket, timeout: float = 5.0) -> list[bytes]:
    """Every packet the server sends until it closes the connection (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"connection not closed in {timeout}s; got {data!r}"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    pkts, rest = split_packets(data)
    assert not rest, data
    return pkts


def parse_connack_props(connack: bytes) -> dict[int, int]:
    """The integer properties of a v5 CONNACK (id -> value); strings/binaries skipped."""
    got = read_varint(connack, 1)  # the remaining length
    assert got is not None, connack
    got = read_varint(connack, got[1] + 2)  # after flags and reason code: properties length
    assert got is not None, connack
    n, i = got
    end = i + n
    out: dict[int, int] = {}
    sizes = {0x11: 4, 0x13: 2, 0x21: 2, 0x22: 2, 0x24: 1, 0x25: 1, 0x27: 4, 0x28: 1, 0x29: 1}
    sizes |= {0x2A: 1}
    while i < end:
        pid = connack[i]
        i += 1
        if pid in sizes:
            out[pid] = int.from_bytes(connack[i : i + sizes[pid]], "big")
            i += sizes[pid]
        elif pid == 0x26:  # user property: two strings
            for _ in range(2):
                i += 2 + int.from_bytes(connack[i : i + 2], "big")
        else:  # a string (assigned client id, reason string, ...)
            i += 2 + int.from_bytes(connack[i : i + 2], "big")
    return out


# -- 1. SIGKILL between an acknowledged publish and a persistent subscriber's reconnect -------


@pytest.mark.restart
def test_60_sigkill_loses_nothing_acknowledged(broker):
    """The gateway is SIGKILLed right after the last PUBACK/PUBCOMP: a v3.1.1 persistent session
    and a v5 session with expiry both get every acknowledged message after the restart, in order
    per topic, and a subscriber that had the messages in flight (no PUBACK) gets them again."""
    if not hasattr(broker, "crash_restart"):
        pytest.skip("SIGKILL needs `lightgate serve` in its own process")
    v3 = Client(broker.port, "kill-v3").connect(clean=False)
    v3.subscribe("kill/#", 1)
    v3.disconnect()
    cp = props(CONNECT, SessionExpiryInterval=600)
    v5 = Client(broker.port, "kill-v5", V5).connect(props=cp)
    v5.subscribe("kill/#", 2)
    v5.disconnect()
    # A subscriber that is online and gets the messages but never acknowledges them.
    busy = raw(broker.port)
    busy.sendall(connect_packet(b"kill-busy", clean=False))
    assert read_packets(busy, 1) == [b"\x20\x02\x00\x00"]
    busy.sendall(packet(0x82, b"\x00\x01" + s16(b"kill/#") + b"\x01"))
    assert read_packets(busy, 1) == [b"\x90\x03\x00\x01\x01"]
    # No pause here: a persistent session is written before its SUBACK (not only by the flush
    # every session_flush_ms), so the SIGKILL may come right after it.

    pub = Client(broker.port, "kill-pub").connect()
    n = 60
    for i in range(n):
        pub.publish(f"kill/{i % 3}", str(i), 2 if i % 10 == 9 else 1)  # each waits for its ack
    # The busy subscriber got some of them (not acked): they must come again after the crash.
    busy.settimeout(5)
    assert busy.recv(65536)[0] & 0xF0 == 0x30
    broker.crash_restart()  # SIGKILL right after the last acknowledgement
    busy.close()
    pub.paho.loop_stop()  # its gateway is gone; no reconnect attempts to the old port

    def check(got: list) -> None:
        assert sorted(int(m.payload) for m in got) == list(range(n))
        # In order per topic (per QoS: paho hands a QoS 2 message over at PUBREL, later).
        per_topic: dict[tuple[str, int], list[int]] = {}
        for m in got:
            per_topic.setdefault((m.topic, m.qos), []).append(int(m.payload))
        assert all(v == sorted(v) for v in per_topic.values()), per_topic

    v3 = Client(broker.port, "kill-v3").connect(clean=False)
    assert v3.session_present
    check(v3.expect(n, timeout=20))
    v5 = Client(broker.port, "kill-v5", V5).connect(clean=False, props=cp)
    assert v5.session_present
    got5 = v5.expect(n, timeout=20)
    check(got5)
    assert {int(m.payload) for m in got5 if m.qos == 2} == set(range(9, n, 10))
    again = Client(broker.port, "kill-busy").connect(clean=False)
    assert again.session_present
    check(again.expect(n, timeout=20))
    for c in (v3, v5, again):
        c.expect_none(0.3)
        c.disconnect()


# -- 2. $SYS counters ------------------------------------------------------------------------


def _sys_values(c: Client, timeout: float) -> dict[str, int]:
    """Drain one round of `$SYS/broker/messages|bytes/...` values (the latest of each topic)."""
    out: dict[str, int] = {}
    deadline = time.monotonic() + timeout
    while len(out) < 4:
        left = deadline - time.monotonic()
        assert left > 0, f"no complete $SYS round: {out}"
        (m,) = c.expect(1, timeout=left)
        out[m.topic.removeprefix("$SYS/broker/")] = int(m.payload)
    return out


def test_61_sys_counters_increase(broker):
    """`$SYS/broker/messages/{received,sent}` and `bytes/{received,sent}` grow by at least what
    this test moved through the gateway (sys_interval_s = 1 in the fixture)."""
    watch = Client(broker.port, "sysc-watch").connect()
    watch.subscribe("$SYS/broker/messages/+")
    watch.subscribe("$SYS/broker/bytes/+")
    before = _sys_values(watch, 5)  # the current values, sent on subscribe
    sub = Client(broker.port, "sysc-sub").connect()
    sub.subscribe("sysc/t", 1)
    pub = Client(broker.port, "sysc-pub").connect()
    n, size = 25, 200
    for i in range(n):
        pub.publish("sysc/t", b"%03d" % i + b"x" * (size - 3), 1)
    assert len(sub.expect(n)) == n
    deadline = time.monotonic() + 10
    after = before
    while (  # a periodic round that counts all of them (the next one may predate some)
        after["messages/sent"] - before["messages/sent"] < n
        or after["messages/received"] - before["messages/received"] < n
    ):
        left = deadline - time.monotonic()
        assert left > 0, (before, after)
        after = _sys_values(watch, left)
    assert after["bytes/received"] - before["bytes/received"] >= n * size
    assert after["bytes/sent"] - before["bytes/sent"] >= n * size
    for c in (watch, sub, pub):
        c.disconnect()


# -- 3. Wills: keep-alive timeout, and v5 session expiry shorter than the will delay ----------


@pytest.mark.parametrize("level", [4, 5])
def test_62_will_on_keepalive_timeout(broker, level):
    """A client that stops sending (keep alive 1 s) is closed after 1.5 s — v5 with DISCONNECT
    0x8D — and its will is published then, not before."""
    watcher = Client(broker.port, f"kaw-watch{level}").connect()
    watcher.subscribe("kaw/#", 1)
    s = raw(broker.port)
    s.sendall(connect_packet(b"kaw-dev%d" % level, level, keepalive=1, will=(b"kaw/dev", b"x", 1)))
    (connack,) = read_packets(s, 1)
    assert connack[0] == 0x20 and connack[3] == 0x00, connack  # accepted
    t0 = time.monotonic()
    watcher.expect_none(1.2)  # 1.5 × keep alive has not passed: no will yet
    (m,) = watcher.expect(1, timeout=3)
    elapsed = time.monotonic() - t0
    assert (m.topic, m.payload, m.qos) == ("kaw/dev", b"x", 1)
    assert 1.4 <= elapsed <= 3.5, elapsed
    pkts = read_until_closed(s, 2)
    if level == 5:
        assert pkts and pkts[-1][0] == 0xE0 and pkts[-1][2] == 0x8D, pkts  # keep alive timeout
    else:
        assert pkts == [], pkts
    s.close()
    watcher.disconnect()


def test_63_will_at_session_end_before_its_delay(broker):
    """v5: a will whose Will Delay (30 s) is longer than the Session Expiry (1 s) is published
    when the session ends, ~1 s after the abnormal close; the session is gone then."""
    watcher = Client(broker.port, "wse-watch").connect()
    watcher.subscribe("wse/#", 1)
    dev = Client(broker.port, "wse-dev", V5).connect(
        props=props(CONNECT, SessionExpiryInterval=1),
        will=("wse/dev", b"ended", 1, False),
        will_props=props(WILLMESSAGE, WillDelayInterval=30),
    )
    dev.kill()
    t0 = time.monotonic()
    watcher.expect_none(0.7)
    (m,) = watcher.expect(1, timeout=4)
    assert (m.topic, m.payload) == ("wse/dev", b"ended")
    assert 0.8 <= time.monotonic() - t0 <= 4.5
    again = Client(broker.port, "wse-dev", V5).connect(
        clean=False, props=props(CONNECT, SessionExpiryInterval=1)
    )
    assert not again.session_present
    again.disconnect()
    watcher.expect_none(0.3)  # published once
    watcher.disconnect()


# -- 4. Shared subscription hand-over of an unfinished QoS 2 message --------------------------


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


# -- 5. Topic alias errors and the announced Maximum Packet Size ------------------------------


def _v5_publish(topic: bytes, payload: bytes, alias: int | None) -> bytes:
    prop = b"" if alias is None else b"\x23" + alias.to_bytes(2, "big")
    return packet(0x30, s16(topic) + varint(len(prop)) + prop + payload)


def test_65_invalid_topic_alias_disconnects_0x94(broker):
    """v5 PUBLISH with Topic Alias 0, or one above the Topic Alias Maximum of our CONNACK:
    DISCONNECT 0x94 and close; nothing stored from it; others unaffected. The maximum itself
    is usable."""
    sub = Client(broker.port, "ta-sub").connect()
    sub.subscribe("ta/#", 0)
    s = raw(broker.port)
    s.sendall(connect_packet(b"ta-probe", 5))
    (connack,) = read_packets(s, 1)
    alias_max = parse_connack_props(connack)[0x22]
    assert alias_max >= 1
    s.sendall(_v5_publish(b"ta/max", b"ok", alias_max) + _v5_publish(b"", b"again", alias_max))
    assert [m.payload for m in sub.expect(2)] == [b"ok", b"again"]
    s.close()
    for alias in (0, alias_max + 1):
        s = raw(broker.port)
        s.sendall(connect_packet(b"ta-bad", 5))
        assert read_packets(s, 1)[0][0] == 0x20
        s.sendall(_v5_publish(b"ta/bad", b"bad", alias))
        pkts = read_until_closed(s)
        assert pkts and pkts[-1][0] == 0xE0 and pkts[-1][2] == 0x94, (alias, pkts)
        s.close()
    sub.expect_none(0.3)
    Client(broker.port, "ta-pub").connect().publish("ta/after", b"fine", 1)
    assert sub.expect(1)[0].payload == b"fine"
    sub.disconnect()


def test_66_connack_maximum_packet_size_is_the_configured_one(gateway_factory, tmp_path):
    """`max_packet_size` (--set) is what a v5 CONNACK announces, and is enforced at that size:
    a PUBLISH of exactly the maximum is accepted, one byte more is DISCONNECT 0x95."""
    limit = 3000
    gw = gateway_factory(tmp_path / "mps", "--set", f"max_packet_size={limit}")
    port = gw.port("mqtt")
    c = Client(port, "mps-paho", V5).connect()
    assert c.connack_props.MaximumPacketSize == limit
    c.disconnect()
    sub = Client(port, "mps-sub").connect()
    sub.subscribe("mps/#", 1)

    def publish_of_size(size: int) -> tuple[bytes, int]:
        """A QoS 0 PUBLISH of exactly `size` bytes on the wire, and its payload length."""
        head = s16(b"mps/t") + b"\x00"  # topic, empty properties
        n = size - 1 - len(head)
        n -= len(varint(len(head) + n))
        pkt = packet(0x30, head + b"p" * n)
        assert len(pkt) == size
        return pkt, n

    s = raw(port)
    s.sendall(connect_packet(b"mps-raw", 5))
    (connack,) = read_packets(s, 1)
    assert parse_connack_props(connack)[0x27] == limit
    pkt, n = publish_of_size(limit)
    s.sendall(pkt)
    (m,) = sub.expect(1)
    assert m.payload == b"p" * n
    s.sendall(publish_of_size(limit + 1)[0])
    pkts = read_until_closed(s)
    assert pkts and pkts[-1][0] == 0xE0 and pkts[-1][2] == 0x95, pkts
    s.close()
    sub.expect_none(0.3)
    sub.disconnect()


# -- 6. The publish ACL hook --------------------------------------------------------------------


def test_67_publish_acl_hook(embedded):
    """`authorize_publish` refuses a topic: nothing is delivered or stored; v5 QoS 1 gets PUBACK
    0x87 and QoS 2 PUBREC 0x87; v3.1.1 gets a plain ack (it has no refusal code); the hook sees
    the client id and topic; allowed topics flow as usual."""
    broker = embedded
    calls: list[tuple[str, str]] = []

    def hook(cid: str, topic: str) -> bool:
        calls.append((cid, topic))
        return not topic.startswith("secret/")

    broker.server.authorize_publish = hook
    sub = Client(broker.port, "pacl-sub").connect()
    sub.subscribe("secret/#", 2)
    sub.subscribe("open/#", 2)

    s = raw(broker.port)
    s.sendall(connect_packet(b"pacl5", 5))
    assert read_packets(s, 1)[0][0] == 0x20
    for qos, pid in ((1, 7), (2, 8)):
        s.sendall(packet(0x30 | qos << 1, s16(b"secret/a") + pid.to_bytes(2, "big") + b"\x00x"))
        (ack,) = read_packets(s, 1)
        assert ack[0] == (0x40 if qos == 1 else 0x50) and ack[2:4] == pid.to_bytes(2, "big")
        assert len(ack) > 4 and ack[4] == 0x87, ack  # not authorized (not a plain success)
    s.sendall(packet(0x30, s16(b"secret/a") + b"\x00q0"))  # QoS 0: dropped silently
    s.sendall(packet(0x32, s16(b"open/a") + b"\x00\x09\x00ok"))
    assert read_packets(s, 1)[0] in (b"\x40\x02\x00\x09", b"\x40\x03\x00\x09\x00")
    s.close()

    v3 = Client(broker.port, "pacl3").connect()
    for qos in (0, 1, 2):
        v3.publish("secret/b", f"v3-{qos}", qos)  # acked (3.1.1 cannot refuse), not delivered
    v3.publish("open/b", b"ok3", 1)
    got = sub.expect(2)
    assert sorted((m.topic, m.payload) for m in got) == [("open/a", b"ok"), ("open/b", b"ok3")]
    sub.expect_none(0.5)
    assert ("pacl5", "secret/a") in calls and ("pacl3", "secret/b") in calls
    assert broker.records("secret") == []
    assert len(broker.records("open")) == 2
    v3.disconnect()
    sub.disconnect()


def test_68_sigkill_right_after_suback_keeps_the_subscription(broker):
    """A persistent session's SUBSCRIBE is stored before its SUBACK: a SIGKILL right after the
    SUBACK (well inside the periodic session flush) loses neither the session nor the
    subscription, and a message published after the restart reaches it."""
    if not hasattr(broker, "crash_restart"):
        pytest.skip("SIGKILL needs `lightgate serve` in its own process")
    s = raw(broker.port)
    s.sendall(connect_packet(b"suback-kill", clean=False))
    assert read_packets(s, 1) == [b"\x20\x02\x00\x00"]
    s.sendall(packet(0x82, b"\x00\x01" + s16(b"sk/#") + b"\x01"))
    assert read_packets(s, 1) == [b"\x90\x03\x00\x01\x01"]
    broker.crash_restart()
    s.close()
    pub = Client(broker.port, "sk-pub").connect()
    pub.publish("sk/1", "after", 1)
    pub.disconnect()
    c = Client(broker.port, "suback-kill").connect(clean=False)
    assert c.session_present
    assert [m.payload for m in c.expect(1)] == [b"after"]
    c.disconnect()
