"""MQTT bridges against a real Mosquitto (Debian's) on loopback: forward and receive at QoS 0
and 1, the remote stopped mid-stream, `kill -9` of the gateway mid-stream, TLS with a client
certificate, refused credentials, a Mosquitto bridge section moved over, the docs' edge-to-centre
setup, the split shape, and the figures (/metrics, /api/stats, `lightgate status`)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_process import GatewayProcess
from mosquitto_helpers import MOSQUITTO, FarSide, Mosquitto, in_order_once_each
from mqtt_helpers import V5, Client
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
    for gw in started:
        try:
            gw.stop()
        except Exception:
            gw.kill()


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
