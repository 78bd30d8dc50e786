"""MQTT sessions end to end: persistence, offline delivery, QoS 2 de-duplication, expiry,
takeover, wills, retained messages, and a gateway restart between publish and reconnect."""

from __future__ import annotations

import socket
import time

import pytest
from mqtt_helpers import CONNECT, DISCONNECT, V5, WILLMESSAGE, Client, props


def test_20_persistent_v3_offline_in_order(broker):
    c = Client(broker.port, "per3").connect(clean=False)
    c.subscribe("off/#", 1)
    c.disconnect()
    pub = Client(broker.port, "p").connect()
    for i in range(50):
        pub.publish(f"off/{i % 2}", str(i), 1)
    c = Client(broker.port, "per3").connect(clean=False)
    assert c.session_present
    got = c.expect(50)
    assert [int(m.payload) for m in got] == list(range(50))
    c.expect_none(0.3)


def test_21_clean_session_discards(broker):
    c = Client(broker.port, "cl").connect(clean=False)
    c.subscribe("cl/t", 1)
    c.disconnect()
    Client(broker.port, "p").connect().publish("cl/t", b"x", 1)
    c = Client(broker.port, "cl").connect(clean=True)
    assert not c.session_present
    c.expect_none(0.5)


def test_22_v5_session_expiry(broker):
    c = Client(broker.port, "se", V5).connect(props=props(CONNECT, SessionExpiryInterval=1))
    c.subscribe("se/t", 1)
    c.disconnect()
    time.sleep(2.0)
    c = Client(broker.port, "se", V5).connect(
        clean=False, props=props(CONNECT, SessionExpiryInterval=1)
    )
    assert not c.session_present


def test_25_takeover_keeps_persistent_session(broker):
    first = Client(broker.port, "dup3").connect(clean=False)
    first.subscribe("tk/t", 1)
    second = Client(broker.port, "dup3").connect(clean=False)
    assert second.session_present
    first.paho.loop_stop()
    Client(broker.port, "p").connect().publish("tk/t", b"x", 1)
    assert second.expect(1)[0].payload == b"x"


def test_28_will_on_abnormal_close_not_on_disconnect(broker):
    watcher = Client(broker.port, "w").connect()
    watcher.subscribe("will/#", 1)
    a = Client(broker.port, "wa").connect(will=("will/a", b"gone", 1, False))
    a.kill()
    assert watcher.expect(1)[0].payload == b"gone"
    b = Client(broker.port, "wb").connect(will=("will/b", b"gone", 1, False))
    b.disconnect()
    watcher.expect_none(0.5)


def test_29_will_delay_v5_cancelled_by_reconnect(broker):
    watcher = Client(broker.port, "w").connect()
    watcher.subscribe("wd/#", 1)
    cp = props(CONNECT, SessionExpiryInterval=60)
    wp = props(WILLMESSAGE, WillDelayInterval=1)
    a = Client(broker.port, "wd1", V5).connect(
        props=cp, will=("wd/a", b"late", 1, False), will_props=wp
    )
    a.kill()
    watcher.expect_none(0.5)
    assert watcher.expect(1, timeout=3)[0].payload == b"late"
    b = Client(broker.port, "wd2", V5).connect(
        props=cp, will=("wd/b", b"never", 1, False), will_props=wp
    )
    b.kill()
    Client(broker.port, "wd2", V5).connect(clean=False, props=cp)
    watcher.expect_none(1.5)


def test_30_disconnect_with_will_reason(broker):
    watcher = Client(broker.port, "w").connect()
    watcher.subscribe("wr/#", 1)
    a = Client(broker.port, "wr1", V5).connect(will=("wr/a", b"asked", 1, False))
    a.disconnect(
        reasoncode=__import__("paho.mqtt.reasoncodes", fromlist=["ReasonCode"]).ReasonCode(
            DISCONNECT, identifier=0x04
        )
    )
    assert watcher.expect(1)[0].payload == b"asked"


def test_31_retained_set_clear(broker):
    pub = Client(broker.port, "p").connect()
    pub.publish("ret/a", b"A", 1, retain=True)
    pub.publish("ret/b", b"B", 1, retain=True)
    pub.publish("ret/c/d", b"CD", 0, retain=True)
    pub.publish("ret/b", b"", 1, retain=True)  # clears
    time.sleep(0.2)
    s = Client(broker.port, "s").connect()
    s.subscribe("ret/#", 1)
    got = {m.topic: m for m in s.expect(2)}
    assert got["ret/a"].payload == b"A" and got["ret/a"].retain
    assert got["ret/c/d"].payload == b"CD" and got["ret/c/d"].qos == 0
    s.expect_none(0.3)


