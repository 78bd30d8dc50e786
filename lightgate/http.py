"""A small HTTP/1.1 listener for `/health` and `/metrics` (Prometheus text format).

It answers GET only, closes after each response, and caps request heads at 8 KiB: it is an operator
endpoint, not a web server, so a dependency on a web framework would buy nothing.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("lightgate.http")

MetricsFn = Callable[[], "dict[str, float | int] | Awaitable[dict[str, float | int]]"]
HealthFn = Callable[[], dict[str, Any]]

_MAX_HEAD = 8192


def render_prometheus(metrics: dict[str, float | int]) -> bytes:
    """Render flat `name{labels}` → value pairs; names without a prefix get `lightgate_`."""
    lines = []
    seen_types: set[str] = set()
    for key in sorted(metrics):
        base = key.split("{", 1)[0]
        name = base if base.startswith("lightgate_") else f"lightgate_{base}"
        full = name + key[len(base) :]
        if name not in seen_types:
            kind = "counter" if name.endswith("_total") else "gauge"
            lines.append(f"# TYPE {name} {kind}")
            seen_types.add(name)
        lines.append(f"{full} {metrics[key]}")
    return ("\n".join(lines) + "\n").encode()


class HttpServer:
    def __init__(self, host: str, port: int, metrics: MetricsFn, health: HealthFn) -> None:
        self._host = host
        self._port = port
        self._metrics = metrics
        self._health = health
        self._server: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            writer.close()
            return
        if len(head) > _MAX_HEAD:
            await self._reply(writer, 431, b"request head too large\n", "text/plain")
            return
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split()
        if len(parts) != 3 or parts[0] not in ("GET", "HEAD"):
            await self._reply(writer, 405, b"only GET\n", "text/plain")
            return
        path = parts[1].split("?", 1)[0]
        try:
            if path == "/metrics":
                metrics = self._metrics()
                if inspect.isawaitable(metrics):
                    metrics = await metrics
                body = render_prometheus(metrics)
                await self._reply(writer, 200, body, "text/plain; version=0.0.4")
            elif path == "/health":
                health = self._health()
                status = 200 if health.get("status") == "ok" else 503
                await self._reply(writer, status, json.dumps(health).encode(), "application/json")
            else:
                await self._reply(writer, 404, b"not found\n", "text/plain")
        except Exception:
            log.exception("http handler failed", extra={"path": path})
            await self._reply(writer, 500, b"internal error\n", "text/plain")

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str) -> None:
        reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 431: "Too Large"}.get(
            status, "Error"
        )
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(head + body)
            await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
