"""MQTT bridges against a real Mosquitto (Debian's) on loopback: forward and receive at QoS 0
and 1, the remote stopped mid-stream, `kill -9` of the gateway mid-stream, TLS with a client
certificate, refused credentials, a Mosquitto bridge section moved over, the docs' edge-to-centre
setup, the split shape, and the figures (/metrics, /api/stats, `lightgate status`)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_process import ROOT, GatewayProcess
from mosquitto_helpers import MOSQUITTO, FarSide, Mosquitto, in_order_once_each
from mqtt_helpers import V5, Client
from tansu import Tansu, free_port, kafka_args
from tls_helpers import make_pki

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="mosquitto not installed")

Start = Callable[..., GatewayProcess]


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[Mosquitto]:
    m = Mosquitto(tmp_path / "remote").start()
    yield m
    m.stop()


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """start(toml text, *args) -> a gateway with that config on tmp_path/data."""
    started: list[GatewayProcess] = []

    def go(toml: str, *args: str, data: str = "data") -> GatewayProcess:
        conf = tmp_path / "lightgate.toml"
        conf.write_text(toml)
        gw = GatewayProcess(tmp_path / data, ["--config", str(conf), *args])
        started.append(gw)
        return gw.start()

    yield go
    unclean = []
    for gw in started:
        if gw.proc is None or gw.proc.poll() is not None:
            continue  # killed by the test
        try:
            if gw.stop() != 0:
                unclean.append(gw.log_text()[-2000:])
        except Exception:
            gw.kill()
            unclean.append("did not stop in 30 s")
    assert not unclean, unclean  # SIGTERM ends a gateway with bridges cleanly


def bridge_toml(port: int, *topics: str, name: str = "centre", **keys: Any) -> str:
    lines = ["[[bridge]]", f'name = "{name}"', f'address = "127.0.0.1:{port}"',
             "reconnect_min_ms = 100", "reconnect_max_ms = 1000"]  # fmt: skip
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    lines.append("topics = [" + ", ".join(json.dumps(t) for t in topics) + "]")
    return "\n".join(lines) + "\n"


def stats(gw: GatewayProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{gw.port('http')}/api/stats", timeout=10) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def bridge_stats(gw: GatewayProcess, name: str = "centre") -> dict[str, Any]:
    (b,) = [b for b in stats(gw)["bridges"] if b["name"] == name]
    return b


def wait_until(cond: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what or cond}")


def connected(gw: GatewayProcess, name: str = "centre") -> None:
    wait_until(lambda: bridge_stats(gw, name)["connected"], what=f"bridge {name} connected")


def publish_local(port: int, topic: str, payloads: list[bytes], qos: int = 1) -> None:
    c = Client(port, f"pub-{time.monotonic_ns()}").connect()
    for p in payloads:
        c.publish(topic, p, qos=qos)
    c.disconnect()


def payloads(n: int, tag: str = "m") -> list[bytes]:
    return [f"{tag}-{i:06d}".encode() for i in range(n)]


@pytest.mark.parametrize("protocol", ["3.1.1", "5.0"])
@pytest.mark.parametrize("qos", [0, 1])
def test_forward_and_receive(remote: Mosquitto, start: Start, protocol: str, qos: int) -> None:
    gw = start(bridge_toml(remote.port, f"sensors/# out {qos}", f"cmd/# in {qos}",
                           protocol=protocol))  # fmt: skip
    connected(gw)
    far = FarSide(remote.port, "sensors/#", qos=qos)
    want = payloads(300)
    publish_local(gw.port("mqtt"), "sensors/line1/temp", want, qos=qos)
    got = far.wait_for(len(want))
    assert got == want  # nothing lost, nothing repeated without an outage, in order
    assert set(far.topics) == {"sensors/line1/temp"}
    # In: the remote's commands reach a local subscriber, as the bridge's client id.
    local = Client(gw.port("mqtt"), "cmd-reader", V5).connect()
    local.subscribe("cmd/#", qos=1)
    remote_pub = Client(remote.port, "centre-app").connect()
    for i in range(20):
        remote_pub.publish("cmd/valve", f"open-{i}".encode(), qos=qos)
    got_in = local.expect(20)
    assert [m.payload for m in got_in] == [f"open-{i}".encode() for i in range(20)]
    # No loop: nothing forwarded out came back in, nothing that came in went out.
    time.sleep(0.5)
    assert not any(p.startswith(b"open-") for p in far.payloads)
    b = bridge_stats(gw)
    assert b["messages_out"] == 300 and b["messages_in"] == 20 and b["lag_messages"] == 0
    # The remote's Receive Maximum (Mosquitto: max_inflight_messages 100 < our window 1000) was
    # kept: exceeding it, Mosquitto 2 disconnects a v5 client (0x93).
    assert b["reconnects"] == 0 and b["connected"]
    far.close()


def test_both_directions_do_not_loop(remote: Mosquitto, start: Start) -> None:
    """One `both` rule, MQTT 5: no-local keeps our own messages on the remote."""
    gw = start(bridge_toml(remote.port, "room/# both 1", protocol="5.0"))
    connected(gw)
    far = FarSide(remote.port, "room/#")
    local = Client(gw.port("mqtt"), "room-reader").connect()
    local.subscribe("room/#", qos=1)
    publish_local(gw.port("mqtt"), "room/a", [b"from-edge"])
    Client(remote.port, "centre").connect().publish("room/b", b"from-centre", qos=1)
    far.wait_for(2)
    got = sorted(m.payload for m in local.expect(2))
    assert got == [b"from-centre", b"from-edge"]
    time.sleep(1.0)
    local.expect_none(0.5)
    assert sorted(far.payloads) == [b"from-centre", b"from-edge"]


def test_remote_stopped_mid_stream(remote: Mosquitto, start: Start) -> None:
    gw = start(bridge_toml(remote.port, "sensors/# out 1"))
    connected(gw)
    far = FarSide(remote.port, "sensors/#", client_id="far-restart")
    want = payloads(3000)
    publish_local(gw.port("mqtt"), "sensors/a", want[:1000])
    far.wait_for(300)
    remote.stop()  # mid-stream: some of the first 1000 are in flight
    publish_local(gw.port("mqtt"), "sensors/a", want[1000:])
    wait_until(lambda: not bridge_stats(gw)["connected"], what="bridge down")
    b = bridge_stats(gw)
    assert b["lag_messages"] > 0 and b["lag_seconds"] > 0 and b["last_error"]
    remote.start()  # same port, its persistence file keeps the far side's session
    got = far.wait_for(len(want), timeout=90)
    in_order_once_each(got, want)
    wait_until(lambda: bridge_stats(gw)["lag_messages"] == 0, what="lag 0")
    assert bridge_stats(gw)["reconnects"] >= 1
    assert gw.log_text().count("bridge centre connected to") >= 2
    far.close()


def publish_fast(port: int, topic: str, items: list[bytes]) -> None:
    """QoS 1, 1000 in flight, returning once the last PUBACK arrived (all are durable)."""
    c = Client(port, f"pub-{time.monotonic_ns()}")
    c.paho.max_inflight_messages_set(1000)
    c.paho.max_queued_messages_set(0)
    c.connect()
    for p in items[:-1]:
        c.publish(topic, p, qos=1, wait=False)
    c.publish(topic, items[-1], qos=1, timeout=120)
    c.disconnect()


def test_kill_9_mid_stream(remote: Mosquitto, start: Start) -> None:
    """A backlog is being forwarded (the remote was away) and a publisher is under way when the
    gateway is killed: every message it PUBACKed reaches the far side after the restart, in
    order, and the restart resumes at the committed position rather than from the start."""
    toml = bridge_toml(remote.port, "sensors/# out 1")
    gw = start(toml)
    connected(gw)
    far = FarSide(remote.port, "sensors/#", client_id="far-kill")
    remote.stop()
    backlog = payloads(20_000, "b")
    publish_fast(gw.port("mqtt"), "sensors/k", backlog)
    acked: list[bytes] = []

    def publish() -> None:
        c = Client(gw.port("mqtt"), "pub-kill").connect()
        with contextlib.suppress(Exception):  # the kill ends it
            for p in payloads(50_000, "live"):
                c.publish("sensors/k", p, qos=1, timeout=3)
                acked.append(p)
        c.kill()

    remote.start()
    t = threading.Thread(target=publish)
    t.start()
    wait_until(lambda: len(far.payloads) >= 2000, what="forwarding under way")
    gw.kill()
    t.join(30)
    behind = len(backlog) + len(acked) - len(set(far.payloads))
    assert behind > 0, "everything was forwarded before the kill"
    want = backlog + acked
    gw2 = start(toml)
    got = far.wait_for(len(want), timeout=120)
    in_order_once_each(got, want)
    wait_until(lambda: bridge_stats(gw2)["lag_messages"] == 0, what="lag 0")
    assert len(got) - len(set(got)) <= 1000  # at most the in-flight window is sent twice
    far.close()


def test_tls_with_client_certificate(tmp_path: Path, start: Start) -> None:
    pki = make_pki(tmp_path / "pki")
    server_cert, server_key = pki.issue("mosq", "localhost", server=True)
    cert, key = pki.issue("edge", "edge-1")
    m = Mosquitto(tmp_path / "tls-remote", extra=[
        f"cafile {pki.ca}", f"certfile {server_cert}", f"keyfile {server_key}",
        "require_certificate true", "use_identity_as_username true", "allow_anonymous false",
    ]).start()  # fmt: skip
    try:
        gw = start(bridge_toml(m.port, "sensors/# out 1", tls_ca=pki.ca, tls_cert=cert,
                               tls_key=key, tls_server_name="localhost"))  # fmt: skip
        connected(gw)
        # The far side reads over TLS too (the only listener).
        far = subprocess.Popen(
            ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(m.port), "-t", "sensors/#", "-q", "1",
             "-C", "3", "-W", "20", "--cafile", pki.ca, "--cert", cert, "--key", key,
             "--insecure"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(0.5)
        publish_local(gw.port("mqtt"), "sensors/t", [b"a", b"b", b"c"])
        out, _ = far.communicate(timeout=30)
        assert out.split() == ["a", "b", "c"]
    finally:
        m.stop()


def test_refused_credentials_then_fixed(tmp_path: Path, start: Start) -> None:
    pwfile = tmp_path / "remote-passwd"

    def users(edge_password: str) -> None:
        pwfile.write_text("")
        for user, pw in (("edge", edge_password), ("far", "farpw")):
            subprocess.run(["mosquitto_passwd", "-b", str(pwfile), user, pw], check=True)

    users("other")
    m = Mosquitto(tmp_path / "auth-remote", extra=[f"password_file {pwfile}",
                                                   "allow_anonymous false"]).start()  # fmt: skip
    try:
        sub = Client(m.port, "far-auth").connect(username="far", password="farpw")
        sub.subscribe("sensors/#", qos=1)
        secret = tmp_path / "bridge-password"
        secret.write_text("right\n")
        gw = start(bridge_toml(m.port, "sensors/# out 1", username="edge",
                               password_file=str(secret)))  # fmt: skip
        # Mosquitto 2 answers a wrong password with 0x05, not authorized (v3.1.1).
        wait_until(lambda: "remote refused the connection: not authorized (CONNACK reason 0x87)"
                   in bridge_stats(gw)["last_error"], what="the refusal")  # fmt: skip
        want = payloads(500)
        publish_local(gw.port("mqtt"), "sensors/p", want)
        time.sleep(2.0)  # several retries with backoff
        b = bridge_stats(gw)
        assert not b["connected"] and b["reconnects"] >= 2 and b["lag_messages"] == 500
        # One log line for the refusal, not one per retry.
        assert gw.log_text().count("remote refused the connection") == 1, gw.log_text()
        users("right")
        assert m.proc is not None
        m.proc.send_signal(signal.SIGHUP)  # Mosquitto reloads its password file
        connected(gw)
        got = [r.payload for r in sub.expect(len(want), timeout=30)]
        in_order_once_each(got, want)
    finally:
        m.stop()


def _block(doc: str, lang: str, after: str) -> str:
    """The first ```lang block of docs/`doc` after the text `after`."""
    text = (ROOT / "docs" / doc).read_text()
    rest = text[text.index(after) :]
    m = re.search(rf"```{lang}\n(.*?)```", rest, re.S)
    assert m is not None
    return m.group(1)


def test_docs_edge_to_centre(tmp_path: Path, start: Start) -> None:
    """docs/bridges.md's central.conf and edge.toml as written (ports changed to free ones),
    with a far-side `mosquitto_sub` and the remote stopped and started again meanwhile."""
    conf = _block("bridges.md", "conf", "The central broker")
    edge = _block("bridges.md", "toml", "The edge gateway's")
    centre = Mosquitto(tmp_path / "centre")
    centre.port = free_port()
    centre.extra = [ln for ln in conf.splitlines() if ln and not ln.startswith("listener")]
    centre.start()
    try:
        gw = start(edge.replace("127.0.0.1:1884", f"127.0.0.1:{centre.port}"))
        connected(gw)
        far = subprocess.Popen(
            ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(centre.port), "-t", "site1/sensors/#",
             "-q", "1", "-v", "-c", "-i", "far", "-C", "1", "-W", "20"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        time.sleep(0.5)
        subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(gw.port("mqtt")), "-t",
                        "sensors/line1/temp", "-m", "21.5", "-q", "1"], check=True)  # fmt: skip
        out, _ = far.communicate(timeout=30)
        assert out.strip() == "site1/sensors/line1/temp 21.5"
        local = Client(gw.port("mqtt"), "cmd-reader").connect()
        local.subscribe("cmd/#", qos=1)
        subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(centre.port), "-t",
                        "site1/cmd/valve", "-m", "open", "-q", "1"], check=True)  # fmt: skip
        (m,) = local.expect(1)
        assert (m.topic, m.payload) == ("cmd/valve", b"open")
        # The far side's persistent session (-c -i far) is offline now; the centre goes away,
        # a thousand readings arrive on the edge, the centre comes back: all of them, in order.
        centre.stop()
        want = payloads(1000, "r")
        publish_fast(gw.port("mqtt"), "sensors/line1/temp", want)
        centre.start()
        sub = FarSide(centre.port, "site1/sensors/#", client_id="far")
        in_order_once_each(sub.wait_for(len(want), timeout=60), want)
        sub.close()
    finally:
        centre.stop()


def test_mosquitto_section_moved_over(tmp_path: Path, remote: Mosquitto, start: Start) -> None:
    """A bridge section as it stood in a mosquitto.conf, in a file, with prefixes both ways."""
    section = tmp_path / "bridge.conf"
    section.write_text(
        "# from /etc/mosquitto/conf.d/bridge.conf\n"
        "connection central\n"
        f"address 127.0.0.1:{remote.port}\n"
        "remote_clientid edge-17\n"
        "cleansession false\n"
        "try_private true\n"
        "notifications false\n"
        "bridge_protocol_version mqttv311\n"
        'topic sensors/# out 1 "" site17/\n'
        "topic cmd/# in 1 edge/ site17/\n"
    )
    gw = start(f'[[bridge]]\nname = "central"\nmosquitto_file = "{section}"\n')
    connected(gw, "central")
    far = FarSide(remote.port, "site17/#")
    publish_local(gw.port("mqtt"), "sensors/x", [b"1", b"2"])
    assert far.wait_for(2) == [b"1", b"2"] and far.topics == ["site17/sensors/x"] * 2
    local = Client(gw.port("mqtt"), "cmd-reader").connect()
    local.subscribe("edge/cmd/#", qos=1)
    Client(remote.port, "centre-app").connect().publish("site17/cmd/go", b"now", qos=1)
    (m,) = local.expect(1)
    assert (m.topic, m.payload) == ("edge/cmd/go", b"now")
    far.close()


def test_split_shape_runs_bridges_in_the_core(remote: Mosquitto, start: Start) -> None:
    """mqtt_processes = 2: the bridge runs once, in the core; publishes come through proxies."""
    gw = start(bridge_toml(remote.port, "sensors/# out 1", "cmd/# in 1"),
               "--set", "mqtt_processes=2")  # fmt: skip
    connected(gw)
    far = FarSide(remote.port, "sensors/#", client_id="far-split")
    want = payloads(500)
    publish_fast(gw.port("mqtt"), "sensors/s", want)
    assert far.wait_for(len(want)) == want
    local = Client(gw.port("mqtt"), "cmd-reader").connect()
    local.subscribe("cmd/#", qos=1)
    Client(remote.port, "centre-app").connect().publish("cmd/x", b"go", qos=1)
    assert local.expect(1)[0].payload == b"go"
    assert gw.log_text().count("bridge centre connected to") == 1  # once, not per proxy
    far.close()


def test_figures_in_metrics_and_status(remote: Mosquitto, start: Start) -> None:
    gw = start(bridge_toml(remote.port, "sensors/# out 1", "cmd/# in 1"))
    connected(gw)
    far = FarSide(remote.port, "sensors/#", client_id="far-metrics")
    publish_local(gw.port("mqtt"), "sensors/m", payloads(7))
    far.wait_for(7)
    Client(remote.port, "centre-app").connect().publish("cmd/a", b"x", qos=1)
    wait_until(lambda: bridge_stats(gw)["messages_in"] == 1, what="one in")
    url = f"http://127.0.0.1:{gw.port('http')}"
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for line in (
        'lightgate_bridge_connected{bridge="centre"} 1.0',
        'lightgate_bridge_lag_messages{bridge="centre"} 0.0',
        'lightgate_bridge_lag_seconds{bridge="centre"} 0.0',
        'lightgate_bridge_messages_total{bridge="centre",direction="out"} 7.0',
        'lightgate_bridge_messages_total{bridge="centre",direction="in"} 1.0',
        'lightgate_bridge_reconnects_total{bridge="centre"} 0.0',
    ):
        assert line in text.splitlines(), line
    out = subprocess.run([sys.executable, "-m", "lightgate", "status", "--url", url],
                         capture_output=True, text=True, timeout=30, cwd=ROOT).stdout  # fmt: skip
    row = next(ln for ln in out.splitlines() if ln.startswith("centre"))
    assert row.split()[:6] == ["centre", "up", "0", "0.0", "7", "1"], out
    remote.stop()
    wait_until(lambda: not bridge_stats(gw)["connected"], what="down")
    out = subprocess.run([sys.executable, "-m", "lightgate", "status", "--url", url],
                         capture_output=True, text=True, timeout=30, cwd=ROOT).stdout  # fmt: skip
    assert "  ! centre: " in out and " down " in out, out
    far.close()


def test_log_on_kafka(tansu: Tansu, remote: Mosquitto, start: Start) -> None:
    """log = "kafka": out from the cluster's records (the remote stopped and started meanwhile),
    and in: appended to the cluster, PUBACKed once the cluster acknowledged. (`tansu` first: it
    is torn down last, after the gateway stopped.)"""
    gw = start(bridge_toml(remote.port, "sensors/# out 1", "cmd/# in 1"), *kafka_args(tansu))
    connected(gw)
    far = FarSide(remote.port, "sensors/#", client_id="far-kafka")
    want = payloads(2000)
    publish_fast(gw.port("mqtt"), "sensors/kf", want[:1000])
    far.wait_for(100)
    remote.stop()
    publish_fast(gw.port("mqtt"), "sensors/kf", want[1000:])
    wait_until(lambda: not bridge_stats(gw)["connected"], what="bridge down")
    time.sleep(1.5)  # the figures age the oldest unacknowledged record, read from the cluster
    b = bridge_stats(gw)
    assert b["lag_messages"] >= 1000 and b["lag_seconds"] >= 1.0, b
    remote.start()
    in_order_once_each(far.wait_for(len(want), timeout=90), want)
    local = Client(gw.port("mqtt"), "cmd-reader").connect()
    local.subscribe("cmd/#", qos=1)
    Client(remote.port, "centre-app").connect().publish("cmd/k", b"go", qos=1)
    assert local.expect(1, timeout=20)[0].payload == b"go"
    far.close()


def test_in_rules_write_as_the_bridge_under_the_acl(
    tmp_path: Path, remote: Mosquitto, start: Start
) -> None:
    """`in` messages are the bridge's (local_username for the ACL): a denied topic is PUBACKed
    to the remote and dropped, logged once; a retained one is retained here too (MQTT 5: the
    subscription asks for retain as published; a 3.1.1 broker clears the flag on live copies)."""
    acl = tmp_path / "acl"
    acl.write_text("topic readwrite #\n\nuser edge-bridge\ntopic write cmd/allowed/#\n")
    toml = f'acl_file = "{acl}"\n' + bridge_toml(
        remote.port, "cmd/# in 1", local_username="edge-bridge", protocol="5.0"
    )
    gw = start(toml)
    connected(gw)
    local = Client(gw.port("mqtt"), "cmd-reader").connect()
    local.subscribe("cmd/#", qos=1)
    pub = Client(remote.port, "centre-app").connect()
    for i in range(3):
        pub.publish("cmd/denied/x", f"no-{i}".encode(), qos=1)
        pub.publish("cmd/allowed/x", f"yes-{i}".encode(), qos=1)
    got = [m.payload for m in local.expect(3)]
    assert got == [b"yes-0", b"yes-1", b"yes-2"]
    local.expect_none(0.5)
    assert gw.log_text().count("the ACL denies writing cmd/denied/x") == 1
    pub.publish("cmd/allowed/cfg", b"v2", qos=1, retain=True)
    wait_until(lambda: bridge_stats(gw)["messages_in"] == 4, what="the retained one in")
    late = Client(gw.port("mqtt"), "late-reader").connect()
    late.subscribe("cmd/allowed/cfg", qos=1)
    (m,) = late.expect(1)
    assert (m.payload, m.retain) == (b"v2", True)
    assert bridge_stats(gw)["connected"]  # the denied ones did not stall the remote's window


def test_v5_properties_go_out_with_the_marker(remote: Mosquitto, start: Start) -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    gw = start(bridge_toml(remote.port, "sensors/# out 1", protocol="5.0"))
    connected(gw)
    far = Client(remote.port, "far-v5", V5).connect()
    far.subscribe("sensors/#", qos=1)
    props = Properties(PacketTypes.PUBLISH)
    props.UserProperty = [("unit", "C")]
    props.ContentType = "text/plain"
    pub = Client(gw.port("mqtt"), "pub-v5", V5).connect()
    pub.publish("sensors/t", b"21.5", qos=1, props=props)
    (m,) = far.expect(1)
    assert m.payload == b"21.5" and m.props.ContentType == "text/plain"
    assert m.user_props == {"unit": "C", "lightgate-bridge": "centre"}


def test_v5_remote_refusing_a_message_does_not_stop_the_bridge(
    tmp_path: Path, start: Start
) -> None:
    """The remote's ACL refuses one topic (v5 PUBACK 0x87): those messages are settled and
    said, the others go on, and the lag comes back to 0 (no endless resending)."""
    acl = tmp_path / "remote-acl"
    acl.write_text("topic readwrite sensors/ok/#\ntopic read #\n")
    m = Mosquitto(tmp_path / "acl-remote", extra=["allow_anonymous true",
                                                  f"acl_file {acl}"]).start()  # fmt: skip
    try:
        gw = start(bridge_toml(m.port, "sensors/# out 1", protocol="5.0"))
        connected(gw)
        far = FarSide(m.port, "sensors/#", client_id="far-acl")
        publish_local(gw.port("mqtt"), "sensors/ok/1", [b"a"])
        publish_local(gw.port("mqtt"), "sensors/no/1", [b"refused-1", b"refused-2"])
        publish_local(gw.port("mqtt"), "sensors/ok/2", [b"b"])
        far.wait_for(2)
        wait_until(lambda: bridge_stats(gw)["lag_messages"] == 0, what="lag 0")
        assert sorted(far.payloads) == [b"a", b"b"]
        # Said once per connection: Debian's Mosquitto 2.0.11 also closes a v5 client after
        # refusing its PUBLISH, so the second refused one comes on a second connection.
        refusals = gw.log_text().count("the remote refused a message (PUBACK reason 0x87)")
        assert 1 <= refusals <= 2
        far.close()
    finally:
        m.stop()
