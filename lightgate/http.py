"""The operator's HTTP listener on aiohttp: `/health`, `/metrics`, `/api/stats`, `/` (dashboard),
`/api/bans`.

GET only (aiohttp answers 405 for other methods) except `/api/bans` POST/DELETE, which change
state and so need the admin bearer token (`http_admin_token_file`; without one configured they
are refused 403, with a missing or wrong token 401). Small limits (request line and each header
at most 8 KiB, 32 headers, bodies at most 1 KiB), idle connections closed after 10 s and every
handler bounded by 10 s: an operator endpoint, not a web server. `/metrics` is the Prometheus text exposition of the
gateway's own `CollectorRegistry` (lightgate/metric_families.py), refreshed from one snapshot per scrape.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from lightgate.metric_families import GatewayCollector
from store.bans import KINDS, BanList

log = logging.getLogger("lightgate.http")
# aiohttp logs a traceback for every malformed request (too long, too many headers); those are
# answered 400 and are the client's problem: only critical errors from there.
_aiohttp_log = logging.getLogger("lightgate.http.aiohttp")
_aiohttp_log.setLevel(logging.CRITICAL)

SnapshotFn = Callable[[], Awaitable[dict[str, Any]]]
HealthFn = Callable[[], dict[str, Any]]

MAX_LINE = 8190  # request line and each header field (aiohttp's own bound, kept explicit)
MAX_HEADERS = 32
MAX_BODY = 1024  # GET requests carry none; a ban's JSON is well under it
IDLE_TIMEOUT_S = 10.0
HANDLER_TIMEOUT_S = 10.0
DASHBOARD = Path(__file__).with_name("dashboard.html")
# Snapshot keys for /metrics only: per-process raw figures and component counters (/api/stats
# carries the whole gateway's sums of them).
SCRAPE_ONLY = ("processes", "lightqueue", "kafka", "kafka_log", "cluster_sessions")


class HttpServer:
    """One listener per gateway; `registry` is this gateway's, not prometheus_client's global."""

    def __init__(
        self,
        host: str,
        port: int,
        snapshot: SnapshotFn,
        health: HealthFn,
        *,
        bans: BanList | None = None,
        admin_token: str | None = None,
    ) -> None:
        self._bans = bans if bans is not None else BanList()
        self._admin_token = admin_token
        self._host = host
        self._port = port
        self._snapshot = snapshot
        self._health = health
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = GatewayCollector()
        self.registry.register(self.collector)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._lock = asyncio.Lock()  # scrapes share one collector: one snapshot at a time

    @property
    def port(self) -> int:
        assert self._runner is not None
        for addr in self._runner.addresses:
            return int(addr[1])
        raise RuntimeError("http listener not started")

    async def start(self) -> None:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_errors])
        app.router.add_get("/health", self._on_health)
        app.router.add_get("/metrics", self._on_metrics)
        app.router.add_get("/api/stats", self._on_stats)
        app.router.add_get("/", self._on_dashboard)
        app.router.add_get("/api/bans", self._on_bans)
        app.router.add_post("/api/bans", self._on_ban_add)
        app.router.add_delete("/api/bans", self._on_ban_remove)
        self._runner = web.AppRunner(
            app,
            access_log=None,
            logger=_aiohttp_log,
            keepalive_timeout=IDLE_TIMEOUT_S,
            max_line_size=MAX_LINE,
            max_field_size=MAX_LINE,
            max_headers=MAX_HEADERS,
            lingering_time=1.0,
            handle_signals=False,
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await self._site.start()

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _on_health(self, request: web.Request) -> web.Response:
        health = self._health()
        return web.json_response(health, status=200 if health.get("status") == "ok" else 503)

    async def _on_metrics(self, request: web.Request) -> web.Response:
        async with self._lock:
            self.collector.snap = await asyncio.wait_for(self._snapshot(), HANDLER_TIMEOUT_S)
            body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _on_stats(self, request: web.Request) -> web.Response:
        snap = await asyncio.wait_for(self._snapshot(), HANDLER_TIMEOUT_S)
        snap = {k: v for k, v in snap.items() if k not in SCRAPE_ONLY}
        return web.json_response(snap, headers={"Cache-Control": "no-store"})

    async def _on_dashboard(self, request: web.Request) -> web.Response:
        text = await asyncio.get_running_loop().run_in_executor(None, DASHBOARD.read_bytes)
        return web.Response(body=text, content_type="text/html", charset="utf-8")

    # -- /api/bans -------------------------------------------------------------------------------
    async def _on_bans(self, request: web.Request) -> web.Response:
        bans = [b.to_json() for b in self._bans.in_force()]
        return web.json_response({"bans": bans}, headers={"Cache-Control": "no-store"})

    def _admin(self, request: web.Request) -> None:
        """Refuse a state-changing request without the admin token (compared in constant time)."""
        if self._admin_token is None:
            raise web.HTTPForbidden(
                text="state-changing requests are off: set http_admin_token_file\n"
            )
        got = request.headers.get("Authorization", "")
        scheme, _, token = got.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self._admin_token.encode()
        ):
            log.warning("http %s %s refused: no valid admin token", request.method, request.path,
                        extra={"peer": request.remote})  # fmt: skip
            raise web.HTTPUnauthorized(
                text="admin bearer token required\n", headers={"WWW-Authenticate": "Bearer"}
            )

    async def _on_ban_add(self, request: web.Request) -> web.Response:
        self._admin(request)
        try:
            body = await request.json()
            kind, value = _target(body)
            duration = float(body.get("duration_s", 0))
            ban = self._bans.add(kind, value, duration, str(body.get("reason", "")))
        except (ValueError, TypeError, AttributeError) as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        log.info("ban added over HTTP: %s %r for %s", kind, value,
                 f"{duration:g} s" if duration else "ever", extra={"peer": request.remote})  # fmt: skip
        return web.json_response(ban.to_json(), status=201)

    async def _on_ban_remove(self, request: web.Request) -> web.Response:
        self._admin(request)
        try:
            kind, value = _target(dict(request.query))
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        if not self._bans.remove(kind, value):
            raise web.HTTPNotFound(text=f"no ban on {kind} {value!r}\n")
        log.info("ban removed over HTTP: %s %r", kind, value, extra={"peer": request.remote})
        return web.json_response({"removed": {"kind": kind, "value": value}})


def _target(d: Any) -> tuple[str, str]:
    """(kind, value) of a request naming exactly one of `client_id` and `address`."""
    if not isinstance(d, dict):
        raise ValueError("expected a JSON object")
    named = [(k, str(d[k])) for k in KINDS if d.get(k)]
    if len(named) != 1:
        raise ValueError("name exactly one of client_id and address")
    return named[0]


@web.middleware
async def _errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A failing handler answers 500 and logs once, naming the path."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except web.HTTPException:
        raise
    except Exception:
        log.exception("http handler failed", extra={"path": request.path})
        return web.Response(status=500, text="internal error\n")
