"""Several Lightgate nodes on one Kafka-compatible cluster (real Tansu, real `serve` processes):
one client id has one connection cluster-wide, and a persistent session moves between nodes
with its subscriptions, positions and every acknowledged message (lightgate.cluster_sessions).
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import V5, V311, Client, props, raw, read_packets
from paho.mqtt.packettypes import PacketTypes
from tansu import Tansu, kafka_args

pytestmark = pytest.mark.timeout(240)


def start_nodes(tmp: Path, t: Tansu, n: int, *more: str) -> list[GatewayProcess]:
    nodes: list[GatewayProcess] = []
    try:
        for i in range(n):
            nodes.append(GatewayProcess(tmp / f"node{i}", kafka_args(t, *more)).start())
    except BaseException:
        for g in nodes:
            g.stop()
        raise
    return nodes


@pytest.fixture(params=[0, 1], ids=["in-process", "proxies"])
def two_nodes(request: pytest.FixtureRequest, tmp_path: Path, tansu: Tansu) -> Iterator[list[int]]:
    nodes = start_nodes(tmp_path, tansu, 2, "--set", f"mqtt_processes={request.param}")
    try:
        yield [g.port("mqtt") for g in nodes]
    finally:
        for g in nodes:
            g.stop()


def cluster_figures(g: GatewayProcess) -> dict[str, float]:
    """`lightgate_cluster_sessions_total` of one node, by event, from its /metrics."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{g.port('http')}/metrics", timeout=10)
    out = {}
    for line in body.read().decode().splitlines():
        m = re.match(r'lightgate_cluster_sessions_total\{event="(\w+)"\} (\S+)', line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def no_reconnect(c: Client) -> Client:
    c.paho._reconnect_on_failure = False  # an ended connection stays ended (no paho retry)
    return c


def session(port: int, cid: str, version: int) -> Client:
    """A persistent session's connection (3.1.1 clean session 0, v5 expiry 1 h)."""
    c = no_reconnect(Client(port, cid, version=version))
    if version == V5:
        return c.connect(clean=False, props=props(PacketTypes.CONNECT, SessionExpiryInterval=3600))
    return c.connect(clean=False)


def test_connect_on_another_node_ends_the_connection_within_a_second(two_nodes: list[int]) -> None:
    """A CONNECT on node B ends the same client id's connection on node A (v5: DISCONNECT
    0x8E, 3.1.1: closed) within a second, every time, both directions, both versions."""
    ports = two_nodes
    versions = [V5, V311, V5, V311, V5, V5, V311, V311, V5, V311, V5, V5, V311]
    old = no_reconnect(Client(ports[0], "roamer", version=versions[0])).connect()
    for i, version in enumerate(versions[1:], 1):
        new = no_reconnect(Client(ports[i % 2], "roamer", version=version))
        t0 = time.monotonic()  # from the CONNECT on the other node
        new.connect()
        assert old.disconnected.wait(max(0.0, t0 + 1.0 - time.monotonic())), (
            f"takeover {i}: old connection still open 1 s after the CONNECT"
        )
        took = time.monotonic() - t0
        if old.version == V5:
            assert getattr(old.disconnect_reason, "value", old.disconnect_reason) == 0x8E, (
                f"takeover {i}: {old.disconnect_reason!r}"
            )
        assert took < 1.0
        old.paho.loop_stop()
        # The new connection stays: nothing ends it.
        assert not new.disconnected.wait(0.3), f"takeover {i}: the new connection was ended"
        old = new
    old.disconnect()


def test_simultaneous_connects_on_two_nodes_leave_one_connection(two_nodes: list[int]) -> None:
    """Two clients with one id CONNECT to two nodes at the same moment: whatever the order
    the cluster puts their claims in, exactly one connection is left."""
    for rnd in range(6):
        pair = [no_reconnect(Client(port, "twin", version=V5)) for port in two_nodes]
        threads = [threading.Thread(target=c.connect, kwargs={"expect_ok": False}) for c in pair]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        time.sleep(1.5)
        alive = [c for c in pair if not c.disconnected.is_set()]
        assert len(alive) == 1, f"round {rnd}: {len(alive)} connections left"
        alive[0].disconnect()
        for c in pair:
            c.paho.loop_stop()


def publish_all(port: int, n: int) -> dict[str, list[bytes]]:
    """n QoS 1 messages on each of two topics and n QoS 2 on a third, each PUBACKed/PUBCOMPed."""
    pub = Client(port, "").connect()
    sent: dict[str, list[bytes]] = {"move/a": [], "move/b": [], "moveq2/x": []}
    for i in range(n):
        for topic in ("move/a", "move/b"):
            payload = f"{topic}:{i}:{time.monotonic_ns()}".encode()
            pub.publish(topic, payload, qos=1)
            sent[topic].append(payload)
        payload = f"q2:{i}:{time.monotonic_ns()}".encode()
        pub.publish("moveq2/x", payload, qos=2)
        sent["moveq2/x"].append(payload)
    pub.disconnect()
    return sent


def check_delivery(c: Client, sent: dict[str, list[bytes]]) -> None:
    """Every message once and in order per topic; a QoS 1 repeat only with DUP; QoS 2 once."""
    want = sum(len(v) for v in sent.values())
    got = c.expect(want, timeout=30)
    time.sleep(0.5)
    while not c.messages.empty():
        got.append(c.messages.get())
    by_topic: dict[str, list[bytes]] = {}
    for m in got:
        by_topic.setdefault(m.topic, [])
        if m.payload in by_topic[m.topic]:
            assert m.qos == 1 and m.dup, f"repeat without DUP or at QoS 2: {m}"
            continue
        by_topic[m.topic].append(m.payload)
    assert by_topic == sent
    assert Counter(m.payload for m in got if m.qos == 2) == Counter(sent["moveq2/x"])


@pytest.mark.parametrize("version", [V5, V311])
def test_persistent_session_moves_between_three_nodes(
    tmp_path: Path, tansu: Tansu, version: int
) -> None:
    """Disconnect from A, messages published on C while away, reconnect to B: session present,
    subscriptions and positions intact, every message (QoS 1 and 2) once, in order; then on
    to C and back to A the same way."""
    nodes = start_nodes(tmp_path, tansu, 3)
    try:
        ports = [g.port("mqtt") for g in nodes]
        c = session(ports[0], "mover", version)
        c.subscribe("move/#", qos=1)
        c.subscribe("moveq2/#", qos=2)
        check_delivery(c, publish_all(ports[2], 5))  # live on A first
        c.disconnect()
        for hop, (to, via) in enumerate([(1, 2), (2, 0), (0, 1)]):
            sent = publish_all(ports[via], 20)
            c = session(ports[to], "mover", version)
            assert c.session_present, f"hop {hop}: no session on node {to}"
            check_delivery(c, sent)
            c.disconnect()
        # Positions came along: nothing old is read again on a node the session visited before.
        c = session(ports[1], "mover", version)
        assert c.session_present
        c.expect_none(1.0)
        c.disconnect()
        # Node B took the session twice (from A, from A again) and handed it on once (to C).
        figures = cluster_figures(nodes[1])
        assert figures["taken_over"] == 2 and figures["handed_over"] == 1, figures
        assert figures.get("handover_waits", 0) == 0, figures
    finally:
        for g in nodes:
            g.stop()


def test_session_moves_with_proxies_on_both_nodes(tmp_path: Path, tansu: Tansu) -> None:
    """The same move with `mqtt_processes = 1` on each node (the core's registry hands over)."""
    nodes = start_nodes(tmp_path, tansu, 2, "--set", "mqtt_processes=1")
    try:
        ports = [g.port("mqtt") for g in nodes]
        c = session(ports[0], "mover", V5)
        c.subscribe("move/#", qos=1)
        c.subscribe("moveq2/#", qos=2)
        c.disconnect()
        for hop, to in enumerate([1, 0, 1]):
            sent = publish_all(ports[1 - to], 15)
            c = session(ports[to], "mover", V5)
            assert c.session_present, f"hop {hop}"
            check_delivery(c, sent)
            c.disconnect()
    finally:
        for g in nodes:
            g.stop()


def connect_v311(port: int, cid: str) -> bytes:
    cid_b = cid.encode()
    body = b"\x00\x04MQTT\x04\x00\x00\x3c" + len(cid_b).to_bytes(2, "big") + cid_b
    return bytes([0x10, len(body)]) + body


def test_unacknowledged_messages_move_with_dup(tmp_path: Path, tansu: Tansu) -> None:
    """QoS 1 messages sent on A but never acknowledged are re-sent on B with DUP, once, and
    nothing after them is lost or read twice."""
    nodes = start_nodes(tmp_path, tansu, 2)
    try:
        a, b = (g.port("mqtt") for g in nodes)
        s = raw(a)
        s.sendall(connect_v311(a, "noack"))
        assert read_packets(s, 1)[0][:2] == b"\x20\x02"
        s.sendall(b"\x82\x0a\x00\x01\x00\x05inf/#\x01")  # SUBSCRIBE inf/# QoS 1
        assert read_packets(s, 1)[0][0] == 0x90
        pub = Client(b, "").connect()
        for i in range(3):
            pub.publish("inf/t", f"m{i}".encode(), qos=1)
        got = read_packets(s, 3)
        assert all(p[0] == 0x32 for p in got)  # QoS 1, no DUP, never acknowledged
        s.close()
        time.sleep(0.3)
        for i in range(3, 6):
            pub.publish("inf/t", f"m{i}".encode(), qos=1)
        pub.disconnect()
        c = session(b, "noack", V311)
        assert c.session_present
        msgs = c.expect(6, timeout=20)
        time.sleep(0.5)
        assert c.messages.empty()
        assert [m.payload for m in msgs] == [f"m{i}".encode() for i in range(6)]
        assert [m.dup for m in msgs] == [True] * 3 + [False] * 3
        c.disconnect()
    finally:
        for g in nodes:
            g.stop()


@pytest.mark.parametrize("processes", [0, 1], ids=["in-process", "proxies"])
def test_sessions_of_a_stopped_node_resume_on_another(
    tmp_path: Path, tansu: Tansu, processes: int
) -> None:
    """A rolling restart: node A stops (SIGTERM) with a client connected; the client comes
    back on B at once (A wrote its sessions as it stopped: no hand-over wait), gets what was
    published meanwhile, and later moves back to the restarted A with nothing lost or read
    twice."""
    more = ("--set", f"mqtt_processes={processes}")
    nodes = start_nodes(tmp_path, tansu, 2, *more)
    try:
        c = session(nodes[0].port("mqtt"), "roller", V5)
        c.subscribe("move/#", qos=1)
        c.subscribe("moveq2/#", qos=2)
        check_delivery(c, publish_all(nodes[1].port("mqtt"), 3))
        nodes[0].stop()
        assert c.disconnected.wait(5)
        c.paho.loop_stop()
        sent = publish_all(nodes[1].port("mqtt"), 10)
        t0 = time.monotonic()
        c = session(nodes[1].port("mqtt"), "roller", V5)
        took = time.monotonic() - t0
        assert c.session_present
        assert took < 0.9, f"waited {took:.2f} s for a node that had stopped"
        check_delivery(c, sent)
        nodes[0] = GatewayProcess(tmp_path / "node0", kafka_args(tansu, *more)).start()
        c.disconnect()
        sent = publish_all(nodes[1].port("mqtt"), 10)
        c = session(nodes[0].port("mqtt"), "roller", V5)
        assert c.session_present
        check_delivery(c, sent)
        c.disconnect()
    finally:
        for g in nodes:
            g.stop()


def test_a_session_moves_right_after_a_new_log_topic_appears(tmp_path: Path, tansu: Tansu) -> None:
    """A log topic one node made a moment ago may not be known yet on the node the session
    moves to (metadata is refreshed every second): what the session already got there is not
    sent again, and what came after is sent once."""
    nodes = start_nodes(tmp_path, tansu, 2)
    try:
        ports = [g.port("mqtt") for g in nodes]
        c = session(ports[0], "quick", V311)
        c.subscribe("+/fresh", qos=1)
        c.disconnect()
        for hop in range(4):
            here, there = ports[hop % 2], ports[(hop + 1) % 2]
            c = session(here, "quick", V311)
            assert c.session_present
            pub = Client(here, "").connect()
            for i in range(5):  # a new log topic, made by this node
                pub.publish(f"n{hop}/fresh", f"{hop}:{i}".encode(), qos=1)
            pub.disconnect()
            got = c.expect(5)
            assert [m.payload for m in got] == [f"{hop}:{i}".encode() for i in range(5)]
            c.disconnect()
            c = session(there, "quick", V311)  # at once: that node may not know n{hop} yet
            assert c.session_present
            c.expect_none(1.5)
            c.disconnect()
    finally:
        for g in nodes:
            g.stop()
