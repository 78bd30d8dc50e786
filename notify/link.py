"""The link between Lightgate processes: framed, symmetric RPC over one stream socket.

The core process (store, light queues, Kafka) serves its store and light-queue methods to MQTT
proxies in other processes or on other hosts (docs/architecture.md, "Processes and cores"). One
connection per proxy carries everything in both directions, so replies keep the order in which
the server produced them: a light-queue read that returns an entry is always answered after the
append that made that entry was acknowledged to the same proxy (the proxy's recent-append cache
relies on it).

Wire format and framing: notify.link_frames (sans-IO); this module is the asyncio half
(`RpcPeer`, `RpcServer`, `connect`).

Method numbers: 1-31 store (bodies in store.wire), 32-63 light queues (lightqueue.wire), 64-95
the wiring (lightgate.link_registry: hello, proxy stats; notify.wire: notify). One registry
(lightgate.link_registry.MethodRegistry) builds every table and refuses a number used twice. A
CALL to an unknown method gets ERROR `NO_SUCH_METHOD`; a frame longer than `max_frame` or of an
unknown kind is a protocol error that closes the link.

This module is the transport only: call ids, heartbeats, and the framing (notify.link_frames)
and handshake (notify.link_auth) run on a socket. It knows no method. It lives in `notify`,
which imports nothing of ours, so both halves above it may import it: the clients in the proxy
(mqtt_proxy.remote_*) and the services in the core (lightgate.link_services). The bodies
(store.wire, lightqueue.wire, notify.wire) are pure and need neither.

Why not the Kafka protocol for this: the proxy also needs light-queue reads, holds, sessions and
retained messages, which Kafka has no APIs for, and per-tick multi-partition appends whose
offsets come back before their fsync; a 11-byte header keeps the hot path cheap.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from notify.link_auth import AuthFailed, LinkAuth
from notify.link_frames import (
    AUTH,
    AUTH_FAILED,
    AUTH_TIMEOUT,
    CALL,
    CLOSED,
    ERROR,
    INTERNAL,
    MAX_FRAME,
    NO_SUCH_METHOD,
    PING,
    PRE_AUTH_MAX_FRAME,
    REPLY,
    SEND,
    FrameDecoder,
    FrameError,
    RpcError,
    encode_frame,
    error_body,
    parse_address,
    parse_error,
    rpc_error_of,
)

log = logging.getLogger("lightgate.rpc")
_asyncio_Future = asyncio.Future

# A method: (peer, body) -> reply bytes, an awaitable of reply bytes, or None (SEND only).
Handler = Callable[["RpcPeer", bytes], "bytes | Awaitable[bytes] | None"]


class RpcPeer(asyncio.Protocol):
    """One end of a link. Event-loop-only.

    `methods` are what the other side may call or send. `call` returns a future of the reply
    body (RpcError on ERROR or when the link is lost first); `send` is one-way. Frames written in
    one loop tick go out in one write. `paused` is True while the transport's write buffer is
    over its high-water mark (callers throttle their own producers on it).
    """

    def __init__(
        self,
        methods: dict[int, Handler],
        *,
        name: str = "peer",
        heartbeat: float = 2.0,
        max_frame: int = MAX_FRAME,
        on_lost: Callable[[RpcPeer, Exception | None], None] | None = None,
        auth: LinkAuth | None = None,
        on_ready: Callable[[RpcPeer], None] | None = None,
    ) -> None:
        """`auth`: this end of the handshake (None: none, both ends must agree); `on_ready`
        runs when it completes, and `ready` is done then (failed if the link ends first)."""
        self.methods = methods
        self.name = name
        # Until a stranger has proved the secret it may not make the core buffer a big frame.
        pre_auth = auth is not None and auth.role == "core"
        self._decoder = FrameDecoder(PRE_AUTH_MAX_FRAME if pre_auth else max_frame)
        self._max_frame = max_frame
        self._heartbeat = heartbeat
        self._on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._next_id = 0
        # call id -> the future of its answer, or (call_then) the callback that takes it
        self._calls: dict[int, Any] = {}
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._last_rx = time.monotonic()
        self.paused = False
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self.state: dict[str, Any] = {}  # what the application keeps per link (holds, proxy id)
        self._auth = auth
        self._on_ready = on_ready
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.remote = ""  # the peer's address, for log lines

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not subclasses
        transport.set_write_buffer_limits(high=4 << 20)  # type: ignore[attr-defined]
        peer = transport.get_extra_info("peername")
        self.remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local socket"
        if self._heartbeat:
            self._timer = self._loop.call_later(self._heartbeat, self._tick)
        if self._auth is None:
            self._authenticated()
            return
        self._loop.call_later(AUTH_TIMEOUT, self._auth_timed_out)
        for step, body in self._auth.start():
            transport.write(encode_frame(AUTH, 0, step, body))  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self._last_rx = time.monotonic()
        try:
            frames = self._decoder.feed(data)
        except FrameError as exc:
            log.warning("rpc link %s: %s; closing", self.name, exc)
            self.abort()
            return
        if self._auth is not None:  # the handshake; the frames after it are served below
            frames = self._handshake(frames)
        for kind, call_id, method, body in frames:
            if kind in (REPLY, ERROR):
                fut = self._calls.pop(call_id, None)
                if fut is None:
                    continue
                if type(fut) is not _asyncio_Future:  # call_then: answered right here, in order
                    if kind == REPLY:
                        fut(body, None)
                    else:
                        fut(b"", parse_error(body))
                elif not fut.done():
                    if kind == REPLY:
                        fut.set_result(body)
                    else:
                        fut.set_exception(parse_error(body))
            elif kind in (CALL, SEND):
                self._dispatch(kind, call_id, method, body)

    # -- the handshake (notify.link_auth) ------------------------------------------------------
    def _handshake(
        self, frames: list[tuple[int, int, int, bytes]]
    ) -> list[tuple[int, int, int, bytes]]:
        """Feed the leading frames to the handshake; the rest once it is done, else []."""
        auth = self._auth
        assert auth is not None
        for i, (kind, call_id, method, body) in enumerate(frames):
            if kind == PING:
                continue
            try:
                if kind == AUTH:
                    replies = auth.receive(method, body)
                elif kind == ERROR and call_id == 0:  # the core refused us and says why
                    self._auth_failed(parse_error(body), refused_by_peer=True)
                    return []
                else:
                    raise AuthFailed("a request before the handshake")
            except AuthFailed as exc:
                self._auth_failed(RpcError(AUTH_FAILED, str(exc)))
                return []
            for step, reply in replies:
                self._write(encode_frame(AUTH, 0, step, reply))
            if auth.done:
                self._auth = None
                self._decoder.max_frame = self._max_frame
                self._authenticated()
                return frames[i + 1 :]
        return []

    def _authenticated(self) -> None:
        if not self.ready.done():
            self.ready.set_result(None)
        if self._on_ready is not None:
            self._on_ready(self)

    def _auth_failed(self, err: RpcError, refused_by_peer: bool = False) -> None:
        """One log line on each end: the core names the proxy's address, the proxy the core's
        answer; the core tells the proxy why before it closes."""
        if self._auth is None or self.transport is None:
            return
        role = self._auth.role
        self._auth = None
        if refused_by_peer:
            log.error("core link to %s refused by the core: %s", self.remote, err)
        elif role == "core":
            log.warning("core link from %s refused: %s", self.remote, err)
            self.transport.write(encode_frame(ERROR, 0, 0, error_body(AUTH_FAILED, str(err))))
        else:
            log.error("core link to %s refused: %s", self.remote, err)
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # retrieved: connect() may not be waiting any more
        self.close()

    def _auth_timed_out(self) -> None:
        if self._auth is not None and self.transport is not None:
            self._auth_failed(RpcError(AUTH_FAILED, f"no handshake within {AUTH_TIMEOUT:g} s"))

    def _dispatch(self, kind: int, call_id: int, method: int, body: bytes) -> None:
        handler = self.methods.get(method)
        if handler is None:
            if kind == CALL:
                self._error(call_id, NO_SUCH_METHOD, f"no method {method}")
            return
        try:
            res = handler(self, body)
        except Exception as exc:
            err = rpc_error_of(exc)
            if err is not None:
                if kind == CALL:
                    self._error(call_id, err.code, str(err))
                else:
                    log.warning("rpc link %s: one-way method %d failed: %s", self.name, method, err)
                return
            log.exception("rpc link %s: method %d failed", self.name, method)
            if kind == CALL:
                self._error(call_id, INTERNAL, f"{type(exc).__name__}: {exc}")
            return
        if kind != CALL:
            return
        if isinstance(res, (bytes, bytearray)):
            self._write(encode_frame(REPLY, call_id, method, bytes(res)))
        elif res is None:
            self._write(encode_frame(REPLY, call_id, method))
        else:
            fut = asyncio.ensure_future(res)
            fut.add_done_callback(lambda f: self._answer(call_id, method, f))

    def _answer(self, call_id: int, method: int, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            self._error(call_id, INTERNAL, "cancelled")
            return
        exc = fut.exception()
        if exc is None:
            self._write(encode_frame(REPLY, call_id, method, bytes(fut.result() or b"")))
        elif (err := rpc_error_of(exc)) is not None:
            self._error(call_id, err.code, str(err))
        else:
            log.error("rpc link %s: method %d failed: %r", self.name, method, exc)
            self._error(call_id, INTERNAL, f"{type(exc).__name__}: {exc}")

    def _error(self, call_id: int, code: int, message: str) -> None:
        self._write(encode_frame(ERROR, call_id, 0, error_body(code, message)))

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        calls, self._calls = self._calls, {}
        for fut in calls.values():
            if type(fut) is not _asyncio_Future:
                fut(b"", RpcError(CLOSED, f"link {self.name} closed"))
            elif not fut.done():
                fut.set_exception(RpcError(CLOSED, f"link {self.name} closed"))
        self._out.clear()
        if not self.ready.done():
            why = (
                f"link {self.name} closed during its handshake (TLS on one end only, or a "
                "certificate the other end refused?)"
            )
            self.ready.set_exception(RpcError(CLOSED, why))
            self.ready.exception()
        if not self.closed.done():
            self.closed.set_result(None)
        if self._on_lost is not None:
            self._on_lost(self, exc)

    # -- calling -------------------------------------------------------------------------------
    def start_call(self, method: int, body: bytes = b"") -> tuple[int, asyncio.Future[bytes]]:
        """Send a CALL; (its call id, the future of its reply body)."""
        fut: asyncio.Future[bytes] = self._loop.create_future()
        if self.is_closing():
            fut.set_exception(RpcError(CLOSED, f"link {self.name} closed"))
            return 0, fut
        self._next_id = call_id = (self._next_id % 0xFFFFFFFF) + 1
        self._calls[call_id] = fut
        self._write(encode_frame(CALL, call_id, method, body))
        return call_id, fut

    def call(self, method: int, body: bytes = b"") -> asyncio.Future[bytes]:
        return self.start_call(method, body)[1]

    def call_then(
        self, method: int, body: bytes, on_reply: Callable[[bytes, RpcError | None], None]
    ) -> None:
        """A CALL whose answer runs `on_reply(body, None)` or `on_reply(b"", error)` as soon as
        its frame is read: no future, no loop hop, so answers are acted on in link order
        before anything read after them (the store's offsets before pushed entries)."""
        if self.is_closing():
            on_reply(b"", RpcError(CLOSED, f"link {self.name} closed"))
            return
        self._next_id = call_id = (self._next_id % 0xFFFFFFFF) + 1
        self._calls[call_id] = on_reply
        self._write(encode_frame(CALL, call_id, method, body))

    def send(self, method: int, body: bytes = b"") -> bool:
        """One-way; False when the link is closed (nothing sent)."""
        if self.is_closing():
            return False
        self._write(encode_frame(SEND, 0, method, body))
        return True

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    # -- writing -------------------------------------------------------------------------------
    def _write(self, frame: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        if not self._flush_scheduled:
            # The first frame of a tick goes out at once (a lone request or push waits for no
            # loop hop); the rest of the tick's frames are joined into one write by _flush.
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
            self.transport.write(frame)
            return
        if len(frame) >= 65536:  # big bodies go out at once, not copied into a join
            if self._out:
                self._flush_now()
            self.transport.write(frame)
            return
        self._out.append(frame)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self._flush_now()

    def _flush_now(self) -> None:
        out = self._out
        if not out or self.transport is None:
            out.clear()
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        if not self.transport.is_closing():
            self.transport.write(data)

    def _tick(self) -> None:
        self._timer = None
        if self.transport is None or self.transport.is_closing():
            return
        silent = time.monotonic() - self._last_rx
        if silent > 3 * self._heartbeat:
            log.warning("rpc link %s silent for %.1f s; closing", self.name, silent)
            self.abort()
            return
        self._write(encode_frame(PING, 0, 0))
        self._timer = self._loop.call_later(self._heartbeat, self._tick)

    def close(self) -> None:
        """Write what is queued, then close."""
        self._flush_now()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()


class RpcServer:
    """Accepts links on a TCP port or a Unix socket; every link is an `RpcPeer` on `methods`.

    Every link starts with the handshake (notify.link_auth) against `secret` (None: the peer
    must have none either); `on_connect` runs once it succeeds, and `on_lost` only for links
    that got that far. `ssl_ctx` puts TCP links under TLS.
    """

    def __init__(
        self,
        methods: dict[int, Handler],
        *,
        on_connect: Callable[[RpcPeer], None] | None = None,
        on_lost: Callable[[RpcPeer, Exception | None], None] | None = None,
        heartbeat: float = 2.0,
        secret: bytes | None = None,
        ssl_ctx: ssl.SSLContext | None = None,
    ) -> None:
        self.methods = methods
        self._on_connect = on_connect
        self._on_lost = on_lost
        self._heartbeat = heartbeat
        self._secret = secret
        self._ssl = ssl_ctx
        self._server: asyncio.AbstractServer | None = None
        self.peers: set[RpcPeer] = set()
        self.address = ""

    def _make(self) -> RpcPeer:
        peer = RpcPeer(
            self.methods,
            name="server",
            heartbeat=self._heartbeat,
            on_lost=self._lost,
            auth=LinkAuth("core", self._secret),
            on_ready=self._ready,
        )
        self.peers.add(peer)
        return peer

    def _ready(self, peer: RpcPeer) -> None:
        peer.state["_joined"] = True
        if self._on_connect is not None:
            self._on_connect(peer)

    def _lost(self, peer: RpcPeer, exc: Exception | None) -> None:
        self.peers.discard(peer)
        if self._on_lost is not None and peer.state.get("_joined"):
            self._on_lost(peer, exc)

    async def start(self, address: str) -> str:
        """Listen on `address` (port 0 picks one); returns the actual address."""
        loop = asyncio.get_running_loop()
        host, port = parse_address(address)
        if host == "unix":
            import os

            path = str(port)
            if os.path.exists(path):
                os.unlink(path)  # a stale socket from a killed process; DATA/LOCK is ours
            self._server = await loop.create_unix_server(self._make, path)
            self.address = f"unix:{path}"
        else:
            self._server = await loop.create_server(
                self._make, host, int(port), reuse_address=True, ssl=self._ssl
            )
            sock = self._server.sockets[0].getsockname()
            self.address = f"{sock[0]}:{sock[1]}"
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for peer in list(self.peers):
            peer.close()
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            except (TimeoutError, Exception):
                pass
            self._server = None


async def connect(
    address: str,
    methods: dict[int, Handler],
    *,
    name: str = "client",
    heartbeat: float = 2.0,
    on_lost: Callable[[RpcPeer, Exception | None], None] | None = None,
    timeout: float = 10.0,
    secret: bytes | None = None,
    ssl_ctx: ssl.SSLContext | None = None,
) -> RpcPeer:
    """Open a link to an `RpcServer` and complete the handshake with `secret`; RpcError
    AUTH_FAILED when either end refuses the other (the message says why). `ssl_ctx`: TLS on
    a TCP link, the server's certificate checked against the host name of `address`."""
    loop = asyncio.get_running_loop()
    host, port = parse_address(address)

    def make() -> RpcPeer:
        return RpcPeer(
            methods, name=name, heartbeat=heartbeat, on_lost=on_lost, auth=LinkAuth("proxy", secret)
        )

    if host == "unix":
        coro = loop.create_unix_connection(make, str(port))
    else:
        coro = loop.create_connection(make, host, int(port), ssl=ssl_ctx)
    _, peer = await asyncio.wait_for(coro, timeout)
    try:
        await asyncio.wait_for(asyncio.shield(peer.ready), timeout)
    except BaseException:
        peer.abort()
        raise
    return peer
