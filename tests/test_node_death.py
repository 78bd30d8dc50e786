"""A node of a Kafka-backed cluster killed with SIGKILL under QoS 1 load (real Tansu, real
`serve` processes): its clients resume their sessions on the survivors, nothing acknowledged
is lost, and each will is published once by one survivor after its delay, never for a client
that came back first (lightgate.node_deaths).
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import V5, Client, Received, props
from paho.mqtt.packettypes import PacketTypes
from tansu import Tansu, kafka_args
from test_cluster_sessions import cluster_figures, no_reconnect, start_nodes

pytestmark = pytest.mark.timeout(240)

WILL_DELAY = 6  # s
FAST = ("--set", "cluster_state_flush_ms=300", "--set", "cluster_node_timeout_ms=3000")


def will_client(port: int, cid: str) -> Client:
    """A v5 persistent session (expiry 1 h) with a will delayed WILL_DELAY s."""
    c = no_reconnect(Client(port, cid, version=V5))
    return c.connect(
        clean=False,
        props=props(PacketTypes.CONNECT, SessionExpiryInterval=3600),
        will=(f"will/{cid}", f"gone:{cid}".encode(), 1, False),
        will_props=props(PacketTypes.WILLMESSAGE, WillDelayInterval=WILL_DELAY),
    )


def resume(port: int, cid: str) -> Client:
    c = no_reconnect(Client(port, cid, version=V5))
    return c.connect(clean=False, props=props(PacketTypes.CONNECT, SessionExpiryInterval=3600))


def publish_until_gone(c: Client, cid: str, acked: list[bytes], stop: threading.Event) -> None:
    """QoS 1 as fast as PUBACKs come; only acknowledged payloads are recorded."""
    n = 0
    while not stop.is_set() and not c.disconnected.is_set():
        payload = f"{cid}:{n}".encode()
        try:
            c.publish(f"load/{cid}", payload, qos=1, timeout=1)
        except AssertionError:
            return  # no PUBACK: the node is gone (this one may or may not be in the log)
        acked.append(payload)
        n += 1


def drain(c: Client, into: list[tuple[float, Received]]) -> None:
    while True:
        try:
            m = c.messages.get_nowait()
        except queue.Empty:
            return
        into.append((time.monotonic(), m))


@pytest.mark.parametrize("processes", [0, 1], ids=["in-process", "proxies"])
def test_kill_9_of_a_node_under_qos1_load(tmp_path: Path, tansu: Tansu, processes: int) -> None:
    more = (*FAST, "--set", f"mqtt_processes={processes}")
    nodes = start_nodes(tmp_path, tansu, 3, *more)
    try:
        ports = [g.port("mqtt") for g in nodes]
        watchers = []
        for i in (1, 2):
            w = Client(ports[i], f"watch{i}", version=V5).connect()
            w.subscribe("load/#", qos=1)
            w.subscribe("will/#", qos=1)
            watchers.append(w)
        cids = ["back", "late0", "late1"]
        clients = {cid: will_client(ports[0], cid) for cid in cids}
        for cid, c in clients.items():
            c.subscribe(f"sess/{cid}", qos=1)
        acked: dict[str, list[bytes]] = {cid: [] for cid in cids}
        stop = threading.Event()
        threads = [
            threading.Thread(target=publish_until_gone, args=(c, cid, acked[cid], stop))
            for cid, c in clients.items()
        ]
        off = will_client(ports[0], "off")  # gone before the node: its will is pending there
        off.subscribe("sess/off", qos=1)
        for t in threads:
            t.start()
        time.sleep(1.0)
        off.kill()
        t_off = time.monotonic()
        time.sleep(1.0)  # load running, several state flushes
        nodes[0].kill()
        t_kill = time.monotonic()
        for t in threads:
            t.join(15)
        stop.set()
        assert all(len(v) > 10 for v in acked.values()), {k: len(v) for k, v in acked.items()}
        for c in clients.values():
            assert c.disconnected.wait(10)
            c.paho.loop_stop()

        # Back before its will's delay: session present on another node, no will ever.
        back = resume(ports[1], "back")
        assert back.session_present, "no session for a client of the killed node"

        # Messages for the others while they are away wait in their sessions.
        pub = Client(ports[2], "").connect()
        for cid in ("late0", "late1", "back", "off"):
            pub.publish(f"sess/{cid}", f"while-away:{cid}".encode(), qos=1)
        pub.disconnect()
        got_back = back.expect(1, timeout=15)
        assert [m.payload for m in got_back] == [b"while-away:back"]

        # The wills of those not back: published once, after their delay, by a survivor.
        seen: list[list[tuple[float, Received]]] = [[], []]
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            for w, into in zip(watchers, seen, strict=True):
                drain(w, into)
            wills = [{m.topic for _, m in s if m.topic.startswith("will/")} for s in seen]
            if all(w >= {"will/late0", "will/late1", "will/off"} for w in wills):
                break
            time.sleep(0.1)
        time.sleep(3.0)  # a second publication would arrive meanwhile
        for w, into in zip(watchers, seen, strict=True):
            drain(w, into)
        for i, into in enumerate(seen):
            wills_seen = [(t, m) for t, m in into if m.topic.startswith("will/")]
            topics = sorted(m.topic for _, m in wills_seen)
            assert topics == ["will/late0", "will/late1", "will/off"], f"watcher {i}: {topics}"
            for t, m in wills_seen:
                if m.topic == "will/off":  # due from its disconnect, not from the node's death
                    took = t - t_off
                    assert WILL_DELAY - 0.5 <= took < WILL_DELAY + 3.5, f"will/off after {took:.1f}"
                else:
                    took = t - t_kill
                    assert took >= WILL_DELAY - 0.5, f"{m.topic} {took:.1f} s after the kill"

        # Every acknowledged message reached the subscribers on both surviving nodes.
        for i, into in enumerate(seen):
            loads = {m.payload for _, m in into if m.topic.startswith("load/")}
            for cid, payloads in acked.items():
                lost = [p for p in payloads if p not in loads]
                assert not lost, f"watcher {i}: {len(lost)} acknowledged from {cid} lost"

        # One survivor adopted each session (the client back first may have been adopted too,
        # if its claim came after the adoption).
        figures = [cluster_figures(g) for g in nodes[1:]]
        adopted = sum(f.get("adopted", 0) for f in figures)
        assert adopted in (3, 4), figures
        assert all(f.get("nodes_dead", 0) == 1 for f in figures), figures

        # The killed node restarts with its data dir: its copies of the adopted sessions are
        # dropped, not held again (no will a second time).
        nodes[0] = GatewayProcess(tmp_path / "node0", kafka_args(tansu, *more)).start()
        ports[0] = nodes[0].port("mqtt")
        time.sleep(3.0)
        again: list[tuple[float, Received]] = []
        for w in watchers:
            drain(w, again)
        assert not [m.topic for _, m in again if m.topic.startswith("will/")]

        # The late ones resume their sessions (adopted by a survivor) on any node.
        for cid, port in (("late0", ports[2]), ("late1", ports[1]), ("off", ports[0])):
            c = resume(port, cid)
            assert c.session_present, f"{cid}: no session"
            got = c.expect(1, timeout=15)
            assert [m.payload for m in got] == [f"while-away:{cid}".encode()]
            c.disconnect()
        back.disconnect()
        for w in watchers:
            w.disconnect()
    except BaseException:
        for i, g in enumerate(nodes):
            print(f"--- node {i} log ---\n" + g.log_text()[-6000:])
        raise
    finally:
        for g in nodes:
            g.stop()