def test_32_qos2_dedupe_survives_reconnect(broker):
    """A QoS 2 PUBLISH re-sent (DUP) after reconnect, before PUBREL, is stored once."""
    sub = Client(broker.port, "s").connect()
    sub.subscribe("q2/t", 2)

    def connect(clean: bool) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", broker.port))
        flags = 0x00 if not clean else 0x02
        s.sendall(bytes([0x10, 14, 0, 4]) + b"MQTT" + bytes([4, flags, 0, 60, 0, 2]) + b"q2")
        assert s.recv(4)[:2] == b"\x20\x02"
        return s

    s = connect(clean=False)
    publish = bytes([0x34, 2 + 4 + 2 + 3]) + b"\x00\x04q2/t" + b"\x00\x07" + b"one"
    s.sendall(publish)
    assert s.recv(4) == b"\x50\x02\x00\x07"  # PUBREC
    s.close()
    s = connect(clean=False)
    s.sendall(bytes([publish[0] | 0x08]) + publish[1:])  # DUP resend
    assert s.recv(4) == b"\x50\x02\x00\x07"
    s.sendall(b"\x62\x02\x00\x07")  # PUBREL
    assert s.recv(4) == b"\x70\x02\x00\x07"  # PUBCOMP
    assert [m.payload for m in sub.expect(1)] == [b"one"]
    sub.expect_none(0.5)
    s.close()


def test_33_outbound_qos1_resent_with_dup_on_reconnect(broker):
    """Unacknowledged outbound QoS 1 messages are re-sent with DUP when the session resumes."""
    s = socket.create_connection(("127.0.0.1", broker.port))
    s.sendall(bytes([0x10, 15, 0, 4]) + b"MQTT" + bytes([4, 0, 0, 60, 0, 3]) + b"dup")
    assert s.recv(4) == b"\x20\x02\x00\x00"
    s.sendall(b"\x82\x0a\x00\x01\x00\x05dup/t\x01")
    assert s.recv(5) == b"\x90\x03\x00\x01\x01"
    Client(broker.port, "p").connect().publish("dup/t", b"hello", 1)
    s.settimeout(5)
    first = s.recv(100)
    assert first[0] == 0x32 and first.endswith(b"hello")
    s.close()  # no PUBACK
    s = socket.create_connection(("127.0.0.1", broker.port))
    s.sendall(bytes([0x10, 15, 0, 4]) + b"MQTT" + bytes([4, 0, 0, 60, 0, 3]) + b"dup")
    assert s.recv(4) == b"\x20\x02\x01\x00"  # session present
    s.settimeout(5)
    again = s.recv(100)
    assert again[0] == 0x3A and again[1:] == first[1:]  # DUP set, same packet id
    s.sendall(b"\x40\x02" + again[9:11])  # PUBACK
    s.close()


@pytest.mark.restart
def test_34_restart_between_publish_and_reconnect(broker):
    """Nothing lost: publish while a persistent subscriber is away, restart, reconnect."""
    c = Client(broker.port, "rs").connect(clean=False)
    c.subscribe("rs/#", 1)
    c.disconnect()
    pub = Client(broker.port, "p").connect()
    for i in range(100):
        pub.publish(f"rs/{i % 4}", str(i), 1)
    pub.disconnect()
    broker.restart()
    c = Client(broker.port, "rs").connect(clean=False)
    assert c.session_present
    got = c.expect(100, timeout=20)
    assert sorted(int(m.payload) for m in got) == list(range(100))
    per_topic: dict[str, list[int]] = {}
    for m in got:
        per_topic.setdefault(m.topic, []).append(int(m.payload))
    assert all(v == sorted(v) for v in per_topic.values())


@pytest.mark.restart
def test_35_acked_messages_not_resent_after_restart(broker):
    """A persistent QoS 1 subscriber's PUBACKs move its stored position: after a restart it gets
    only what is new, not again what it acknowledged (QoS 1 may repeat only the unacknowledged)."""
    c = Client(broker.port, "ak").connect(clean=False)
    c.subscribe("ak/#", 1)
    pub = Client(broker.port, "p").connect()
    for i in range(30):
        pub.publish(f"ak/{i % 3}", str(i), 1)
    got = c.expect(30)
    assert sorted(int(m.payload) for m in got) == list(range(30))
    time.sleep(0.3)  # paho's PUBACKs go out after each message; the DISCONNECT after them
    c.disconnect()
    broker.restart()
    c = Client(broker.port, "ak").connect(clean=False)
    assert c.session_present
    pub = Client(broker.port, "p").connect()
    pub.publish("ak/0", b"new", 1)
    assert [m.payload for m in c.expect(1, timeout=10)] == [b"new"]
    c.expect_none(0.5)
