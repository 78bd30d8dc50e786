"""The core link's `core_secret`: both ends prove it without sending it, and `core_tls`.

The handshake sans-IO (notify.link_auth), then over a real link (notify.link, TCP, with and without
TLS), then in the split shape: a core-only `serve` on a TCP `core_listen` and a `lightgate
proxy` with the wrong secret (refused, one clear line on each end) and the right one (serves
MQTT); `serve` refuses a TCP core link without a secret; `mqtt_processes = 1` hands its secret
to the child outside its command line.
"""

from __future__ import annotations

import logging
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import pytest
from gateway_process import ROOT, GatewayProcess, parse_ready_line
from mqtt_helpers import Client
from tls_helpers import Pki, make_pki

from notify.link import RpcServer, connect
from notify.link_auth import ACCEPT, AuthFailed, LinkAuth
from notify.link_frames import AUTH_FAILED, RpcError

# -- the handshake, sans-IO ----------------------------------------------------------------------


def _run(core: LinkAuth, proxy: LinkAuth) -> list[bytes]:
    """Play the exchange to its end; every body that crossed the wire."""
    wire: list[bytes] = []
    to_core = proxy.start()
    while to_core:
        to_proxy = []
        for step, body in to_core:
            wire.append(body)
            to_proxy += core.receive(step, body)
        to_core = []
        for step, body in to_proxy:
            wire.append(body)
            to_core += proxy.receive(step, body)
    return wire


def test_the_same_secret_on_both_ends_is_never_sent() -> None:
    secret = b"correct horse battery staple"
    core, proxy = LinkAuth("core", secret), LinkAuth("proxy", secret)
    wire = _run(core, proxy)
    assert core.done and proxy.done and len(wire) == 4
    assert not any(secret in body for body in wire)
    # Fresh nonces: a second run crosses none of the first run's bytes.
    assert not set(wire) & set(_run(LinkAuth("core", secret), LinkAuth("proxy", secret)))


def test_no_secret_on_either_end_is_a_plain_link() -> None:
    core, proxy = LinkAuth("core", None), LinkAuth("proxy", None)
    assert _run(core, proxy) == [b"", b""] and core.done and proxy.done


@pytest.mark.parametrize(
    ("core_secret", "proxy_secret", "message"),
    [
        (b"one", b"two", "wrong core_secret"),
        (b"one", None, "this core requires core_secret and the proxy has none"),
        (None, b"two", "the proxy has a core_secret and this core has none"),
    ],
)
def test_a_mismatch_is_refused_by_the_core(
    core_secret: bytes | None, proxy_secret: bytes | None, message: str
) -> None:
    core, proxy = LinkAuth("core", core_secret), LinkAuth("proxy", proxy_secret)
    with pytest.raises(AuthFailed, match=message):
        _run(core, proxy)
    assert not core.done and not proxy.done


def test_the_core_must_prove_it_too() -> None:
    """A fake core that accepts anything cannot forge its proof."""
    proxy = LinkAuth("proxy", b"secret")
    proxy.start()
    proxy.receive(2, b"\x00" * 32)  # CHALLENGE
    with pytest.raises(AuthFailed, match="the core did not prove core_secret"):
        proxy.receive(ACCEPT, b"\x00" * 32)
    with pytest.raises(AuthFailed, match="handshake broken"):
        LinkAuth("core", b"secret").receive(3, b"a proof before any hello")


# -- over a real link ----------------------------------------------------------------------------


async def test_a_wrong_secret_is_refused_on_both_ends(caplog: pytest.LogCaptureFixture) -> None:
    server = RpcServer({1: lambda peer, body: body[::-1]}, secret=b"right")
    addr = await server.start("127.0.0.1:0")
    with caplog.at_level(logging.WARNING, logger="lightgate.rpc"):
        with pytest.raises(RpcError) as e:
            await connect(addr, {}, secret=b"wrong")
        assert e.value.code == AUTH_FAILED and "wrong core_secret" in str(e.value)
        with pytest.raises(RpcError, match="requires core_secret"):
            await connect(addr, {})
    lines = [r.getMessage() for r in caplog.records]
    assert sum("wrong core_secret" in line for line in lines) == 2, lines  # one on each end
    assert any(line.startswith("core link from 127.0.0.1:") for line in lines), lines
    good = await connect(addr, {}, secret=b"right")
    assert await good.call(1, b"abc") == b"cba"
    good.close()
    await server.close()


