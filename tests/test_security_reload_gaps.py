"""Two rules that must hold at the moment they apply, not only at CONNECT / start:

- a will is published only if its owner may still write its topic then (the ACL reloaded while
  the will waited out its delay);
- SIGHUP loads the TLS certificate again: new handshakes on every TLS listener (MQTT/TLS, WSS,
  Kafka/TLS) present the new one, a bad pair is refused and the old one stays.
"""

from __future__ import annotations

import signal
import socket
import ssl
import time
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import V5, Client, props
from paho.mqtt.packettypes import PacketTypes
from tls_helpers import make_pki

from store.auth import PasswordFile

ACL = """\
user admin
topic readwrite #
user bob
topic readwrite room/bob
"""


def test_will_checked_against_the_acl_when_published(tmp_path: Path) -> None:
    pw = PasswordFile()
    pw.set("admin", "a")
    pw.set("bob", "b")
    pw.save(tmp_path / "passwd")
    (tmp_path / "acl").write_text(ACL)
    args = ["--kafka-port", "-1", "--ws-port", "-1", "--set", f"password_file={tmp_path / 'passwd'}",
            "--set", f"acl_file={tmp_path / 'acl'}"]  # fmt: skip
    g = GatewayProcess(tmp_path / "data", args).start()
    try:
        port = g.port("mqtt")
        watcher = Client(port, "w", V5).connect(username="admin", password="a")
        watcher.subscribe("room/#", 1)
        cp = props(PacketTypes.CONNECT, SessionExpiryInterval=60)
        wp = props(PacketTypes.WILLMESSAGE, WillDelayInterval=2)
        # Allowed at CONNECT and still allowed when due: published.
        a = Client(port, "bob-1", V5).connect(
            username="bob", password="b", props=cp, will=("room/bob", b"first", 1, False),
            will_props=wp,
        )  # fmt: skip
        a.kill()
        assert [m.payload for m in watcher.expect(1, timeout=6)] == [b"first"]
        # Allowed at CONNECT, refused by the rules reloaded while it waited: not published.
        b = Client(port, "bob-2", V5).connect(
            username="bob", password="b", props=cp, will=("room/bob", b"second", 1, False),
            will_props=wp,
        )  # fmt: skip
        b.kill()
        (tmp_path / "acl").write_text(ACL.replace("topic readwrite room/bob", "topic read room/#"))
        g.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        watcher.expect_none(4)
        deadline = time.monotonic() + 10
        while "not published: not authorized" not in g.log_text():
            assert time.monotonic() < deadline, g.log_text()[-2000:]
            time.sleep(0.2)
        watcher.disconnect()
    finally:
        g.stop()


def _served_cert(port: int, ca: str) -> bytes:
    ctx = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return der


@pytest.mark.parametrize("shape", ["serve", "split"])
def test_sighup_reloads_the_tls_certificate(tmp_path: Path, shape: str) -> None:
    pki = make_pki(tmp_path / "pki")
    args = ["--mqtts-port", "0", "--wss-port", "0", "--kafka-tls-port", "0",
            "--set", f"tls_cert={pki.server_cert}", "--set", f"tls_key={pki.server_key}"]  # fmt: skip
    if shape == "split":
        args += ["--set", "mqtt_processes=1"]
    g = GatewayProcess(tmp_path / "data", args).start()
    try:
        listeners = ["mqtts", "wss"] + (["kafka_tls"] if "kafka_tls" in g.endpoints else [])
        before = {name: _served_cert(g.port(name), pki.ca) for name in listeners}
        # A certificate without its key (a half-finished renewal): refused, the old one stays.
        Path(pki.server_key).rename(tmp_path / "old.key")
        Path(pki.server_key).write_text("not a key\n")
        g.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while "TLS reload refused" not in g.log_text():
            assert time.monotonic() < deadline, g.log_text()[-2000:]
            time.sleep(0.2)
        assert all(_served_cert(g.port(n), pki.ca) == before[n] for n in listeners)
        pki.issue("server", "localhost", server=True)  # renewed: a new certificate and key
        g.proc.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        deadline = time.monotonic() + 15
        while True:
            now = {n: _served_cert(g.port(n), pki.ca) for n in listeners}
            if all(now[n] != before[n] for n in listeners):
                break
            assert time.monotonic() < deadline, f"still the old certificate on {now.keys()}"
            time.sleep(0.3)
        # An MQTT client over TLS connects with the new one.
        c = Client(g.port("mqtts"), "after-reload", V5)
        c.paho.tls_set(ca_certs=pki.ca)
        c.connect()
        c.disconnect()
    finally:
        g.stop()
