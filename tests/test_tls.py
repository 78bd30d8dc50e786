"""TLS on every listener (MQTT/TLS, WSS, Kafka/TLS) with real clients and a throwaway CA.

mosquitto_pub/sub (`--cafile`, `--cert`, `--key`), paho (`tls_set`, also over WebSocket), kcat
(`security.protocol=SSL`) and aiokafka (`ssl_context`) against a gateway that requires client
certificates; a client without one is refused (CONNACK 0x05 / 0x87 on MQTT, the handshake on
Kafka). A second gateway takes the certificate's CN as the user name
(`tls_identity_as_username`) with anonymous access off. Bad TLS settings stop `serve` with the
key and the file named.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import ROOT, GatewayProcess
from mqtt_helpers import V5, V311, Client
from tls_helpers import Pki, make_pki

needs_mosquitto = pytest.mark.skipif(
    not (shutil.which("mosquitto_pub") and shutil.which("mosquitto_sub")),
    reason="mosquitto-clients not installed (scripts/system-deps.sh)",
)
needs_kcat = pytest.mark.skipif(not shutil.which("kcat"), reason="kcat not installed")
TLS_PORTS = ["--mqtts-port", "0", "--wss-port", "0", "--kafka-tls-port", "0"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    pki.issue("alice", "alice")
    return pki


def _tls_args(pki: Pki, *settings: str) -> list[str]:
    out = [*TLS_PORTS]
    for kv in (f"tls_cert={pki.server_cert}", f"tls_key={pki.server_key}", f"tls_ca={pki.ca}"):
        out += ["--set", kv]
    for kv in settings:
        out += ["--set", kv]
    return out


@pytest.fixture(scope="module")
def gw(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """Client certificates required."""
    args = _tls_args(pki, "tls_require_client_cert=true")
    g = GatewayProcess(tmp_path_factory.mktemp("req") / "data", args).start()
    yield g
    g.stop()


@pytest.fixture(scope="module")
def idgw(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """The certificate's CN is the user name; no anonymous clients."""
    args = _tls_args(pki, "tls_identity_as_username=true", "allow_anonymous=false")
    g = GatewayProcess(tmp_path_factory.mktemp("ident") / "data", args).start()
    yield g
    g.stop()


def _alice(pki: Pki) -> tuple[str, str]:
    return str(pki.dir / "alice.crt"), str(pki.dir / "alice.key")


def _tls_client(
    pki: Pki, port: int, cid: str, *, cert: bool = True, version: int = V311, ws: bool = False
) -> Client:
    c = Client(port, cid, version=version, transport="websockets" if ws else "tcp")
    certfile, keyfile = _alice(pki) if cert else (None, None)
    c.paho.tls_set(ca_certs=pki.ca, certfile=certfile, keyfile=keyfile)
    return c


def _mosq(tool: str, port: int, pki: Pki, *args: str, cert: bool = True) -> list[str]:
    cmd = [tool, "-h", "127.0.0.1", "-p", str(port), "--cafile", pki.ca]
    if cert:
        certfile, keyfile = _alice(pki)
        cmd += ["--cert", certfile, "--key", keyfile]
    return [*cmd, *args]


def test_ready_line_names_the_tls_listeners(gw: GatewayProcess) -> None:
    for name in ("mqtts", "wss", "kafka_tls", "mqtt", "ws", "kafka"):
        assert name in gw.endpoints, gw.ready_line
    words = gw.ready_line.split()
    assert words.index(f"mqtts=127.0.0.1:{gw.port('mqtts')}") < words.index(
        f"wss=127.0.0.1:{gw.port('wss')}"
    )


def test_no_tls_listeners_without_a_certificate(tmp_path: Path) -> None:
    g = GatewayProcess(tmp_path / "data", TLS_PORTS).start()
    try:
        assert not {"mqtts", "wss", "kafka_tls"} & set(g.endpoints), g.ready_line
    finally:
        g.stop()


