"""Keys and tokens the tests make themselves, and a local aiohttp server (a JWKS, an auth hook)
running in its own thread so a `lightgate serve` subprocess and blocking clients can reach it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any

import jwt
from aiohttp import web
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

HS_SECRET = b"a-test-secret-of-at-least-32-bytes!!"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def public_pem(key: Any) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def jwk_of(key: Any, kid: str) -> dict[str, Any]:
    """The public JWK of a private key, with its kid and alg."""
    if isinstance(key, rsa.RSAPrivateKey):
        out = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(key.public_key()))
        out["alg"] = "RS256"
    else:
        out = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(key.public_key()))
        out["alg"] = "ES256"
    out["kid"] = kid
    out["use"] = "sig"
    return dict(out)


def token(
    key: Any,
    alg: str,
    *,
    sub: str | None = "dev1",
    ttl: float | None = 300,
    kid: str | None = None,
    **claims: Any,
) -> str:
    """A signed JWT: `sub`, `exp` = now + ttl (None: no exp) and any other claims."""
    body: dict[str, Any] = dict(claims)
    if sub is not None:
        body["sub"] = sub
    if ttl is not None:
        body["exp"] = int(time.time() + ttl)
    headers = {"kid": kid} if kid is not None else None
    return jwt.encode(body, key, algorithm=alg, headers=headers)


class WebServer:
    """aiohttp on 127.0.0.1, a free port, in a thread of its own; `routes` may change any time."""

    def __init__(self) -> None:
        self.routes: dict[str, Handler] = {}
        self.requests: list[tuple[str, Any]] = []  # (path, JSON body or None) in arrival order
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = None
        self.requests.append((request.path, body))
        handler = self.routes.get(request.path)
        if handler is None:
            return web.Response(status=404)
        return await handler(request)

    def start(self) -> WebServer:
        ready: Future[None] = Future()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()

            async def main() -> None:
                app = web.Application()
                app.router.add_route("*", "/{tail:.*}", self._dispatch)
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                site = web.TCPSite(self._runner, "127.0.0.1", 0)
                await site.start()
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
                ready.set_result(None)

            loop.run_until_complete(main())
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())  # type: ignore[union-attr]
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        ready.result(timeout=30)
        return self

    def stop(self) -> None:
        """Stop serving (again: nothing)."""
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def count(self, path: str) -> int:
        return sum(1 for p, _ in self.requests if p == path)


def json_answer(data: Any, status: int = 200, delay: float = 0.0) -> Handler:
    """A handler answering `data` (a value, or a function of the request's JSON body)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if delay:
            await asyncio.sleep(delay)
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = None
        value = data(body) if callable(data) else data
        if isinstance(value, web.StreamResponse):
            return value
        return web.json_response(value, status=status)

    return handler