async def test_a_request_before_the_handshake_closes_the_link() -> None:
    import asyncio

    from notify.link_frames import CALL, encode_frame

    server = RpcServer({1: lambda peer, body: b"served"}, secret=b"s")
    addr = await server.start("127.0.0.1:0")
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(encode_frame(CALL, 1, 1, b""))
    data = await asyncio.wait_for(reader.read(), 5)
    assert b"served" not in data and b"before the handshake" in data
    writer.close()
    await server.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    pki.issue("proxy", "edge-proxy")
    return pki


async def test_the_link_over_tls(pki: Pki) -> None:
    sctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    sctx.load_cert_chain(pki.server_cert, pki.server_key)
    sctx.load_verify_locations(pki.ca)
    sctx.verify_mode = ssl.CERT_REQUIRED
    server = RpcServer({1: lambda peer, body: body[::-1]}, secret=b"s", ssl_ctx=sctx)
    addr = await server.start("127.0.0.1:0")
    cctx = ssl.create_default_context(cafile=pki.ca)
    cctx.load_cert_chain(str(pki.dir / "proxy.crt"), str(pki.dir / "proxy.key"))
    peer = await connect(addr, {}, secret=b"s", ssl_ctx=cctx)
    assert peer.transport is not None and peer.transport.get_extra_info("ssl_object") is not None
    assert await peer.call(1, b"tls") == b"slt"
    peer.close()
    with pytest.raises((ssl.SSLError, OSError, RpcError)):  # no client certificate
        await connect(addr, {}, secret=b"s", ssl_ctx=ssl.create_default_context(cafile=pki.ca))
    await server.close()


# -- the split shape -----------------------------------------------------------------------------


def _proxy(core_port: int, *args: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "lightgate", "proxy", "--core", f"127.0.0.1:{core_port}",
        "--mqtt-port", "0", "--ws-port", "-1", "--mqtts-port", "-1", "--wss-port", "-1", *args,
    ]  # fmt: skip
    env = {**os.environ, "LIGHTGATE_LOG_FORMAT": "text"}
    env.pop("LIGHTGATE_CORE_SECRET", None)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_proxy_with_wrong_and_right_secret_over_tls(tmp_path: Path, pki: Pki) -> None:
    secret, wrong = tmp_path / "core.secret", tmp_path / "wrong.secret"
    secret.write_text("the right one\n")
    wrong.write_text("not the right one\n")
    tls = [f"tls_cert={pki.server_cert}", f"tls_key={pki.server_key}", f"tls_ca={pki.ca}",
           "tls_require_client_cert=true", "core_tls=true"]  # fmt: skip
    args = ["--mqtt-port", "-1", "--ws-port", "-1", "--mqtts-port", "-1", "--wss-port", "-1",
            "--set", "core_listen=127.0.0.1:0", "--core-secret-file", str(secret)]  # fmt: skip
    for kv in tls:
        args += ["--set", kv]
    core = GatewayProcess(tmp_path / "data", args).start()
    proxy_tls: list[str] = []
    for kv in (f"tls_cert={pki.dir}/proxy.crt", f"tls_key={pki.dir}/proxy.key",
               f"tls_ca={pki.ca}", "core_tls=true", "tls_require_client_cert=true"):  # fmt: skip
        proxy_tls += ["--set", kv]
    try:
        bad = _proxy(core.port("core"), "--core-secret-file", str(wrong), *proxy_tls)
        out, err = bad.communicate(timeout=30)
        assert bad.returncode == 1 and b"ready" not in out
        refused = [ln for ln in err.decode().splitlines() if "refused" in ln]
        assert len(refused) == 1 and "wrong core_secret" in refused[0], err.decode()
        core_lines = [ln for ln in core.log_text().splitlines() if "core link from" in ln]
        assert len(core_lines) == 1 and "refused: wrong core_secret" in core_lines[0]
        plain = _proxy(core.port("core"), "--core-secret-file", str(secret))  # no core_tls
        _, err = plain.communicate(timeout=30)
        assert plain.returncode == 1 and b"TLS on one end only" in err, err

        good = _proxy(core.port("core"), "--core-secret-file", str(secret), *proxy_tls)
        try:
            assert good.stdout is not None
            line = good.stdout.readline().decode().strip()
            assert line.startswith("lightgate proxy ready mqtt="), good.stderr
            port = parse_ready_line(line.replace("lightgate proxy ready", "lightgate ready"))
            sub = Client(port["mqtt"][1], "s").connect()
            sub.subscribe("link/#", 1)
            Client(port["mqtt"][1], "p").connect().publish("link/x", "through the link", 1)
            assert sub.expect(1)[0].payload == b"through the link"
        finally:
            good.send_signal(signal.SIGTERM)
            assert good.wait(20) == 0
    finally:
        core.stop()