@needs_mosquitto
def test_mosquitto_pub_sub_with_client_certificates(gw: GatewayProcess, pki: Pki) -> None:
    port = gw.port("mqtts")
    sub = subprocess.Popen(
        _mosq("mosquitto_sub", port, pki, "-t", "tls/#", "-q", "1", "-C", "1", "-W", "20", "-v"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        got = b""
        while not got and time.monotonic() < deadline:  # until the subscription is in place
            subprocess.run(
                _mosq("mosquitto_pub", port, pki, "-t", "tls/m", "-m", "over tls", "-q", "1"),
                check=True, timeout=20, capture_output=True,
            )  # fmt: skip
            try:
                got, _ = sub.communicate(timeout=1)
            except subprocess.TimeoutExpired:
                continue
        assert got.decode().strip() == "tls/m over tls"
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()


@needs_mosquitto
def test_mosquitto_without_a_required_certificate_is_refused(gw: GatewayProcess, pki: Pki) -> None:
    run = subprocess.run(
        _mosq("mosquitto_pub", gw.port("mqtts"), pki, "-t", "x", "-m", "y", cert=False),
        capture_output=True, timeout=20, text=True,
    )  # fmt: skip
    assert run.returncode != 0
    assert "not authori" in (run.stderr + run.stdout).lower()  # CONNACK 5: not authorised
    # The same client on the plain listener is not concerned (disable it for TLS only).
    plain = ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(gw.port("mqtt")), "-t", "x", "-m", "y"]
    assert subprocess.run(plain, capture_output=True, timeout=20).returncode == 0


@pytest.mark.parametrize("ws", [False, True], ids=["mqtts", "wss"])
def test_paho_over_tls_and_wss(gw: GatewayProcess, pki: Pki, ws: bool) -> None:
    port = gw.port("wss" if ws else "mqtts")
    sub = _tls_client(pki, port, f"sub-{ws}", version=V5, ws=ws).connect()
    sub.subscribe("paho/#", 1)
    pub = _tls_client(pki, port, f"pub-{ws}", ws=ws).connect()
    pub.publish("paho/t", b"secret payload", 1)
    (m,) = sub.expect(1)
    assert (m.topic, m.payload) == ("paho/t", b"secret payload")
    # A plain client sees the same message (one log, whatever the listener).
    plain = Client(gw.port("mqtt"), f"plain-{ws}").connect()
    plain.subscribe("$replay/0/paho/#", 1)
    assert plain.expect(1)[0].payload == b"secret payload"
    for c in (sub, pub, plain):
        c.disconnect()


@pytest.mark.parametrize("ws", [False, True], ids=["mqtts", "wss"])
@pytest.mark.parametrize("version", [V311, V5], ids=["v311", "v5"])
def test_paho_without_a_required_certificate_is_refused(
    gw: GatewayProcess, pki: Pki, ws: bool, version: int
) -> None:
    port = gw.port("wss" if ws else "mqtts")
    c = _tls_client(pki, port, "nocert", cert=False, version=version, ws=ws)
    c.connect(expect_ok=False)
    assert c.connack.is_failure
    assert c.connack.value == 0x87  # paho reports v3's 5 as 0x87 (Not authorized) too
    c.paho.loop_stop()


@needs_kcat
def test_kcat_over_tls(gw: GatewayProcess, pki: Pki) -> None:
    certfile, keyfile = _alice(pki)
    ssl_args = [
        "-X", "security.protocol=SSL", "-X", f"ssl.ca.location={pki.ca}",
        "-X", f"ssl.certificate.location={certfile}", "-X", f"ssl.key.location={keyfile}",
    ]  # fmt: skip
    broker = f"127.0.0.1:{gw.port('kafka_tls')}"
    kcat = ["kcat", "-b", broker, *ssl_args]
    subprocess.run([*kcat, "-P", "-t", "kt"], input=b"from kcat\n", check=True, timeout=30)
    out = subprocess.run(
        [*kcat, "-C", "-t", "kt", "-o", "beginning", "-e", "-q"],
        check=True, timeout=30, capture_output=True,
    )  # fmt: skip
    assert out.stdout.decode().split() == ["from", "kcat"]
    # Metadata advertises the TLS listener to a TLS client, so librdkafka stays on it.
    meta = subprocess.run([*kcat, "-L"], check=True, timeout=30, capture_output=True, text=True)
    assert f"at {broker}" in meta.stdout or f"at localhost:{gw.port('kafka_tls')}" in meta.stdout
    # Without a client certificate the handshake fails: no metadata.
    nocert = [
        "kcat",
        "-b",
        broker,
        "-X",
        "security.protocol=SSL",
        "-X",
        f"ssl.ca.location={pki.ca}",
    ]
    bad = subprocess.run([*nocert, "-L", "-m", "3"], timeout=30, capture_output=True, text=True)
    assert bad.returncode != 0


def test_aiokafka_over_tls(gw: GatewayProcess, pki: Pki) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.load_cert_chain(*_alice(pki))
    boot = f"127.0.0.1:{gw.port('kafka_tls')}"

    async def go() -> list[bytes]:
        producer = AIOKafkaProducer(bootstrap_servers=boot, security_protocol="SSL",
                                    ssl_context=ctx)  # fmt: skip
        await producer.start()
        try:
            md = await producer.send_and_wait("ak", b"aiokafka over tls", partition=0)
        finally:
            await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=boot, security_protocol="SSL",
                                    ssl_context=ctx, enable_auto_commit=False)  # fmt: skip
        await consumer.start()
        try:
            tp = TopicPartition("ak", 0)
            consumer.assign([tp])
            consumer.seek(tp, md.offset)
            batch = await consumer.getmany(tp, timeout_ms=10_000)
            return [r.value for r in batch.get(tp, [])]
        finally:
            await consumer.stop()

    assert asyncio.run(go()) == [b"aiokafka over tls"]


