"""`log = "kafka"` with the MQTT proxy in its own process (`mqtt_processes = 1`), on a real
Kafka-compatible cluster (Tansu, tests/tansu.py).

The core holds the cluster log; the proxy reaches it over the core link, unchanged: the core
answers its appends once the cluster acknowledged them and fetches records before it answers
the proxy's resolves.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from kafka_log_checks import consume_all, replay_from_time
from mqtt_helpers import V5, Client
from tansu import Tansu, kafka_args

pytestmark = pytest.mark.timeout(120)

SPLIT = ("--set", "mqtt_processes=1")


def start(tmp: Path, t: Tansu, *more: str) -> GatewayProcess:
    return GatewayProcess(tmp / "data", kafka_args(t, *SPLIT, *more)).start()


def test_split_proxy_publish_subscribe_on_the_cluster(tmp_path: Path, tansu: Tansu) -> None:
    gw = start(tmp_path, tansu)
    try:
        port = gw.port("mqtt")
        sub = Client(port, "sub", version=V5).connect()
        sub.subscribe("plant/#", qos=1)
        pub = Client(port, "pub").connect()
        for i in range(20):
            pub.publish(f"plant/line{i % 3}", f"m{i}".encode(), qos=1)  # waits for its PUBACK
        pub.publish("plant/door", b"open", qos=1, retain=True)
        got = sub.expect(21)
        assert sorted(m.payload for m in got) == sorted(
            [f"m{i}".encode() for i in range(20)] + [b"open"]
        )
        assert all(m.qos == 1 for m in got)
        # Retained through the core link on the cluster log.
        late = Client(port, "late").connect()
        late.subscribe("plant/door", qos=1)
        (r,) = late.expect(1)
        assert (r.payload, r.retain) == (b"open", True)
        recs = asyncio.run(consume_all(tansu.bootstrap, "plant", 21))
        assert len(recs) == 21
        for c in (pub, sub, late):
            c.disconnect()
    finally:
        gw.stop()


def test_split_proxy_offline_drain_after_kill9(tmp_path: Path, tansu: Tansu) -> None:
    """Every PUBACKed message is on the cluster when the core dies (the proxy acked after the
    cluster's acks=all); after a restart the offline session drains from the cluster through
    the proxy (the core fetches before it resolves)."""
    gw = start(tmp_path, tansu)
    try:
        port = gw.port("mqtt")
        sub = Client(port, "offline").connect(clean=False)
        sub.subscribe("fleet/+/pos", qos=1)
        sub.disconnect()
        pub = Client(port, "truck").connect()
        n = 400
        for i in range(n):
            pub.publish(f"fleet/t{i % 7}/pos", str(i).encode(), qos=1)  # each waits for PUBACK
        gw.kill()
        pub.kill()
        recs = asyncio.run(consume_all(tansu.bootstrap, "fleet", n))
        assert sorted(int(r.value) for r in recs) == list(range(n))
        gw = start(tmp_path, tansu)
        sub = Client(gw.port("mqtt"), "offline").connect(clean=False)
        assert sub.session_present
        got = sub.expect(n, timeout=60)
        assert sorted(int(m.payload) for m in got) == list(range(n))
        sub.expect_none(0.5)
        sub.disconnect()
    finally:
        gw.stop()


def test_split_proxy_replay_from_a_time_on_the_cluster(tmp_path: Path, tansu: Tansu) -> None:
    gw = start(tmp_path, tansu)
    try:
        replay_from_time(gw.port("mqtt"))
    finally:
        gw.stop()
