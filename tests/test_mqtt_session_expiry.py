"""Session expiry: an expired session leaves no state, and a session online when the gateway
stopped counts its expiry from the stop."""

from __future__ import annotations

import time

import pytest
from mqtt_helpers import (
    CONNECT,
    DISCONNECT,
    V5,
    Client,
    props,
)


def test_53_session_expiry_removes_state(broker):
    """An expired v5 session is gone: no session present, nothing it would have queued, no
    subscription. DISCONNECT with Session Expiry 0 ends a session at once. A session that has
    not expired keeps all of it (the control)."""
    short = props(CONNECT, SessionExpiryInterval=2)
    long_ = props(CONNECT, SessionExpiryInterval=60)
    gone = Client(broker.port, "sx-gone", V5).connect(props=short)
    gone.subscribe("sx/t", 1)
    gone.disconnect()
    ended = Client(broker.port, "sx-ended", V5).connect(props=long_)
    ended.subscribe("sx/t", 1)
    ended.disconnect(props=props(DISCONNECT, SessionExpiryInterval=0))
    kept = Client(broker.port, "sx-kept", V5).connect(props=long_)
    kept.subscribe("sx/t", 1)
    kept.disconnect()
    pub = Client(broker.port, "sx-pub", V5).connect()
    pub.publish("sx/t", b"before expiry", 1)
    time.sleep(3.5)

    kept = Client(broker.port, "sx-kept", V5).connect(clean=False, props=long_)
    assert kept.session_present
    assert [m.payload for m in kept.expect(1)] == [b"before expiry"]
    for cid in ("sx-gone", "sx-ended"):
        c = Client(broker.port, cid, V5).connect(clean=False, props=long_)
        assert not c.session_present, cid
        c.expect_none(0.5)  # the queued message went with the session
        pub.publish("sx/t", f"after {cid}", 1)
        assert kept.expect(1)[0].payload == f"after {cid}".encode()
        c.expect_none(0.5)  # and so did the subscription
        c.disconnect()


@pytest.mark.restart
def test_56_session_online_at_restart_expires_from_the_stop(broker):
    """A persistent session that was online when the gateway stopped counts its expiry from then,
    not from an earlier disconnect of the same session (that stale time expired it at once)."""
    cp = props(CONNECT, SessionExpiryInterval=8)
    c = Client(broker.port, "onr-dev", V5).connect(props=cp)
    c.subscribe("onr/t", 1)
    c.disconnect()
    c = Client(broker.port, "onr-dev", V5).connect(clean=False, props=cp)
    assert c.session_present
    time.sleep(9)  # online for longer than the session expiry since that disconnect
    c.paho.loop_stop()  # still connected when the gateway stops; no reconnect to the old port
    broker.restart()
    c = Client(broker.port, "onr-dev", V5).connect(clean=False, props=cp)
    assert c.session_present
    Client(broker.port, "onr-pub").connect().publish("onr/t", b"still subscribed", 1)
    assert c.expect(1)[0].payload == b"still subscribed"
