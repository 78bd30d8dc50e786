"""Nothing acknowledged is lost when the gateway is SIGKILLed: an acknowledged publish reaches a
persistent subscriber after the crash, and a SUBACKed subscription survives one."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from mqtt_helpers import (
    CONNECT,
    V5,
    WILLMESSAGE,
    Client,
    props,
    raw,
    read_packets,
)
from mqtt_raw import (
    assert_silent,
    connect_packet,
    packet,
    s16,
    subscribe_packet,
)


def _needs_sigkill(broker: Any) -> None:
    if not hasattr(broker, "crash_restart"):
        pytest.skip("SIGKILL needs `lightgate serve` in its own process")


def _raw_connect(port: int, client_id: bytes, present: bool = False) -> socket.socket:
    """A 3.1.1 persistent session over a raw socket, its CONNACK checked."""
    s = raw(port)
    s.sendall(connect_packet(client_id, clean=False))
    assert read_packets(s, 1) == [b"\x20\x02" + bytes([present]) + b"\x00"]
    return s


def _subscribe(s: socket.socket, filt: bytes, qos: int) -> None:
    s.sendall(subscribe_packet(filt, qos))
    assert read_packets(s, 1) == [b"\x90\x03\x00\x01" + bytes([qos])]


@pytest.mark.restart
def test_60_sigkill_loses_nothing_acknowledged(broker):
    """The gateway is SIGKILLed right after the last PUBACK/PUBCOMP: a v3.1.1 persistent session
    and a v5 session with expiry both get every acknowledged message after the restart, in order
    per topic, and a subscriber that had the messages in flight (no PUBACK) gets them again."""
    _needs_sigkill(broker)
    v3 = Client(broker.port, "kill-v3").connect(clean=False)
    v3.subscribe("kill/#", 1)
    v3.disconnect()
    cp = props(CONNECT, SessionExpiryInterval=600)
    v5 = Client(broker.port, "kill-v5", V5).connect(props=cp)
    v5.subscribe("kill/#", 2)
    v5.disconnect()
    # A subscriber that is online and gets the messages but never acknowledges them.
    busy = _raw_connect(broker.port, b"kill-busy")
    _subscribe(busy, b"kill/#", 1)
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


def test_68_sigkill_right_after_suback_keeps_the_subscription(broker):
    """A persistent session's SUBSCRIBE is stored before its SUBACK: a SIGKILL right after the
    SUBACK (well inside the periodic session flush) loses neither the session nor the
    subscription, and a message published after the restart reaches it."""
    _needs_sigkill(broker)
    s = _raw_connect(broker.port, b"suback-kill")
    _subscribe(s, b"sk/#", 1)
    broker.crash_restart()
    s.close()
    pub = Client(broker.port, "sk-pub").connect()
    pub.publish("sk/1", "after", 1)
    pub.disconnect()
    c = Client(broker.port, "suback-kill").connect(clean=False)
    assert c.session_present
    assert [m.payload for m in c.expect(1)] == [b"after"]
    c.disconnect()


@pytest.mark.restart
def test_69_sigkill_keeps_flushed_positions_of_a_session_that_became_persistent(broker):
    """Acknowledged deliveries move a persistent session's positions, which the periodic session
    flush writes: after a SIGKILL a second later the session resumes after them. The client id
    first had a clean session, so its session becomes persistent on the reconnect (the flush
    looks only at persistent sessions and must see it)."""
    _needs_sigkill(broker)
    Client(broker.port, "pos-kill").connect(clean=True).disconnect()
    sub = Client(broker.port, "pos-kill").connect(clean=False)
    sub.subscribe("pos/#", 1)
    pub = Client(broker.port, "pos-pub").connect()
    for i in range(20):
        pub.publish("pos/t", str(i), 1)
    assert [int(m.payload) for m in sub.expect(20)] == list(range(20))  # each PUBACKed by paho
    time.sleep(1.5)  # session_flush_ms is 100: several flushes, one snapshot
    broker.crash_restart()
    sub.paho.loop_stop()
    pub.paho.loop_stop()
    pub = Client(broker.port, "pos-pub").connect()
    for i in range(20, 25):
        pub.publish("pos/t", str(i), 1)
    sub = Client(broker.port, "pos-kill").connect(clean=False)
    assert sub.session_present
    assert [int(m.payload) for m in sub.expect(5)] == list(range(20, 25))
    sub.expect_none(0.5)
    sub.disconnect()


@pytest.mark.restart
def test_70_sigkill_after_an_offline_will_does_not_publish_it_again(broker):
    """A delayed will published while its session is offline changes that session (no will
    left), which the next session flush must write: the flush walks connected sessions and
    offline ones with changes, not every persistent session (10^5 offline ones cost it nothing).
    After a SIGKILL 1.5 s later the will is not published a second time."""
    _needs_sigkill(broker)
    watcher = Client(broker.port, "wd-watch", V5).connect(
        clean=False, props=props(CONNECT, SessionExpiryInterval=600)
    )
    watcher.subscribe("wd/#", 1)
    dev = Client(broker.port, "wd-dev", V5).connect(
        props=props(CONNECT, SessionExpiryInterval=600),
        will=("wd/dev", b"gone", 1, False),
        will_props=props(WILLMESSAGE, WillDelayInterval=1),
    )
    dev.kill()
    assert [m.payload for m in watcher.expect(1, timeout=10)] == [b"gone"]
    time.sleep(1.5)  # session_flush_ms is 100: the watcher's ack and the device's will written
    broker.crash_restart()
    watcher.paho.loop_stop()
    watcher = Client(broker.port, "wd-watch", V5).connect(
        clean=False, props=props(CONNECT, SessionExpiryInterval=600)
    )
    assert watcher.session_present
    watcher.expect_none(3.0)  # a will still stored would be due at once after the restart
    watcher.disconnect()


@pytest.mark.restart
def test_71_sigkill_right_after_pubrec_stores_a_qos2_resend_once(broker):
    """A PUBREC says the message is stored once: the persistent session's QoS 2 ids are written
    before it goes out. SIGKILL right after the PUBREC (well inside the periodic session flush);
    the client, as one that never saw the PUBREC would, resends the PUBLISH with DUP after the
    restart: it is acknowledged, not stored again, and the subscriber gets one copy."""
    _needs_sigkill(broker)
    sub = Client(broker.port, "q2k-sub").connect(clean=False)
    sub.subscribe("q2k/#", 2)
    sub.disconnect()  # offline: what it gets after the restart is every copy stored
    publish = packet(0x34, s16(b"q2k/t") + b"\x00\x07" + b"once")  # QoS 2, packet id 7
    s = _raw_connect(broker.port, b"q2k-pub")
    s.sendall(publish)
    assert read_packets(s, 1) == [b"\x50\x02\x00\x07"]  # PUBREC
    broker.crash_restart()
    s.close()
    s = _raw_connect(broker.port, b"q2k-pub", present=True)
    s.sendall(packet(0x3C, s16(b"q2k/t") + b"\x00\x07" + b"once"))  # the same, DUP set
    assert read_packets(s, 1) == [b"\x50\x02\x00\x07"]
    s.sendall(b"\x62\x02\x00\x07")  # PUBREL
    assert read_packets(s, 1) == [b"\x70\x02\x00\x07"]  # PUBCOMP
    s.close()
    sub = Client(broker.port, "q2k-sub").connect(clean=False)
    assert sub.session_present
    assert [m.payload for m in sub.expect(1, timeout=10)] == [b"once"]
    sub.expect_none(1.0)
    sub.disconnect()


@pytest.mark.restart
def test_72_sigkill_right_after_pubrel_resends_the_pubrel_not_the_publish(broker):
    """Once the gateway sent a PUBREL for an outbound QoS 2 message it never sends that PUBLISH
    again (3.1.1 §4.3.3): the session records the release before the PUBREL goes out. SIGKILL
    right after the PUBREL; on the subscriber's return the gateway resends the PUBREL, and a
    PUBCOMP completes the message."""
    _needs_sigkill(broker)
    s = _raw_connect(broker.port, b"q2o-sub")
    _subscribe(s, b"q2o/#", 2)
    pubc = Client(broker.port, "q2o-pub").connect()
    pubc.publish("q2o/t", b"once", 2)
    (pub,) = read_packets(s, 1)
    assert pub[0] & 0xF6 == 0x34  # PUBLISH, QoS 2
    pid = pub[9:11]  # after the fixed header (2), the topic (2 + 5)
    s.sendall(b"\x50\x02" + pid)  # PUBREC
    assert read_packets(s, 1) == [b"\x62\x02" + pid]  # PUBREL
    broker.crash_restart()
    s.close()
    pubc.paho.loop_stop()  # its gateway is gone; no reconnect attempts to the old port
    s = raw(broker.port)
    s.sendall(connect_packet(b"q2o-sub", clean=False))
    # session present, then the PUBREL again, not the PUBLISH (in one read or two)
    assert read_packets(s, 2) == [b"\x20\x02\x01\x00", b"\x62\x02" + pid]
    s.sendall(b"\x70\x02" + pid)  # PUBCOMP
    assert_silent(s, 1.0)
    s.close()


@pytest.mark.restart
def test_73_sigkill_right_after_pubcomp_stores_a_reused_packet_id(broker):
    """After its PUBCOMP a client may use the packet id for a new message: the session forgets
    the id before the PUBCOMP goes out. SIGKILL right after the PUBCOMP; after the restart a new
    QoS 2 PUBLISH with the same id is stored, not taken for a resend of the first."""
    _needs_sigkill(broker)
    sub = Client(broker.port, "q2c-sub").connect(clean=False)
    sub.subscribe("q2c/#", 2)
    sub.disconnect()

    def exchange(s: Any, payload: bytes) -> None:
        s.sendall(packet(0x34, s16(b"q2c/t") + b"\x00\x09" + payload))  # QoS 2, packet id 9
        assert read_packets(s, 1) == [b"\x50\x02\x00\x09"]  # PUBREC
        s.sendall(b"\x62\x02\x00\x09")  # PUBREL
        assert read_packets(s, 1) == [b"\x70\x02\x00\x09"]  # PUBCOMP

    s = _raw_connect(broker.port, b"q2c-pub")
    exchange(s, b"first")
    broker.crash_restart()
    s.close()
    s = _raw_connect(broker.port, b"q2c-pub", present=True)
    exchange(s, b"second")
    s.close()
    sub = Client(broker.port, "q2c-sub").connect(clean=False)
    assert sub.session_present
    assert [m.payload for m in sub.expect(2, timeout=10)] == [b"first", b"second"]
    sub.expect_none(0.5)
    sub.disconnect()