def test_a_tcp_core_link_without_a_secret_is_refused(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(tmp_path / "d"),
         "--mqtt-port", "-1", "--ws-port", "-1", "--kafka-port", "0", "--http-port", "0",
         "--set", "core_listen=127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if k != "LIGHTGATE_CORE_SECRET"},
    )  # fmt: skip
    assert run.returncode == 2 and "lightgate ready" not in run.stdout
    assert "core_listen 127.0.0.1:0 is a TCP core link: set core_secret" in run.stderr
    proxy = _proxy(1)  # no secret: refused before it tries to connect
    _, err = proxy.communicate(timeout=30)
    assert proxy.returncode == 2 and b"--core 127.0.0.1:1 is a TCP core link" in err


def test_serve_hands_its_secret_to_its_proxy_outside_argv(tmp_path: Path) -> None:
    secret = "s3cret-for-the-child"
    gw = GatewayProcess(
        tmp_path / "data",
        ["--set", "mqtt_processes=1", "--set", "core_listen=127.0.0.1:0"],
        env={"LIGHTGATE_CORE_SECRET": secret},
    ).start()
    try:
        children = Path(f"/proc/{gw.proc.pid}/task/{gw.proc.pid}/children").read_text().split()
        (child,) = children
        assert secret.encode() not in Path(f"/proc/{child}/cmdline").read_bytes()
        c = Client(gw.port("mqtt"), "c").connect()
        c.subscribe("x/#", 1)
        c.publish("x/y", "ok", 1)
        assert c.expect(1)[0].payload == b"ok"
    finally:
        gw.stop()


def test_serve_with_its_own_proxy_over_a_tls_core_link(tmp_path: Path, pki: Pki) -> None:
    """`mqtt_processes = 1` on a TCP `core_tls` link: the child verifies the core's certificate
    and proves the secret; its server certificate (not for client use) is not presented."""
    args = ["--set", "mqtt_processes=1", "--set", "core_listen=127.0.0.1:0",
            "--set", "core_tls=true", "--set", f"tls_cert={pki.server_cert}",
            "--set", f"tls_key={pki.server_key}", "--set", f"tls_ca={pki.ca}"]  # fmt: skip
    gw = GatewayProcess(tmp_path / "data", args, env={"LIGHTGATE_CORE_SECRET": "x"}).start()
    try:
        c = Client(gw.port("mqtt"), "c").connect()
        c.subscribe("tls/#", 1)
        c.publish("tls/y", "ok", 1)
        assert c.expect(1)[0].payload == b"ok"
    finally:
        gw.stop()


async def test_a_stranger_cannot_make_the_core_buffer_a_big_frame() -> None:
    import asyncio

    server = RpcServer({}, secret=b"s")
    addr = await server.start("127.0.0.1:0")
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write((200 << 20).to_bytes(4, "big") + bytes([6, 0, 0, 0, 0, 0, 1]))  # 200 MiB AUTH
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once, nothing buffered
    writer.close()
    await server.close()
