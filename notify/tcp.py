"""Notify over TCP: `TcpNotifyServer` next to the dispatcher, `TcpNotifyClient` in each remote proxy.

Theory of operation
-------------------
The server serves the same `RouteTable` as the in-process notifier: a remote proxy is just a
mailbox whose `on_ready` hook writes one EVENTS frame per loop tick with everything coalesced so
far (nothing is written while the transport is paused: events keep coalescing, one slot per
queue). Both ends send PING every `heartbeat` seconds and drop a connection silent for three.

The client keeps its interest set locally. On every (re)connect it sends HELLO and REGISTER with
the whole set; the server answers a REGISTER with the current last_seq of each queue, so the proxy
catches up on anything announced while it was away. Reconnects back off exponentially with jitter
(`backoff_min` doubling up to `backoff_max`). Between a drop and the re-registration no event
reaches the proxy; that is safe because proxies pull from their stored position and the server's
periodic resync plus the REGISTER answer re-announce every queue.

A new HELLO with a proxy id that is already connected replaces the old connection (a restarted
proxy), whose routes are dropped first. Event-loop-only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from notify.frames import (
    EVENTS,
    HELLO,
    PING,
    PING_FRAME,
    REGISTER,
    UNREGISTER,
    FrameDecoder,
    FrameError,
    encode_events,
    encode_hello,
    encode_queues,
)
from notify.inprocess import InProcessNotifier
from notify.router import Mailbox, QueueEvent

log = logging.getLogger("lightgate.notify")


class _Heartbeat:
    """One lazily rescheduled timer per connection: send PING, drop the peer if silent."""

    __slots__ = ("_transport", "_interval", "_timer", "last_rx")

    def __init__(self, transport: asyncio.Transport, interval: float) -> None:
        self._transport = transport
        self._interval = interval
        self.last_rx = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._schedule()

    def _schedule(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self._interval, self._tick)

    def _tick(self) -> None:
        if time.monotonic() - self.last_rx > 3 * self._interval:
            log.info("notify peer silent for %.1fs, dropping", 3 * self._interval)
            self._transport.abort()
            return
        self._transport.write(PING_FRAME)
        self._schedule()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _ServerConn(asyncio.Protocol):
    def __init__(self, server: TcpNotifyServer) -> None:
        self._server = server
        self._decoder = FrameDecoder()
        self._transport: asyncio.Transport | None = None
        self._hb: _Heartbeat | None = None
        self.proxy_id: str | None = None
        self._box: Mailbox | None = None
        self._paused = False
        self._drain_scheduled = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: asyncio.Transport = transport  # type: ignore[assignment]  # uvloop's: no subclasses
        self._transport = tr
        self._hb = _Heartbeat(tr, self._server.heartbeat)
        self._server._conns.add(self)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None and self._hb is not None
        self._hb.last_rx = time.monotonic()
        try:
            frames = self._decoder.feed(data)
            for ftype, body in frames:
                self._handle(ftype, body)
        except (FrameError, ValueError) as e:
            log.warning("notify protocol error from %s: %s", self.proxy_id, e)
            self._transport.abort()

    def _handle(self, ftype: int, body: Any) -> None:
        routes = self._server.core.routes
        if ftype == PING:
            return
        if ftype == HELLO:
            self._server._hello(self, body)
            return
        if self.proxy_id is None:
            raise FrameError("frame before HELLO")
        if ftype == REGISTER:
            routes.register(self.proxy_id, body, announce=True)
        elif ftype == UNREGISTER:
            routes.unregister(self.proxy_id, body)
        elif ftype == EVENTS:
            self._server.core.publish(body)

    def attach(self, proxy_id: str, box: Mailbox) -> None:
        self.proxy_id = proxy_id
        self._box = box
        box.on_ready = self._ready

    def detach(self) -> None:
        self.proxy_id = None
        if self._box is not None:
            self._box.on_ready = None
            self._box = None

    def _ready(self, box: Mailbox) -> None:
        if not self._drain_scheduled:
            self._drain_scheduled = True
            asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        self._drain_scheduled = False
        box, tr = self._box, self._transport
        if box is None or tr is None or self._paused or tr.is_closing():
            return
        pending = box.take()
        if pending:
            tr.write(encode_events(pending.items()))

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._box is not None and self._box.pending:
            self._ready(self._box)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hb is not None:
            self._hb.cancel()
        self._server._conns.discard(self)
        pid = self.proxy_id
        if pid is not None and self._server._by_id.get(pid) is self:
            del self._server._by_id[pid]
            self.detach()
            self._server.core.routes.drop(pid)


class TcpNotifyServer:
    """Serves `core`'s route table to remote proxies. Publish into `core` (or through a client)."""

    def __init__(
        self,
        core: InProcessNotifier,
        host: str = "127.0.0.1",
        port: int = 0,
        heartbeat: float = 1.0,
    ) -> None:
        self.core = core
        self.host = host
        self._port = port
        self.heartbeat = heartbeat
        self._server: asyncio.Server | None = None
        self._conns: set[_ServerConn] = set()
        self._by_id: dict[str, _ServerConn] = {}

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def connected_proxies(self) -> list[str]:
        return sorted(self._by_id)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConn(self), self.host, self._port, reuse_address=True
        )

    def _hello(self, conn: _ServerConn, proxy_id: str) -> None:
        routes = self.core.routes
        old = self._by_id.get(proxy_id)
        if old is not None and old is not conn:
            old.detach()
            if old._transport is not None:
                old._transport.abort()
        if conn.proxy_id is not None and conn.proxy_id != proxy_id:
            raise FrameError("a connection cannot change its proxy id")
        routes.drop(proxy_id)  # a fresh HELLO re-registers everything it wants
        self._by_id[proxy_id] = conn
        conn.attach(proxy_id, routes.mailbox(proxy_id))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            if c._transport is not None:
                c._transport.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


