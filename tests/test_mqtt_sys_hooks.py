"""`$SYS` counters move, and the embedder's publish ACL hook is applied."""

from __future__ import annotations

import time

from mqtt_helpers import (
    Client,
    raw,
    read_packets,
)
from mqtt_raw import (
    connect_packet,
    packet,
    s16,
)


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
