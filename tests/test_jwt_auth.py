"""A JWT as the MQTT password, against a real `lightgate serve`: tokens signed by keys made here
(HS256 from a secret file, RS256 and ES256 from a JWKS file or a JWKS URL served by a local aiohttp
server that rotates its keys), claims mapped to the user and its rights, `exp` / `nbf` / `iss` /
`aud` refused with 0x86 (v5) / 0x04 (3.1.1, which paho reports as 0x86), and a token expiring
while its connection is open closing it (v5: DISCONNECT 0xA0)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from auth_helpers import (
    HS_SECRET,
    WebServer,
    ec_key,
    json_answer,
    jwk_of,
    public_pem,
    rsa_key,
    token,
)
from gateway_process import GatewayProcess
from mqtt_helpers import V5, V311, Client

from store.auth.jwt_auth import JwtAuth, JwtRefused, JwtSettings

RSA, EC = rsa_key(), ec_key()
ACL_CLAIM = {"pub": ["dev/%c/#"], "sub": ["cmd/%u/#"], "all": ["chat/#"]}


def code(rc: Any) -> int:
    return int(getattr(rc, "value", rc))


def start(tmp: Path, *sets: str) -> GatewayProcess:
    args = ["--kafka-port", "-1", "--ws-port", "-1", "--set", "allow_anonymous=false"]
    for s in sets:
        args += ["--set", s]
    return GatewayProcess(tmp / "data", args).start()


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("jwt")
    (tmp / "secret").write_bytes(HS_SECRET + b"\n")
    (tmp / "jwks.json").write_text(json.dumps({"keys": [jwk_of(RSA, "r1"), jwk_of(EC, "e1")]}))
    g = start(
        tmp,
        f"auth_jwt_secret_file={tmp / 'secret'}",
        f"auth_jwt_key_file={tmp / 'jwks.json'}",
        "auth_jwt_issuer=https://idp.test",
        "auth_jwt_audience=lightgate",
    )
    yield g
    g.stop()


def good(key: Any, alg: str, kid: str | None = None, **kw: Any) -> str:
    claims = {"iss": "https://idp.test", "aud": "lightgate", **kw}
    return token(key, alg, kid=kid, **claims)


def connect(port: int, cid: str, version: int, password: str, ok: bool = True) -> Client:
    # 3.1.1 sends a password only with a user name; the token's `sub` is the user, not this.
    return Client(port, cid, version).connect(username="x", password=password, expect_ok=ok)


@pytest.mark.parametrize("version", [V311, V5])
@pytest.mark.parametrize("alg", ["HS256", "RS256", "ES256"])
def test_each_algorithm_connects_and_its_acl_claim_applies(
    gw: GatewayProcess, alg: str, version: int
) -> None:
    key, kid = {"HS256": (HS_SECRET, None), "RS256": (RSA, "r1"), "ES256": (EC, "e1")}[alg]
    cid = f"c-{alg}-{version}"
    c = connect(gw.port("mqtt"), cid, version, good(key, alg, kid, sub="alice", acl=ACL_CLAIM))
    no = 0x87 if version == V5 else 0x80
    got = [code(c.subscribe(f, 1)[0]) for f in ("cmd/alice/#", "cmd/bob/#", "chat/x")]
    assert got == [1, no, 1]
    c.publish(f"dev/{cid}/t", b"mine", 1)
    c.publish(f"dev/x{cid}/t", b"theirs", 1)  # acked and dropped (v5: 0x87)
    c.publish("chat/x", b"chat", 1)
    watcher = connect(gw.port("mqtt"), f"w-{cid}", V5, good(HS_SECRET, "HS256", acl={"sub": ["#"]}))
    watcher.subscribe(f"$replay/-1h/dev/{cid}/#", 1)
    watcher.subscribe(f"$replay/-1h/dev/x{cid}/#", 1)
    seen = [(m.topic, m.payload) for m in watcher.expect(1)]
    assert seen == [(f"dev/{cid}/t", b"mine")]
    watcher.expect_none(0.3)
    for x in (c, watcher):
        x.disconnect()


def test_a_token_without_the_acl_claim_gets_full_rights_without_acl_file(
    gw: GatewayProcess,
) -> None:
    c = connect(gw.port("mqtt"), "noacl", V5, good(HS_SECRET, "HS256", sub="carol"))
    assert [code(r) for r in c.subscribe("anything/#", 1)] == [1]
    c.disconnect()


@pytest.mark.parametrize("version", [V311, V5])
def test_refusals_are_bad_credentials(gw: GatewayProcess, version: int) -> None:
    now = int(time.time())
    other = rsa_key()
    cases = {
        "expired": good(HS_SECRET, "HS256", ttl=-60),
        "not yet valid": good(HS_SECRET, "HS256", nbf=now + 600),
        "wrong issuer": token(HS_SECRET, "HS256", iss="https://evil.test", aud="lightgate"),
        "wrong audience": token(HS_SECRET, "HS256", iss="https://idp.test", aud="other"),
        "no exp": good(HS_SECRET, "HS256", ttl=None),
        "unknown signer": good(other, "RS256", "r1"),
        "unknown kid": good(RSA, "RS256", "r9"),
        "key of another alg": good(EC, "ES256", "r1"),
        "bad acl claim": good(HS_SECRET, "HS256", acl={"pub": "dev/#"}),
    }
    for why, tok in cases.items():
        c = connect(gw.port("mqtt"), f"bad-{version}", version, tok, ok=False)
        assert code(c.connack) == 0x86, (why, c.connack)  # 3.1.1's 0x04 reads as 0x86 in paho
        c.paho.loop_stop()


def test_token_keys_close_auto_anonymous_access_on_loopback(tmp_path: Path) -> None:
    """`allow_anonymous = auto` with a token key set and nothing else: anonymous clients are
    refused (v5 0x87 not authorized), as with a password file, while a token connects."""
    (tmp_path / "secret").write_bytes(HS_SECRET + b"\n")
    args = ["--kafka-port", "-1", "--ws-port", "-1"]
    g = GatewayProcess(
        tmp_path / "data", [*args, "--set", f"auth_jwt_secret_file={tmp_path / 'secret'}"]
    ).start()
    try:
        anon = Client(g.port("mqtt"), "anon", V5).connect(expect_ok=False)
        assert code(anon.connack) == 0x87
        anon.paho.loop_stop()
        ok = Client(g.port("mqtt"), "tok", V5).connect(
            username="x", password=token(HS_SECRET, "HS256", sub="dora")
        )
        ok.disconnect()
    finally:
        g.stop()


@pytest.mark.parametrize("version", [V311, V5])
def test_expiry_closes_the_live_connection(gw: GatewayProcess, version: int) -> None:
    c = connect(gw.port("mqtt"), f"exp-{version}", version, good(HS_SECRET, "HS256", ttl=2.5))
    c.subscribe("chat/#", 0)
    assert c.disconnected.wait(15), "the connection outlived its token"
    if version == V5:
        assert code(c.disconnect_reason) == 0xA0  # Maximum connect time
    c.paho.loop_stop()


def test_jwks_url_rotation_and_unknown_kid_rate_limit(tmp_path: Path) -> None:
    k1, k2 = rsa_key(), ec_key()
    web = WebServer().start()
    web.routes["/jwks"] = json_answer({"keys": [jwk_of(k1, "k1")]})
    g = start(
        tmp_path,
        f"auth_jwt_jwks_url={web.url('/jwks')}",
        "auth_jwt_jwks_min_interval_s=2",
        "auth_jwt_jwks_refresh_s=3600",
    )
    try:
        port = g.port("mqtt")
        connect(port, "r1", V5, token(k1, "RS256", kid="k1")).disconnect()
        assert web.count("/jwks") == 1
        # The provider rotates: k2 replaces k1. A k2 token names an unknown kid: fetched again.
        web.routes["/jwks"] = json_answer({"keys": [jwk_of(k2, "k2")]})
        time.sleep(2.1)
        connect(port, "r2", V5, token(k2, "ES256", kid="k2")).disconnect()
        assert web.count("/jwks") == 2
        # k1 is gone from the set now: its tokens are refused.
        old = connect(port, "r3", V5, token(k1, "RS256", kid="k1"), ok=False)
        assert code(old.connack) == 0x86
        old.paho.loop_stop()
        # Made-up kids cannot make the gateway hammer the provider: one fetch per 2 s at most.
        before, t0 = web.count("/jwks"), time.monotonic()
        for i in range(10):
            c = connect(port, f"junk{i}", V5, token(k2, "ES256", kid=f"junk{i}"), ok=False)
            c.paho.loop_stop()
        elapsed = time.monotonic() - t0
        assert web.count("/jwks") - before <= int(elapsed / 2) + 1
        # The provider down: the keys fetched before stay, k2 still connects.
        web.routes["/jwks"] = json_answer({"error": "down"}, status=503)
        time.sleep(2.1)
        connect(port, "r4", V5, token(k2, "ES256", kid="k2")).disconnect()
    finally:
        g.stop()
        web.stop()


def test_jwks_url_refreshed_on_schedule(tmp_path: Path) -> None:
    """A new key is taken by the scheduled fetch alone (unknown kids fetch nothing here)."""
    k1, k2 = rsa_key(), rsa_key()
    web = WebServer().start()
    web.routes["/jwks"] = json_answer({"keys": [jwk_of(k1, "k1")]})
    g = start(
        tmp_path,
        f"auth_jwt_jwks_url={web.url('/jwks')}",
        "auth_jwt_jwks_refresh_s=1",
        "auth_jwt_jwks_min_interval_s=3600",
    )
    try:
        port = g.port("mqtt")
        connect(port, "s1", V5, token(k1, "RS256", kid="k1")).disconnect()
        web.routes["/jwks"] = json_answer({"keys": [jwk_of(k1, "k1"), jwk_of(k2, "k2")]})
        deadline = time.monotonic() + 15
        while web.count("/jwks") < 3:  # the first token's fetch, then one a second
            assert time.monotonic() < deadline, web.requests
            time.sleep(0.2)
        connect(port, "s3", V5, token(k2, "RS256", kid="k2")).disconnect()
    finally:
        g.stop()
        web.stop()


# -- the verifier alone: key files ----------------------------------------------------------------
def test_pem_key_files_and_reload(tmp_path: Path) -> None:
    pem = tmp_path / "key.pem"
    pem.write_bytes(public_pem(RSA))
    auth = JwtAuth.load(JwtSettings(key_file=str(pem)))
    assert auth.verify(token(RSA, "RS256", sub="u"), "c").user == "u"
    with pytest.raises(JwtRefused):
        auth.verify(token(EC, "ES256"), "c")  # an RSA key never checks an ES256 token
    pem.write_bytes(public_pem(EC))
    auth.reload()
    assert auth.verify(token(EC, "ES256", sub="v"), "c").user == "v"
    with pytest.raises(JwtRefused):
        auth.verify(token(RSA, "RS256"), "c")
    with pytest.raises(JwtRefused):  # alg "none" is never accepted
        auth.verify(token(None, "none"), "c")


def test_acl_claim_substitution_is_the_acl_files(tmp_path: Path) -> None:
    (tmp_path / "s").write_bytes(HS_SECRET)
    auth = JwtAuth.load(JwtSettings(secret_file=str(tmp_path / "s")))
    grant = auth.verify(token(HS_SECRET, "HS256", sub="al", acl=ACL_CLAIM), "d1")
    acl = grant.acl
    assert acl is not None
    assert acl.can_write("dev/d1/x") and not acl.can_write("dev/d2/x")
    assert acl.can_read("cmd/al/1") and not acl.can_write("cmd/al/1")
    # A client id carrying a wildcard does not widen its own rule (as in the ACL file).
    sly = auth.verify(token(HS_SECRET, "HS256", sub="al", acl=ACL_CLAIM), "#").acl
    assert sly is not None and not sly.can_write("dev/x/y")
