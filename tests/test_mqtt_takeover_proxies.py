"""One client id, one connection, across MQTT proxies, however the takeovers fall.

A client id's connections come back one after another, alternating MQTT 3.1.1 and 5 (as paho
clients reconnecting do), on whichever proxy they reach. Every new CONNECT must end the
connection before it (v5: DISCONNECT 0x8E) within a second.

What broke: a takeover on the proxy that already owned the id ended the old, non-persistent
session there, and that sent GONE to the core after the core had answered the new connection's
CLAIM ("this proxy holds it already"). The core then forgot that this proxy owned the id, so the
next CONNECT on another proxy was answered without a TAKE, and the connection before it stayed
open (until its client gave up).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import V5, V311, Client
from test_mqtt_proxies import Proxy

TAKEOVER_S = 1.0  # the longest a takeover may leave the old connection open


def _chain(ports: list[int], versions: list[int], cid: str) -> list[float]:
    """Connect `cid` on each port in turn; each CONNECT must close the connection before it.
    Returns how long each old connection stayed open after the new CONNECT was sent (its
    client's close stamped in paho's thread: a slow test thread on a busy machine is not the
    gateway's delay)."""
    took: list[float] = []
    prev: Client | None = None
    prev_closed: list[float] = []
    try:
        for i, (port, version) in enumerate(zip(ports, versions, strict=True)):
            c = Client(port, cid, version)
            c.paho._reconnect_on_failure = False  # taken over, it must stay away (no setter)
            closed_at: list[float] = []
            on_disconnect = c.paho.on_disconnect

            def stamp(*args: Any, _at: list[float] = closed_at, _cb: Any = on_disconnect) -> None:
                _at.append(time.monotonic())
                _cb(*args)

            c.paho.on_disconnect = stamp
            sent = time.monotonic()
            c.connect()
            if prev is not None:
                prev.disconnected.wait(sent + 5 - time.monotonic())
                late = (prev_closed[0] if prev_closed else time.monotonic()) - sent
                assert late <= TAKEOVER_S, (
                    f"takeover {i} (port {port}, after port {ports[i - 1]}): the old connection "
                    f"was {'closed' if prev_closed else 'still open'} {late:.2f} s after the new "
                    f"CONNECT; earlier ones took {[round(t, 4) for t in took]}"
                )
                took.append(late)
                if prev.version == V5:
                    assert prev.disconnect_reason == 0x8E, prev.disconnect_reason
                prev.paho.loop_stop()
            prev, prev_closed = c, closed_at
    finally:
        if prev is not None:
            prev.disconnect()
    return took


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[int]]:
    """A gateway with one proxy child, and two more proxies: the three ports, in order."""
    data = tmp_path / "data"
    gw = GatewayProcess(data, ["--set", "mqtt_processes=1"]).start()
    extra: list[Proxy] = []
    try:
        extra = [Proxy(data, "edge-2"), Proxy(data, "edge-3")]
        yield [gw.port("mqtt"), *(p.port for p in extra)]
    finally:
        for p in extra:
            p.stop()
        gw.stop()


def test_takeover_on_the_same_proxy_keeps_the_id_owned(three: list[int]) -> None:
    """Two connections in a row on one proxy, then one on another: the third CONNECT must end
    the second (the second's takeover of the first, on the same proxy, must not leave the
    core believing nobody owns the id)."""
    a, b, c = three
    order = [a, a, b, b, c, a, a, c]
    _chain(order, [V311 if i % 2 else V5 for i in range(len(order))], "same-proxy")


def test_rapid_takeovers_over_three_proxies_on_one_port(tmp_path: Path) -> None:
    """`mqtt_processes = 3` on one port: the kernel picks each connection's proxy. 80 takeovers
    of one client id, alternating 3.1.1 and 5, each ends the one before within a second."""
    gw = GatewayProcess(tmp_path / "data", ["--set", "mqtt_processes=3"]).start()
    try:
        port = gw.port("mqtt")
        n = 81
        took = _chain([port] * n, [V5 if i % 2 else V311 for i in range(n)], "flip")
        assert len(took) == n - 1
    finally:
        gw.stop()


def test_random_takeovers_over_three_proxies(three: list[int]) -> None:
    """The same, each connection sent to a proxy chosen at random (seeded: reproducible)."""
    rnd = random.Random(43)
    n = 61
    ports = [rnd.choice(three) for _ in range(n)]
    _chain(ports, [V311 if i % 2 else V5 for i in range(n)], "random")