class _ClientProto(asyncio.Protocol):
    def __init__(self, client: TcpNotifyClient) -> None:
        self._client = client
        self._decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self._hb: _Heartbeat | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tr: asyncio.Transport = transport  # type: ignore[assignment]  # uvloop's: no subclasses
        self.transport = tr
        self._hb = _Heartbeat(tr, self._client.heartbeat)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None and self._hb is not None
        self._hb.last_rx = time.monotonic()
        try:
            for ftype, body in self._decoder.feed(data):
                if ftype == EVENTS:
                    box = self._client._box
                    for q, seq in body:  # type: ignore[attr-defined]
                        box.put(q, seq)
                elif ftype != PING:
                    raise FrameError(f"unexpected frame type {ftype} from server")
        except (FrameError, ValueError) as e:
            log.warning("notify protocol error from server: %s", e)
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._hb is not None:
            self._hb.cancel()
        if not self.lost.done():
            self.lost.set_result(None)


class TcpNotifyClient:
    """A remote proxy's Notifier: interest kept locally and re-registered on every reconnect."""

    def __init__(
        self,
        host: str,
        port: int,
        proxy_id: str,
        heartbeat: float = 1.0,
        backoff_min: float = 0.05,
        backoff_max: float = 2.0,
    ) -> None:
        self.host, self.port, self.proxy_id = host, port, proxy_id
        self.heartbeat = heartbeat
        self._backoff = (backoff_min, backoff_max)
        self._interest: set[str] = set()
        self._box = Mailbox(proxy_id)
        self._proto: _ClientProto | None = None
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        self.connects = 0  # successful connections so far (1 + reconnects)

    def _check(self, proxy_id: str) -> None:
        if proxy_id != self.proxy_id:
            raise ValueError(f"this client serves proxy {self.proxy_id!r}, not {proxy_id!r}")

    def _send(self, data: bytes) -> bool:
        p = self._proto
        if p is None or p.transport is None or p.transport.is_closing():
            return False
        p.transport.write(data)
        return True

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = True) -> None:
        """Add interest; the server always answers a REGISTER with each queue's last_seq."""
        self._check(proxy_id)
        new = [q for q in queues if q not in self._interest]
        self._interest.update(new)
        if new:
            self._send(encode_queues(REGISTER, new))

    def unregister(self, proxy_id: str, queues: Iterable[str]) -> None:
        self._check(proxy_id)
        gone = [q for q in queues if q in self._interest]
        self._interest.difference_update(gone)
        for q in gone:
            self._box.pending.pop(q, None)
        if gone:
            self._send(encode_queues(UNREGISTER, gone))

    def drop(self, proxy_id: str) -> None:
        """Forget every interest (the proxy is closing)."""
        self.unregister(proxy_id, list(self._interest))

    def publish(self, events: Iterable[tuple[str, int]]) -> None:
        """Send events for the server to route (dropped while disconnected: resync covers it)."""
        evs = list(events)
        if evs:
            self._send(encode_events(evs))

    async def events(self, proxy_id: str) -> AsyncIterator[QueueEvent]:
        self._check(proxy_id)
        box = self._box
        while True:
            await box.wait()
            if box.closed and not box.pending:
                return
            for q, seq in box.take().items():
                if q in self._interest:
                    yield QueueEvent(q, seq)

    async def batches(self, proxy_id: str) -> AsyncIterator[dict[str, int]]:
        """Like `events`, one dict queue → last_seq per wake-up (InProcessNotifier's shape)."""
        self._check(proxy_id)
        box = self._box
        interest = self._interest
        while True:
            await box.wait()
            if box.closed and not box.pending:
                return
            got = box.take()
            if any(q not in interest for q in got):
                got = {q: s for q, s in got.items() if q in interest}
            if got:
                yield got

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        delay = self._backoff[0]
        while True:
            try:
                _, proto = await loop.create_connection(
                    lambda: _ClientProto(self), self.host, self.port
                )
            except OSError as e:
                log.debug("notify connect to %s:%d failed: %s", self.host, self.port, e)
            else:
                self._proto = proto
                self.connects += 1
                hello = encode_hello(self.proxy_id)
                assert proto.transport is not None
                proto.transport.write(hello + encode_queues(REGISTER, sorted(self._interest)))
                self.connected.set()
                delay = self._backoff[0]
                await proto.lost
                self.connected.clear()
                self._proto = None
                log.info("notify connection to %s:%d lost; reconnecting", self.host, self.port)
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._backoff[1])

    async def close(self) -> None:
        t, self._task = self._task, None
        if t is not None:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
        p, self._proto = self._proto, None
        if p is not None and p.transport is not None:
            p.transport.close()
        self.connected.clear()
        self._box.close()
