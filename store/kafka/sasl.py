"""SASL for the Kafka listener, sans-IO: PLAIN, SCRAM (RFC 5802/7677) and the connection's gate.

Theory of operation
-------------------
A connection on a listener that requires SASL starts in ``START``. Kafka's broker
(`SaslServerAuthenticator`) allows only ApiVersions and SaslHandshake there; the handshake picks a
mechanism and, by its version, how the tokens travel: v1 in SaslAuthenticate requests, v0 as raw
length-prefixed frames with no Kafka header (kafka-python before 2.1 does this). The mechanism then
runs to completion (PLAIN: one token; SCRAM: two rounds) and the connection is ``AUTHENTICATED``,
with the user name it proved. Anything else before that closes the connection without a response,
as Kafka does; so does a failed authentication, after its SASL_AUTHENTICATION_FAILED answer.

    state          | ApiVersions | SaslHandshake        | SaslAuthenticate | other requests
    ---------------+-------------+----------------------+------------------+----------------------
    START          | START       | AUTHENTICATE / RAW   | close            | close (or anonymous)
    AUTHENTICATE   | close       | close                | step → … / DONE  | close
    RAW            | (every frame is a raw token, not a request)                               |
    AUTHENTICATED  | answer      | ILLEGAL_SASL_STATE   | ILLEGAL_SASL_ST. | answer
    FAILED         | close       | close                | close            | close

When anonymous clients are allowed, a connection whose first request (after ApiVersions) is not a
SaslHandshake goes straight to ``AUTHENTICATED`` with no user, so plain Kafka clients keep working
on a gateway that also has users.

SCRAM-SHA-512 uses what a Mosquitto ``$7$`` password entry holds: the salt, the iteration count and
PBKDF2-HMAC-SHA512(password, salt, iterations), which is exactly SCRAM's SaltedPassword (Hi() is
PBKDF2 with the HMAC's own output length). So no clear password is stored, and the server never
runs PBKDF2 for SCRAM: the client does. An unknown user gets a made-up salt derived from a
per-process secret, and fails at the proof exactly like a wrong password, so the exchange does not
tell whether a user exists (RFC 5802 section 9 suggests this).
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import Final, Protocol

__all__ = [
    "MECHANISMS",
    "OAuthBearerServer",
    "PlainServer",
    "SaslFailure",
    "SaslSession",
    "ScramServer",
    "State",
    "Verdict",
    "parse_plain",
]

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
MECHANISMS: Final = ("PLAIN", "SCRAM-SHA-512")

# (salt, iterations, SaltedPassword) of a user, or None when there is no such user.
ScramLookup = Callable[[str], "tuple[bytes, int, bytes] | None"]
PlainCheck = Callable[[str, str], bool]
# A bearer token and the client id -> (user, the token's own rights or None, its expiry or None);
# raises SaslFailure when the token is refused.
TokenCheck = Callable[[str, str], "tuple[str | None, object, float | None]"]


class SaslFailure(Exception):
    """The client failed to authenticate; the message is safe to send to it."""


class Mechanism(Protocol):
    """One server-side SASL exchange: feed client tokens, get server tokens."""

    @property
    def complete(self) -> bool: ...

    @property
    def user(self) -> str | None: ...

    def step(self, token: bytes) -> bytes: ...


# --- PLAIN (RFC 4616) ---------------------------------------------------------------------------


def parse_plain(message: bytes) -> tuple[str, str, str]:
    """``[authzid] NUL authcid NUL passwd`` → (authzid, user, password). Raises SaslFailure."""
    parts = message.split(b"\0")
    if len(parts) != 3:
        raise SaslFailure("Invalid SASL/PLAIN message: expected authzid NUL user NUL password")
    try:
        authzid, user, password = (p.decode("utf-8") for p in parts)
    except UnicodeDecodeError as exc:
        raise SaslFailure("Invalid SASL/PLAIN message: not UTF-8") from exc
    if not user:
        raise SaslFailure("Authentication failed: username not specified")
    if not password:
        raise SaslFailure("Authentication failed: password not specified")
    return authzid, user, password


class PlainServer:
    """SASL/PLAIN: one token, checked against the password file."""

    __slots__ = ("_check", "complete", "user")

    def __init__(self, check: PlainCheck) -> None:
        self._check = check
        self.complete = False
        self.user: str | None = None

    def step(self, token: bytes) -> bytes:
        if self.complete:
            raise SaslFailure("SASL/PLAIN exchange already complete")
        authzid, user, password = parse_plain(token)
        if authzid and authzid != user:  # as Kafka's PlainSaslServer
            raise SaslFailure("Authentication failed: authorization id differs from username")
        if not self._check(user, password):
            raise SaslFailure("Authentication failed: Invalid username or password")
        self.complete, self.user = True, user
        return b""


# --- SCRAM (RFC 5802, RFC 7677) -----------------------------------------------------------------

_FAKE_KEY: Final = secrets.token_bytes(32)  # salts for unknown users (stable in this process)
FAKE_ITERATIONS: Final = 4096


def _unescape_saslname(name: str) -> str:
    """``=2C`` → ``,`` and ``=3D`` → ``=``; any other ``=`` is an error (RFC 5802 5.1)."""
    out, i = [], 0
    while i < len(name):
        ch = name[i]
        if ch == ",":
            raise SaslFailure("Invalid SCRAM username")
        if ch == "=":
            code = name[i + 1 : i + 3]
            if code == "2C":
                out.append(",")
            elif code == "3D":
                out.append("=")
            else:
                raise SaslFailure("Invalid SCRAM username encoding")
            i += 3
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _attrs(message: str) -> list[tuple[str, str]]:
    """``k=v,k=v`` → pairs; keys are one letter, but Kafka's extensions (``tokenauth=true``)
    after the nonce have longer ones."""
    out = []
    for part in message.split(","):
        key, sep, value = part.partition("=")
        if not key or not sep:
            raise SaslFailure(f"Invalid SCRAM message attribute {part[:16]!r}")
        out.append((key, value))
    return out


class _ScramState(enum.Enum):
    CLIENT_FIRST = "client-first"
    CLIENT_FINAL = "client-final"
    DONE = "done"
    FAILED = "failed"


class ScramServer:
    """The server side of one SCRAM exchange (no channel binding: gs2 flag ``n`` or ``y``).

    ``lookup(user)`` gives (salt, iterations, SaltedPassword) or None. ``nonce`` makes the
    server's part of the nonce (tests pass a fixed one to replay RFC vectors). An unknown user
    is shown ``fake_iterations``: pass the password file's most common count, so the count does
    not tell a missing user from a real one.
    """

    __slots__ = ("_lookup", "_hash", "_nonce", "_state", "_gs2", "_client_first_bare",
                 "_server_first", "_nonce_full", "_creds", "_user", "_known", "_fake_iterations")  # fmt: skip

    def __init__(
        self,
        lookup: ScramLookup,
        hash_name: str = "sha512",
        nonce: Callable[[], str] = lambda: secrets.token_urlsafe(24),
        fake_iterations: int = FAKE_ITERATIONS,
    ) -> None:
        self._lookup = lookup
        self._hash = hash_name
        self._nonce = nonce
        self._state = _ScramState.CLIENT_FIRST
        self._gs2 = self._client_first_bare = self._server_first = self._nonce_full = ""
        self._creds: tuple[bytes, int, bytes] = (b"", 0, b"")
        self._user = ""
        self._known = False
        self._fake_iterations = fake_iterations  # shown for unknown users: the file's usual count

    @property
    def complete(self) -> bool:
        return self._state is _ScramState.DONE

    @property
    def user(self) -> str | None:
        return self._user if self._state is _ScramState.DONE else None

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self._hash).digest()

    def step(self, token: bytes) -> bytes:
        state = self._state
        self._state = _ScramState.FAILED  # until this step succeeds
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SaslFailure("Invalid SCRAM message: not UTF-8") from exc
        if state is _ScramState.CLIENT_FIRST:
            reply = self._client_first(text)
            self._state = _ScramState.CLIENT_FINAL
        elif state is _ScramState.CLIENT_FINAL:
            reply = self._client_final(text)
            self._state = _ScramState.DONE
        else:
            raise SaslFailure(f"Unexpected SCRAM message in state {state.value}")
        return reply.encode("utf-8")

    def _client_first(self, text: str) -> str:
        # gs2-header = gs2-cbind-flag "," [ authzid ] ","
        flag, _, rest = text.partition(",")
        authzid, _, bare = rest.partition(",")
        if flag.startswith("p="):
            raise SaslFailure("SCRAM channel binding is not supported")
        if flag not in ("n", "y") or not bare:
            raise SaslFailure("Invalid SCRAM client-first message")
        attrs = _attrs(bare)
        if len(attrs) < 2 or attrs[0][0] != "n" or attrs[1][0] != "r" or not attrs[1][1]:
            raise SaslFailure("Invalid SCRAM client-first message")
        if any(k == "m" for k, _ in attrs):
            raise SaslFailure("SCRAM mandatory extensions are not supported")
        if any(k == "tokenauth" and v.lower() == "true" for k, v in attrs[2:]):
            raise SaslFailure("Delegation tokens are not supported")
        user = _unescape_saslname(attrs[0][1])
        if not user:
            raise SaslFailure("Authentication failed: username not specified")
        if authzid and (not authzid.startswith("a=") or _unescape_saslname(authzid[2:]) != user):
            raise SaslFailure("Authentication failed: authorization id differs from username")
        creds = self._lookup(user)
        self._known = creds is not None
        if creds is None:  # carry on with made-up credentials; fail at the proof
            mac = hmac.new(_FAKE_KEY, user.encode("utf-8"), "sha256").digest()
            creds = (mac[:16], self._fake_iterations, self._hmac(mac[16:], b"salted"))
        self._creds, self._user = creds, user
        self._gs2 = text[: len(flag) + len(authzid) + 2]
        self._client_first_bare = bare
        self._nonce_full = attrs[1][1] + self._nonce()
        salt, iterations, _ = creds
        self._server_first = (
            f"r={self._nonce_full},s={base64.b64encode(salt).decode()},i={iterations}"
        )
        return self._server_first

    def _client_final(self, text: str) -> str:
        without_proof, sep, proof_b64 = text.rpartition(",p=")
        if not sep:
            raise SaslFailure("Invalid SCRAM client-final message: no proof")
        attrs = _attrs(without_proof)
        if len(attrs) < 2 or attrs[0][0] != "c" or attrs[1][0] != "r":
            raise SaslFailure("Invalid SCRAM client-final message")
        try:
            binding = base64.b64decode(attrs[0][1], validate=True)
            proof = base64.b64decode(proof_b64, validate=True)
        except ValueError as exc:
            raise SaslFailure("Invalid SCRAM client-final message: bad base64") from exc
        if binding != self._gs2.encode("utf-8"):
            raise SaslFailure("Invalid SCRAM channel binding")
        # RFC 5802 wants the nonce echoed exactly; older librdkafka (2.0, in Debian's kcat) sends
        # its own part twice. Kafka accepted that (`endsWith`), and so do we: the proof signs the
        # server-first message with our fresh nonce either way, so nothing can be replayed.
        if not attrs[1][1].endswith(self._nonce_full):
            raise SaslFailure("Invalid SCRAM nonce")
        _, _, salted = self._creds
        client_key = self._hmac(salted, b"Client Key")
        stored_key = hashlib.new(self._hash, client_key).digest()
        auth_message = ",".join((self._client_first_bare, self._server_first, without_proof))
        client_signature = self._hmac(stored_key, auth_message.encode("utf-8"))
        if len(proof) != len(client_signature):
            proof = bytes(len(client_signature))  # still compared below: same time either way
        recovered = bytes(a ^ b for a, b in zip(proof, client_signature, strict=True))
        ok = hmac.compare_digest(hashlib.new(self._hash, recovered).digest(), stored_key)
        if not (ok and self._known):
            raise SaslFailure(
                "Authentication failed during authentication due to invalid credentials "
                "with SASL mechanism SCRAM-SHA-512"
            )
        server_key = self._hmac(salted, b"Server Key")
        server_signature = self._hmac(server_key, auth_message.encode("utf-8"))
        return "v=" + base64.b64encode(server_signature).decode()


# --- OAUTHBEARER (RFC 7628, Kafka's KIP-255) ---------------------------------------------------


class OAuthBearerServer:
    """One message: `gs2-header \x01 auth=Bearer <token> \x01 [key=value \x01]* \x01`.

    Kafka's own broker answers a bad token with a JSON error challenge, takes the client's
    `\x01` and fails then; failing at once with SASL_AUTHENTICATION_FAILED and the reason is
    what both librdkafka and aiokafka report the same way, in one round trip less.
    """

    __slots__ = ("_check", "_client_id", "complete", "user", "acl", "expires_at")

    def __init__(self, check: TokenCheck, client_id: str = "") -> None:
        self._check = check
        self._client_id = client_id
        self.complete = False
        self.user: str | None = None
        self.acl: object = None
        self.expires_at: float | None = None

    def step(self, token: bytes) -> bytes:
        if self.complete:
            raise SaslFailure("OAUTHBEARER takes one message")
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            raise SaslFailure("OAUTHBEARER message is not UTF-8") from None
        gs2, sep, rest = text.partition("\x01")
        if not sep or gs2[:2] not in ("n,", "y,"):
            raise SaslFailure("OAUTHBEARER message without a GS2 header")
        bearer = None
        for pair in rest.split("\x01"):
            name, eq, value = pair.partition("=")
            if eq and name == "auth":
                bearer = value
        if bearer is None or bearer[:7].lower() != "bearer ":
            raise SaslFailure("OAUTHBEARER message without auth=Bearer <token>")
        self.user, self.acl, self.expires_at = self._check(bearer[7:].strip(), self._client_id)
        self.complete = True
        return b""


# --- the connection's gate ----------------------------------------------------------------------


class State(enum.Enum):
    START = "start"
    AUTHENTICATE = "authenticate"  # mechanism chosen, tokens in SaslAuthenticate requests
    RAW = "raw"  # mechanism chosen by SaslHandshake v0: tokens as raw frames
    AUTHENTICATED = "authenticated"
    FAILED = "failed"


class Verdict(enum.Enum):
    ANSWER = "answer"  # handle the request normally
    SASL = "sasl"  # a SaslHandshake / SaslAuthenticate to run through this session
    CLOSE = "close"  # drop the connection without a response


# Errors a SASL response may carry (Kafka's codes).
NONE, UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE, SASL_AUTHENTICATION_FAILED = 0, 33, 34, 58


class SaslSession:
    """One connection's authentication state (see the table in the module docstring).

    ``factories`` maps each enabled mechanism to a constructor of its server; empty means SASL is
    not offered on this listener (every handshake is ILLEGAL_SASL_STATE, as on Kafka's PLAINTEXT
    listeners). With ``allow_anonymous`` a connection may skip SASL and proceed with no user.
    """

    __slots__ = ("_factories", "_anonymous", "state", "user", "_mech", "acl", "expires_at")

    def __init__(
        self, factories: dict[str, Callable[..., Mechanism]], allow_anonymous: bool
    ) -> None:
        self._factories = factories
        self._anonymous = allow_anonymous
        self.state = State.START if factories or not allow_anonymous else State.AUTHENTICATED
        self.user: str | None = None
        self._mech: Mechanism | None = None
        # OAUTHBEARER: the token's own rights (store.auth.ClientAcl) and end, None otherwise.
        self.acl: object = None
        self.expires_at: float | None = None

    def preauthenticate(self, user: str) -> None:
        """The transport proved who this is (a TLS client certificate): no SASL needed."""
        self.state, self.user = State.AUTHENTICATED, user

    @property
    def mechanisms(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def gate(self, api_key: int) -> Verdict:
        """What to do with a request of ``api_key`` arriving now."""
        state = self.state
        if state is State.AUTHENTICATED:
            return (
                Verdict.SASL if api_key in (SASL_HANDSHAKE, SASL_AUTHENTICATE) else Verdict.ANSWER
            )
        if state is State.START:
            if api_key == API_VERSIONS:
                return Verdict.ANSWER
            if api_key == SASL_HANDSHAKE:
                return Verdict.SASL
            if self._anonymous:
                self.state = State.AUTHENTICATED
                return Verdict.ANSWER
            return Verdict.CLOSE
        if state is State.AUTHENTICATE and api_key == SASL_AUTHENTICATE:
            return Verdict.SASL
        self.state = State.FAILED
        return Verdict.CLOSE

    def handshake(self, mechanism: str, version: int, client_id: str = "") -> int:
        """A SaslHandshake: the error code to answer with (and the mechanisms list goes along).

        Any error but ILLEGAL_SASL_STATE-after-success ends the connection after the answer.
        """
        if self.state is State.AUTHENTICATED:
            return ILLEGAL_SASL_STATE
        factory = self._factories.get(mechanism)
        if self.state is not State.START or not self._factories:
            self.state = State.FAILED
            return ILLEGAL_SASL_STATE
        if factory is None:
            self.state = State.FAILED
            return UNSUPPORTED_SASL_MECHANISM
        self._mech = factory(client_id) if mechanism == "OAUTHBEARER" else factory()
        self.state = State.AUTHENTICATE if version >= 1 else State.RAW
        return NONE

    def authenticate(self, token: bytes) -> tuple[int, str | None, bytes]:
        """One client token (SaslAuthenticate or a raw frame): (error, message, server token).

        On success the state moves on when the mechanism completes; on an error the session is
        FAILED and the connection must close after the answer.
        """
        if self.state is State.AUTHENTICATED:
            return ILLEGAL_SASL_STATE, "already authenticated", b""
        mech = self._mech
        if mech is None or self.state not in (State.AUTHENTICATE, State.RAW):
            self.state = State.FAILED
            return ILLEGAL_SASL_STATE, "no SaslHandshake before SaslAuthenticate", b""
        try:
            reply = mech.step(token)
        except SaslFailure as exc:
            self.state = State.FAILED
            return SASL_AUTHENTICATION_FAILED, str(exc), b""
        if mech.complete:
            self.state, self.user, self._mech = State.AUTHENTICATED, mech.user, None
            if isinstance(mech, OAuthBearerServer):
                self.acl, self.expires_at = mech.acl, mech.expires_at
        return NONE, None, reply

    @property
    def closing(self) -> bool:
        return self.state is State.FAILED
