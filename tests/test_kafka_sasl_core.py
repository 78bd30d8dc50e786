"""The sans-IO SASL core (store/kafka/sasl.py): bytes in, bytes out, no sockets.

SCRAM is checked against the RFC 5802 (SHA-1) and RFC 7677 (SHA-256) exchanges byte for byte (the
RFCs have no SHA-512 vector), and SCRAM-SHA-512 against a client written here from RFC 5802 alone.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

import pytest

from store.auth import PasswordFile
from store.kafka.sasl import (
    ILLEGAL_SASL_STATE,
    SASL_AUTHENTICATION_FAILED,
    UNSUPPORTED_SASL_MECHANISM,
    PlainServer,
    SaslFailure,
    SaslSession,
    ScramServer,
    State,
    Verdict,
    parse_plain,
)


def _creds(hash_name: str, password: str, salt_b64: str, iterations: int):  # type: ignore[no-untyped-def]
    salt = base64.b64decode(salt_b64)
    salted = hashlib.pbkdf2_hmac(hash_name, password.encode(), salt, iterations)
    return lambda user: (salt, iterations, salted) if user == "user" else None


@pytest.mark.parametrize(
    ("hash_name", "salt", "client_nonce", "server_nonce", "proof", "signature"),
    [
        (  # RFC 5802 section 5
            "sha1", "QSXCR+Q6sek8bf92", "fyko+d2lbbFgONRv9qkxdawL", "3rfcNHYJY1ZVvWVs7j",
            "v0X8v3Bz2T0CJGbJQyF0X+HI4Ts=", "rmF9pqV8S7suAoZWja4dJRkFsKQ=",
        ),
        (  # RFC 7677 section 3
            "sha256", "W22ZaJ0SNY7soEsUEjb6gQ==", "rOprNGfwEbeRWgbNEkqO",
            "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0", "dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=",
            "6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=",
        ),
    ],
)  # fmt: skip
def test_scram_rfc_vectors(
    hash_name: str, salt: str, client_nonce: str, server_nonce: str, proof: str, signature: str
) -> None:
    server = ScramServer(_creds(hash_name, "pencil", salt, 4096), hash_name, lambda: server_nonce)
    first = server.step(f"n,,n=user,r={client_nonce}".encode())
    nonce = client_nonce + server_nonce
    assert first == f"r={nonce},s={salt},i=4096".encode()
    assert not server.complete
    final = server.step(f"c=biws,r={nonce},p={proof}".encode())
    assert final == f"v={signature}".encode()
    assert server.complete and server.user == "user"


class ScramClient:
    """RFC 5802 client side, written from the RFC (independent of the server under test)."""

    def __init__(
        self, user: str, password: str, hash_name: str = "sha512", gs2: str = "n,,", ext: str = ""
    ) -> None:
        self.user, self.password, self.h, self.gs2 = user, password, hash_name, gs2
        self.nonce = secrets.token_urlsafe(18)
        self.bare = f"n={user.replace('=', '=3D').replace(',', '=2C')},r={self.nonce}{ext}"

    def first(self) -> bytes:
        return (self.gs2 + self.bare).encode()

    def final(self, server_first: bytes, *, tamper_nonce: bool = False) -> bytes:
        fields = dict(kv.split("=", 1) for kv in server_first.decode().split(","))
        nonce, salt, iterations = fields["r"], base64.b64decode(fields["s"]), int(fields["i"])
        assert nonce.startswith(self.nonce) and len(nonce) > len(self.nonce)
        if tamper_nonce:
            nonce += "x"
        salted = hashlib.pbkdf2_hmac(self.h, self.password.encode(), salt, iterations)
        client_key = hmac.new(salted, b"Client Key", self.h).digest()
        stored_key = hashlib.new(self.h, client_key).digest()
        without_proof = f"c={base64.b64encode(self.gs2.encode()).decode()},r={nonce}"
        self.auth_message = f"{self.bare},{server_first.decode()},{without_proof}".encode()
        signature = hmac.new(stored_key, self.auth_message, self.h).digest()
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self.server_key = hmac.new(salted, b"Server Key", self.h).digest()
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify(self, server_final: bytes) -> bool:
        expected = hmac.new(self.server_key, self.auth_message, self.h).digest()
        return server_final == b"v=" + base64.b64encode(expected)


@pytest.fixture(scope="module")
def passwords() -> PasswordFile:
    pw = PasswordFile()
    pw.set("alice", "wonderland")
    pw.set("we,ird=name", "p")
    return pw


@pytest.mark.parametrize("user", ["alice", "we,ird=name"])
def test_scram_sha512_with_password_file(passwords: PasswordFile, user: str) -> None:
    password = "wonderland" if user == "alice" else "p"
    client = ScramClient(user, password)
    server = ScramServer(passwords.scram_sha512)
    server_first = server.step(client.first())
    assert b",i=4096" in server_first  # the $7$ entry's own salt and count
    server_final = server.step(client.final(server_first))
    assert client.verify(server_final)
    assert server.complete and server.user == user


@pytest.mark.parametrize(
    ("user", "password"), [("alice", "wrong"), ("nobody", "wonderland"), ("alice", "")]
)
def test_scram_bad_credentials_fail_at_the_proof(
    passwords: PasswordFile, user: str, password: str
) -> None:
    """A wrong password and an unknown user look the same until the proof is refused."""
    client = ScramClient(user, password)
    server = ScramServer(passwords.scram_sha512)
    server_first = server.step(client.first())
    assert b",s=" in server_first and b",i=" in server_first
    with pytest.raises(SaslFailure, match="invalid credentials"):
        server.step(client.final(server_first))
    assert not server.complete and server.user is None
    with pytest.raises(SaslFailure):  # a failed exchange stays failed
        server.step(b"c=biws,r=x,p=AAAA")


def test_scram_unknown_user_salt_is_stable(passwords: PasswordFile) -> None:
    """Asking twice about a missing user gives the same salt (no tell-tale randomness)."""
    salts = set()
    for _ in range(2):
        reply = ScramServer(passwords.scram_sha512).step(ScramClient("ghost", "x").first())
        salts.add(dict(kv.split("=", 1) for kv in reply.decode().split(","))["s"])
    assert len(salts) == 1


@pytest.mark.parametrize(
    "message",
    [
        b"p=tls-unique,,n=alice,r=abc",  # channel binding
        b"x,,n=alice,r=abc",
        b"n,,r=abc,n=alice",
        b"n,,n=alice",
        b"n,,n=,r=abc",
        b"n,,n=al=41ce,r=abc",  # bad escape
        b"n,a=bob,n=alice,r=abc",  # authzid of someone else
        b"n,,n=alice,r=abc,tokenauth=true",  # delegation tokens
        b"n,,m=ext,n=alice,r=abc",
        b"\xff\xfe",
    ],
)
def test_scram_client_first_rejected(passwords: PasswordFile, message: bytes) -> None:
    with pytest.raises(SaslFailure):
        ScramServer(passwords.scram_sha512).step(message)


def test_scram_client_final_checks(passwords: PasswordFile) -> None:
    for tamper in ("nonce", "binding", "proof-length"):
        client = ScramClient("alice", "wonderland")
        server = ScramServer(passwords.scram_sha512)
        first = server.step(client.first())
        final = client.final(first, tamper_nonce=tamper == "nonce")
        if tamper == "binding":
            final = final.replace(b"c=biws", b"c=eSws")  # "y,," instead of "n,,"
        if tamper == "proof-length":
            final = final[: final.index(b",p=")] + b",p=AAAA"
        with pytest.raises(SaslFailure):
            server.step(final)


def test_scram_authzid_equal_to_user_and_extensions_accepted(passwords: PasswordFile) -> None:
    client = ScramClient("alice", "wonderland", gs2="n,a=alice,", ext=",tokenauth=false")
    server = ScramServer(passwords.scram_sha512)
    first = server.step(client.first())
    assert client.verify(server.step(client.final(first)))
    assert server.user == "alice"


def test_plain(passwords: PasswordFile) -> None:
    assert parse_plain(b"\0alice\0pw") == ("", "alice", "pw")
    assert parse_plain(b"alice\0alice\0pw") == ("alice", "alice", "pw")
    for bad in (b"alice\0pw", b"\0\0pw", b"\0alice\0", b"\0a\0b\0c", b"\0\xff\0x"):
        with pytest.raises(SaslFailure):
            parse_plain(bad)
    ok = PlainServer(passwords.check)
    assert ok.step(b"\0alice\0wonderland") == b"" and ok.complete and ok.user == "alice"
    for token in (b"\0alice\0nope", b"\0nobody\0wonderland", b"bob\0alice\0wonderland"):
        server = PlainServer(passwords.check)
        with pytest.raises(SaslFailure):
            server.step(token)
        assert not server.complete and server.user is None


def _session(passwords: PasswordFile, anonymous: bool = False) -> SaslSession:
    return SaslSession(
        {"PLAIN": lambda: PlainServer(passwords.check),
         "SCRAM-SHA-512": lambda: ScramServer(passwords.scram_sha512)},
        allow_anonymous=anonymous,
    )  # fmt: skip


API_VERSIONS, HANDSHAKE, AUTHENTICATE, METADATA, PRODUCE = 18, 17, 36, 3, 0


def test_gate_before_and_after_authentication(passwords: PasswordFile) -> None:
    s = _session(passwords)
    assert s.gate(API_VERSIONS) is Verdict.ANSWER
    assert s.gate(HANDSHAKE) is Verdict.SASL
    assert s.handshake("PLAIN", 1) == 0 and s.state is State.AUTHENTICATE
    assert s.gate(AUTHENTICATE) is Verdict.SASL
    assert s.authenticate(b"\0alice\0wonderland") == (0, None, b"")
    assert s.state is State.AUTHENTICATED and s.user == "alice"
    assert s.gate(PRODUCE) is Verdict.ANSWER
    assert s.gate(HANDSHAKE) is Verdict.SASL  # answered ILLEGAL_SASL_STATE, not closed
    assert s.handshake("PLAIN", 1) == ILLEGAL_SASL_STATE and not s.closing


@pytest.mark.parametrize("api_key", [METADATA, PRODUCE, AUTHENTICATE])
def test_gate_closes_on_anything_else_first(passwords: PasswordFile, api_key: int) -> None:
    s = _session(passwords)
    assert s.gate(api_key) is Verdict.CLOSE


def test_gate_closes_on_request_between_handshake_and_authenticate(
    passwords: PasswordFile,
) -> None:
    s = _session(passwords)
    s.handshake("SCRAM-SHA-512", 1)
    assert s.gate(METADATA) is Verdict.CLOSE and s.closing


def test_bad_password_and_bad_mechanism_fail_the_session(passwords: PasswordFile) -> None:
    s = _session(passwords)
    s.handshake("PLAIN", 1)
    error, message, _ = s.authenticate(b"\0alice\0nope")
    assert error == SASL_AUTHENTICATION_FAILED and message and s.closing
    s = _session(passwords)
    assert s.handshake("GSSAPI", 1) == UNSUPPORTED_SASL_MECHANISM and s.closing
    assert s.mechanisms == ("PLAIN", "SCRAM-SHA-512")


def test_handshake_v0_means_raw_tokens(passwords: PasswordFile) -> None:
    s = _session(passwords)
    assert s.handshake("SCRAM-SHA-512", 0) == 0 and s.state is State.RAW
    client = ScramClient("alice", "wonderland")
    error, _, first = s.authenticate(client.first())
    assert error == 0 and s.state is State.RAW
    error, _, final = s.authenticate(client.final(first))
    assert error == 0 and client.verify(final) and s.state is State.AUTHENTICATED


def test_anonymous_allowed_skips_sasl_but_sasl_still_works(passwords: PasswordFile) -> None:
    s = _session(passwords, anonymous=True)
    assert s.gate(API_VERSIONS) is Verdict.ANSWER
    assert s.gate(METADATA) is Verdict.ANSWER and s.state is State.AUTHENTICATED and s.user is None
    s = _session(passwords, anonymous=True)
    assert s.gate(HANDSHAKE) is Verdict.SASL and s.handshake("PLAIN", 1) == 0


def test_no_mechanisms_listener() -> None:
    """No password file, anonymous allowed: every request passes; a handshake is refused."""
    s = SaslSession({}, allow_anonymous=True)
    assert s.state is State.AUTHENTICATED and s.gate(PRODUCE) is Verdict.ANSWER
    assert s.handshake("PLAIN", 1) == ILLEGAL_SASL_STATE
    s = SaslSession({}, allow_anonymous=False)
    assert s.gate(PRODUCE) is Verdict.CLOSE


def test_scram_nonce_with_the_client_part_twice_is_accepted(passwords: PasswordFile) -> None:
    """librdkafka 2.0 (Debian's kcat) echoes its nonce + the whole nonce; Kafka accepted it."""
    client = ScramClient("alice", "wonderland")
    server = ScramServer(passwords.scram_sha512)
    first = server.step(client.first())
    full = dict(kv.split("=", 1) for kv in first.decode().split(","))["r"]
    without_proof = f"c=biws,r={client.nonce}{full}"
    auth = f"{client.bare},{first.decode()},{without_proof}".encode()
    salt, iterations, salted = passwords.scram_sha512("alice") or (b"", 0, b"")
    client_key = hmac.new(salted, b"Client Key", "sha512").digest()
    signature = hmac.new(hashlib.sha512(client_key).digest(), auth, "sha512").digest()
    proof = base64.b64encode(bytes(a ^ b for a, b in zip(client_key, signature, strict=True)))
    server_final = server.step(f"{without_proof},p={proof.decode()}".encode())
    server_key = hmac.new(salted, b"Server Key", "sha512").digest()
    assert server_final == b"v=" + base64.b64encode(hmac.new(server_key, auth, "sha512").digest())
    assert server.user == "alice"


def test_preauthenticated_by_certificate(passwords: PasswordFile) -> None:
    """tls_identity_as_username: the certificate's name is the user, no SASL needed."""
    s = _session(passwords)
    s.preauthenticate("sensor-17")
    assert s.gate(PRODUCE) is Verdict.ANSWER and s.user == "sensor-17"
    assert s.handshake("PLAIN", 1) == ILLEGAL_SASL_STATE


def test_unknown_user_shows_the_files_usual_iteration_count() -> None:
    """A file written by mosquitto_passwd (101 iterations): a missing user must not stand out
    with another count."""
    from store.kafka.handlers_sasl import usual_iterations

    pw = PasswordFile()
    pw.set("a", "x", iterations=101)
    pw.set("b", "y", iterations=101)
    pw.set("c", "z", iterations=4096)
    assert usual_iterations(pw) == 101
    for user in ("a", "ghost"):
        server = ScramServer(pw.scram_sha512, fake_iterations=usual_iterations(pw))
        assert server.step(ScramClient(user, "x").first()).endswith(b",i=101")
