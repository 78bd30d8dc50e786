"""SaslHandshake and SaslAuthenticate: the connection's `sasl.SaslSession` decides, these answer.

They are not in the broker's handler table: authentication is state of one connection, so the
connection (server.py) runs them against its session, in request order like every other request.
A mechanism's step may hash a password (PLAIN: PBKDF2), so it runs in a worker thread while the
connection holds back whatever the client sent after it (see `connection.KafkaConnection`).
"""

from __future__ import annotations

import asyncio
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from .protocol import Request, build, encode_response, response_module
from .sasl import (
    FAKE_ITERATIONS,
    Mechanism,
    OAuthBearerServer,
    PlainServer,
    SaslFailure,
    SaslSession,
    ScramServer,
)

TOKEN_WAIT_S = 30.0  # a token check waits this long at most for a JWKS fetch


class PasswordsView(Protocol):
    """The part of `store.auth.PasswordFile` SASL uses."""

    def check(self, user: str, password: str) -> bool: ...

    def scram_sha512(self, user: str) -> tuple[bytes, int, bytes] | None: ...

    @property
    def users(self) -> list[str]: ...


__all__ = [
    "SecurityView",
    "authenticate_response",
    "handshake_response",
    "new_session",
    "raw_token",
]


class SecurityView(Protocol):
    """What the Kafka listener reads from the gateway's shared `store.auth.Security` holder.

    The holder is referenced, never copied: a reload (SIGHUP) replaces its attributes and later
    handshakes and requests see the new users and rules.
    """

    @property
    def passwords(self) -> PasswordsView | None: ...

    @property
    def acl(self) -> Any: ...  # store.auth.Acl or None (None: everything allowed)

    @property
    def allow_anonymous(self) -> bool: ...

    @property
    def jwt(self) -> Any: ...  # store.auth.jwt_auth.JwtAuth or None


def new_session(security: SecurityView | None) -> SaslSession:
    """The session of a new connection: SASL offered when there is a password file, required
    when anonymous clients are not allowed."""
    if security is None:
        return SaslSession({}, allow_anonymous=True)

    def plain() -> Mechanism:
        pw = security.passwords
        return PlainServer(pw.check if pw is not None else lambda u, p: False)

    def scram() -> Mechanism:
        pw = security.passwords
        if pw is None:
            return ScramServer(lambda u: None)
        return ScramServer(pw.scram_sha512, fake_iterations=usual_iterations(pw))

    factories: dict[str, Callable[..., Mechanism]] = {}
    if security.passwords is not None:
        factories = {"PLAIN": plain, "SCRAM-SHA-512": scram}
    if security.jwt is not None:
        loop = asyncio.get_running_loop()

        def bearer(client_id: str) -> Mechanism:
            return OAuthBearerServer(lambda token, cid: _check_token(security, loop, token, cid),
                                     client_id)  # fmt: skip

        factories["OAUTHBEARER"] = bearer
    return SaslSession(factories, allow_anonymous=security.allow_anonymous)


def _check_token(
    security: SecurityView, loop: asyncio.AbstractEventLoop, token: str, client_id: str
) -> tuple[str | None, object, float | None]:
    """In the SASL worker thread: the token verified on the loop (which may fetch the JWKS)."""
    jwt = security.jwt
    if jwt is None:
        raise SaslFailure("OAUTHBEARER is not enabled")
    future = asyncio.run_coroutine_threadsafe(jwt.verify_async(token, client_id), loop)
    try:
        grant = future.result(TOKEN_WAIT_S)
    except Exception as exc:
        raise SaslFailure(f"token refused: {exc}") from None
    return grant.user, grant.acl, grant.expires_at


_usual: dict[int, tuple[object, int]] = {}  # id(password file) -> (file, its usual count)


def usual_iterations(pw: PasswordsView) -> int:
    """The most common SCRAM iteration count of a password file (computed once per loaded file:
    a reload makes a new object)."""
    hit = _usual.get(id(pw))
    if hit is not None and hit[0] is pw:
        return hit[1]
    counts = Counter(c[1] for u in pw.users if (c := pw.scram_sha512(u)) is not None)
    usual = counts.most_common(1)[0][0] if counts else FAKE_ITERATIONS
    _usual.clear()  # one live file per gateway
    _usual[id(pw)] = (pw, usual)
    return usual


def handshake_response(session: SaslSession, req: Request) -> bytes:
    error = session.handshake(req.body.mechanism, req.api_version, req.client_id or "")
    mod = response_module(17, req.api_version)
    body = build(mod.SaslHandshakeResponse, error_code=error, mechanisms=session.mechanisms)
    return encode_response(req, body)


def authenticate_response(req: Request, result: tuple[int, str | None, bytes]) -> bytes:
    error, message, token = result
    mod = response_module(36, req.api_version)
    body = build(mod.SaslAuthenticateResponse, error_code=error, error_message=message,
                 auth_bytes=token, session_lifetime=0)  # fmt: skip
    return encode_response(req, body)


def raw_token(token: bytes) -> bytes:
    """A server token after SaslHandshake v0: length-prefixed, no Kafka header."""
    return struct.pack(">i", len(token)) + token
