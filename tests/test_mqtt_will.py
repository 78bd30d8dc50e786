"""Wills over real sockets: a v5 delayed will pending across a restart, a will on keep-alive
timeout, and a will published at session end before its delay ran out."""

from __future__ import annotations

import json
import time

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
    connect_packet,
    read_until_closed,
)


def _wait_device_event(broker, client_id: str, event: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for r in broker.records("__lightgate_device_events"):
            if r.key == client_id.encode() and json.loads(r.value)["event"] == event:
                return
        time.sleep(0.05)
    raise AssertionError(f"no {event} event for {client_id}")


@pytest.mark.restart
def test_55_delayed_will_pending_across_restart(broker):
    """A v5 will waiting out its Will Delay when the gateway restarts is still published after
    that delay, with its properties (not only at session expiry, and not lost)."""
    wp = props(
        WILLMESSAGE,
        WillDelayInterval=6,
        ContentType="text/plain",
        UserProperty=[("reason", "power")],
    )
    a = Client(broker.port, "wl-dev", V5).connect(
        props=props(CONNECT, SessionExpiryInterval=600),
        will=("wl/dev", b"offline", 1, True),
        will_props=wp,
    )
    a.kill()
    _wait_device_event(broker, "wl-dev", "disconnect")  # the gateway saw the abnormal close
    broker.restart()
    watcher = Client(broker.port, "wl-watch", V5).connect()
    watcher.subscribe("wl/#", 1)
    m = watcher.expect(1, timeout=20)[0]  # retained, so it counts whenever it was published
    assert (m.topic, m.payload) == ("wl/dev", b"offline")
    assert m.props.ContentType == "text/plain"
    assert m.user_props == {"reason": "power"}
    # The gateway is still healthy for everyone else afterwards.
    other = Client(broker.port, "wl-other").connect()
    other.subscribe("wlx/t", 1)
    Client(broker.port, "wl-pub").connect().publish("wlx/t", b"fine", 1)
    assert other.expect(1)[0].payload == b"fine"


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