def test_identity_as_username(idgw: GatewayProcess, pki: Pki) -> None:
    # Anonymous access is off: no user name on the plain listener is refused...
    anon = Client(idgw.port("mqtt"), "anon").connect(expect_ok=False)
    assert anon.connack.is_failure
    anon.paho.loop_stop()
    # ...while a certificate is a user (CN alice) with no user name or password sent,
    for ws in (False, True):
        c = _tls_client(pki, idgw.port("wss" if ws else "mqtts"), f"cn-{ws}", ws=ws).connect()
        c.disconnect()
    # and a TLS client without a certificate has no identity: refused 0x87.
    nocert = _tls_client(pki, idgw.port("mqtts"), "nocert", cert=False, version=V5)
    nocert.connect(username="alice", password="x", expect_ok=False)
    assert nocert.connack.value == 0x87
    nocert.paho.loop_stop()
    assert "no client certificate (tls_identity_as_username)" in idgw.log_text()


@needs_mosquitto
def test_identity_as_username_with_mosquitto(idgw: GatewayProcess, pki: Pki) -> None:
    run = subprocess.run(
        _mosq("mosquitto_pub", idgw.port("mqtts"), pki, "-t", "id/x", "-m", "cn"),
        capture_output=True, timeout=20, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


def test_an_untrusted_client_certificate_fails_the_handshake(
    gw: GatewayProcess, pki: Pki, tmp_path: Path
) -> None:
    """A certificate from another CA never reaches CONNECT: the TLS layer refuses it."""
    import socket

    other = make_pki(tmp_path / "other", ca_cn="another CA")
    ctx = ssl.create_default_context(cafile=pki.ca)
    ctx.load_cert_chain(*other.issue("mallory", "mallory"))
    connect = bytes.fromhex("101000044d5154540402003c0004") + b"evil"  # CONNECT v3.1.1, id evil
    raw = socket.create_connection(("127.0.0.1", gw.port("mqtts")), timeout=10)
    with raw, pytest.raises((ssl.SSLError, ConnectionError)):
        tls = ctx.wrap_socket(raw, server_hostname="localhost")
        tls.sendall(connect)  # TLS 1.3: the server's alert comes with the first read
        if tls.recv(10) == b"":
            raise ConnectionError("closed without CONNACK")


def _serve_fails(tmp_path: Path, *args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--mqtt-port", "0", "--ws-port", "0", "--kafka-port", "0", "--http-port", "0", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 2, (run.returncode, run.stdout, run.stderr)
    assert "lightgate ready" not in run.stdout
    return run.stderr


def test_bad_tls_files_are_named(tmp_path: Path, pki: Pki) -> None:
    cert, key = f"tls_cert={pki.server_cert}", f"tls_key={pki.server_key}"
    missing = tmp_path / "nope.pem"
    err = _serve_fails(tmp_path, "--set", cert, "--set", key, "--set", f"tls_ca={missing}")
    assert f"tls_ca: no such file: {missing}" in err
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    err = _serve_fails(tmp_path, "--set", cert, "--set", key, "--set", f"tls_ca={garbage}")
    assert f"tls_ca {garbage}: cannot load" in err
    err = _serve_fails(tmp_path, "--set", cert, "--set", f"tls_key={pki.ca}")  # not its key
    assert f"tls_cert {pki.server_cert} / tls_key {pki.ca}: cannot load" in err
    err = _serve_fails(tmp_path, "--set", cert, "--set", key, "--set", "tls_require_client_cert=1")
    assert "tls_require_client_cert needs tls_ca" in err


def test_tls_listeners_in_the_split_shape(pki: Pki, tmp_path: Path) -> None:
    """`mqtt_processes = 1`: the proxy child opens mqtts and wss with the same settings."""
    args = _tls_args(pki, "tls_require_client_cert=true", "mqtt_processes=1")
    g = GatewayProcess(tmp_path / "data", args).start()
    try:
        assert {"mqtts", "wss", "kafka_tls"} <= set(g.endpoints), g.ready_line
        sub = _tls_client(pki, g.port("wss"), "split-sub", ws=True).connect()
        sub.subscribe("split/#", 1)
        _tls_client(pki, g.port("mqtts"), "split-pub").connect().publish("split/t", b"x", 1)
        assert sub.expect(1)[0].payload == b"x"
        nocert = _tls_client(pki, g.port("mqtts"), "split-nocert", cert=False, version=V5)
        nocert.connect(expect_ok=False)
        assert nocert.connack.value == 0x87
        nocert.paho.loop_stop()
    finally:
        g.stop()
