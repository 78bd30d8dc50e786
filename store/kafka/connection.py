"""One Kafka client connection: frames in, requests dispatched, responses out in request order
(the asyncio shell of `KafkaServer`, see server.py for the whole picture). Produce takes the
short path described there; SASL holds later frames while a password check runs in a worker
thread; a frame over the limit, a malformed request or an unknown API version closes the
connection after the responses already owed, and the server keeps running."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, cast

from .broker import ConnInfo
from .handlers_produce import StagedProduce, stage_produce
from .handlers_sasl import authenticate_response, handshake_response, new_session, raw_token
from .protocol import (
    CloseConnection,
    FrameReader,
    RemoteProtocolError,
    Request,
    api_versions_error_frame,
    decode_request,
    encode_response,
)
from .quota import ProduceQuota, with_throttle
from .sasl import SASL_AUTHENTICATE, SASL_HANDSHAKE, SaslSession, State, Verdict

if TYPE_CHECKING:
    from .server import KafkaServer

log = logging.getLogger("lightgate.kafka")

PRODUCE = 0
_SASL_KEYS = (SASL_HANDSHAKE, SASL_AUTHENTICATE)


class KafkaConnection(asyncio.Protocol):
    __slots__ = ("_server", "_reader", "_transport", "_info", "_pending", "_closing",
                 "_read_paused", "_write_paused", "_flush_scheduled", "_unstarted", "_sasl",
                 "_held", "_auth_busy", "_close_delay", "_cid", "_quota", "_muted",
                 "_expiry")  # fmt: skip

    def __init__(self, server: KafkaServer) -> None:
        self._server = server
        self._reader = FrameReader(server.config.max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._info = ConnInfo("", "", 0)
        # Responses in request order: bytes ready to send, or the task (or, for a staged
        # produce, the future) that will produce them; None result = nothing to send.
        self._pending: deque[bytes | asyncio.Future[bytes | None]] = deque()
        self._closing = False
        self._read_paused = False
        self._write_paused = False
        self._flush_scheduled = False
        self._unstarted = 0  # tasks created whose handler has not begun (appends not done)
        self._sasl: SaslSession = new_session(server.broker.security)
        self._held: list[bytes] = []  # frames that came while a SASL step ran in a thread
        self._auth_busy = False
        # Seconds to wait before closing after a failed authentication (-1: close scheduled)
        self._close_delay = 0.0
        self._cid = ""
        rate = server.config.produce_byte_rate  # produce quota (quota.py); None: no limit
        self._quota = ProduceQuota(rate, time.monotonic()) if rate > 0 else None
        self._muted = 0.0  # a throttled Produce: not read until this monotonic time (0: read)
        self._expiry: asyncio.TimerHandle | None = None  # an OAUTHBEARER token's end

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, hence no isinstance check
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername") or ("", 0)
        local = transport.get_extra_info("sockname") or ("", 0)
        self._info = ConnInfo(str(peer[0]), str(local[0]), int(local[1]))
        server = self._server
        limit = server.config.max_connections
        if 0 < limit <= len(server._connections):
            # Kafka has no "server busy" answer: the client sees a closed connection and
            # retries after its reconnect backoff, as with a broker at `max.connections`.
            self._closing = True
            server.broker.counters["connections_refused"] += 1
            server.conn_log.event(
                "refused", "-", "from %s:%s: kafka_max_connections (%d)",
                peer[0], peer[1], limit,
            )  # fmt: skip
            self._transport.close()
            return
        server._connections.add(self)
        identify = self._server.certificate_user
        cert = transport.get_extra_info("peercert") if identify is not None else None
        if identify is not None and cert:
            user = identify(cert)
            if user is not None:
                self._sasl.preauthenticate(user)
                self._info = dataclasses.replace(self._info, user=user)
        self._cid = self._server.conn_log.new_id()
        self._server.conn_log.event("connected", self._cid, "from %s:%s", peer[0], peer[1])

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._cid:
            return  # refused in connection_made (kafka_max_connections)
        self._server._connections.discard(self)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        why = repr(exc) if exc else "closed by the gateway" if self._closing else "closed"
        self._server.conn_log.event("closed", self._cid, "%s", why)
        self._closing = True
        for item in self._pending:
            if isinstance(item, asyncio.Future):
                item.cancel()
        self._pending.clear()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._update_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            frames = self._reader.feed(data)
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        if self._held:  # frames held back by a SASL step go first
            self._held.extend(frames)
        else:
            self._frames(frames)
        self._update_reading()

    def _frames(self, frames: list[bytes]) -> None:
        sasl = self._sasl
        for i, frame in enumerate(frames):
            if self._auth_busy:  # hold the rest until the SASL step is answered
                self._held.extend(frames[i:])
                return
            if sasl.state is State.RAW:  # after SaslHandshake v0 a frame is a bare token
                self._authenticate(frame, None)
                continue
            try:
                request = decode_request(frame)
            except RemoteProtocolError as exc:
                self._protocol_error(exc)
                return
            if sasl.state is not State.AUTHENTICATED or request.api_key in _SASL_KEYS:
                if not self._sasl_request(request):
                    return
                continue
            throttle_ms = 0
            if request.api_key == PRODUCE and self._quota is not None:
                throttle_ms = self._throttle(len(frame))
            self._dispatch(request, throttle_ms)

    def _throttle(self, nbytes: int) -> int:
        """Charge the produce quota; over it, mute this connection for the throttle time."""
        assert self._quota is not None
        now = time.monotonic()
        ms = self._quota.charge(nbytes, now)
        if ms:
            self._server.broker.counters["produce_throttled"] += 1
            if not self._muted:
                asyncio.get_running_loop().call_later(ms / 1000, self._unmute)
            self._muted = max(self._muted, now + ms / 1000)  # the debt of every request read
        return ms

    def _unmute(self) -> None:
        left = self._muted - time.monotonic()
        if left > 0.001:  # requests read meanwhile added to the debt
            asyncio.get_running_loop().call_later(left, self._unmute)
            return
        self._muted = 0.0
        self._update_reading()

    # --- authentication ----------------------------------------------------------------------

    def _sasl_request(self, request: Request) -> bool:
        """Gate a request of a connection not yet authenticated (or a SASL request); False when
        the connection is closing."""
        verdict = self._sasl.gate(request.api_key)
        if verdict is Verdict.CLOSE:
            self._refuse(f"{request.name} before SASL authentication")
            return False
        if verdict is Verdict.ANSWER:
            self._dispatch(request)
            return True
        if request.api_key == SASL_HANDSHAKE:
            self._pending.append(handshake_response(self._sasl, request))
            if self._sasl.closing:
                self._close_delay = self._server.config.failed_authentication_delay_ms / 1000
                self._refuse(f"SASL handshake refused ({request.body.mechanism!r})")
                return False
            self._flush()
            return True
        self._authenticate(request.body.auth_bytes, request)
        return not self._closing

    def _authenticate(self, token: bytes, request: Request | None) -> None:
        """Run one mechanism step in a thread; `request` None: a raw (handshake v0) token."""
        self._auth_busy = True
        self._update_reading()
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._auth_step(token, request))
        self._pending.append(task)
        task.add_done_callback(self._on_done)

    async def _auth_step(self, token: bytes, request: Request | None) -> bytes | None:
        sasl = self._sasl
        before = sasl.state
        try:
            result = await asyncio.get_running_loop().run_in_executor(
                None, sasl.authenticate, token
            )
        finally:
            self._auth_busy = False
        if sasl.state is State.AUTHENTICATED and before is not State.AUTHENTICATED:
            self._info = dataclasses.replace(self._info, user=sasl.user, acl=sasl.acl)
            if sasl.expires_at is not None:  # a token: the connection ends with it
                delay = max(0.0, sasl.expires_at - time.time())
                self._expiry = asyncio.get_running_loop().call_later(delay, self._token_expired)
            log.info("kafka client authenticated",
                     extra={"peer": self._info.peer_host, "user": sasl.user})  # fmt: skip
        elif sasl.closing:
            self._server.broker.counters["auth_failures"] += 1
            log.info("kafka authentication failed",
                     extra={"peer": self._info.peer_host, "reason": result[1]})  # fmt: skip
            self._closing = True  # after this answer (none for a raw token), as Kafka does
            self._close_delay = self._server.config.failed_authentication_delay_ms / 1000
        if request is None:
            out = None if sasl.closing else raw_token(result[2])
        else:
            out = authenticate_response(request, result)
        if not self._closing and self._held:
            asyncio.get_running_loop().call_soon(self._resume_held)
        return out

    def _token_expired(self) -> None:
        """The OAUTHBEARER token expired: close, as Kafka does past `connections.max.reauth.ms`
        for a client that did not re-authenticate; the client reconnects with a fresh token."""
        self._expiry = None
        if self._closing or self._transport is None:
            return
        log.info("kafka token expired, connection closed", extra={"peer": self._info.peer_host})
        self._closing = True
        self._transport.close()

    def _resume_held(self) -> None:
        held, self._held = self._held, []
        if not self._closing:
            self._frames(held)  # may hold some again, behind a new SASL step
            self._update_reading()

    def _refuse(self, reason: str) -> None:
        """Close without answering (after the answers already owed), as Kafka's authenticator."""
        self._server.broker.counters["auth_failures"] += 1
        log.info("kafka connection refused", extra={"peer": self._info.peer_host, "reason": reason})
        self._closing = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()
            self._read_paused = True
        self._flush()

    # --- requests and ordered responses ------------------------------------------------------

    def _dispatch(self, request: Request, throttle_ms: int = 0) -> None:
        if request.body is None:  # ApiVersions newer than ours (KIP-511)
            self._pending.append(api_versions_error_frame(request.correlation_id))
            self._flush()
            return
        if request.api_key == PRODUCE and not self._unstarted:
            self._produce(request, throttle_ms)
            return
        self._unstarted += 1
        task = asyncio.get_running_loop().create_task(self._run(request, throttle_ms))
        self._pending.append(task)
        task.add_done_callback(self._on_done)

    async def _run(self, request: Request, throttle_ms: int = 0) -> bytes | None:
        self._unstarted -= 1  # handlers append before their first await: this step does it
        broker = self._server.broker
        t0 = asyncio.get_running_loop().time()
        response = await broker.handle(request, self._info)
        if request.api_key == PRODUCE:
            broker.produce_latency.observe(asyncio.get_running_loop().time() - t0)
        broker.count_response(request.api_key, response)
        if response is None:
            return None
        return encode_response(request, with_throttle(response, throttle_ms))

    def _produce(self, request: Request, throttle_ms: int = 0) -> None:
        """Produce without a task: append now; respond from the last durability callback.

        Only when no task is waiting to start ahead of it, so appends keep request order.
        """
        broker = self._server.broker
        broker.counters["requests"] += 1
        loop = asyncio.get_running_loop()
        slot: asyncio.Future[bytes | None] = loop.create_future()
        t0 = loop.time()
        self._pending.append(slot)
        try:
            staged = stage_produce(broker, request, self._info)
        except Exception as exc:
            self._produce_done(slot, request, None, exc, t0)
            return
        waits = [f for f in staged.waits if not f.done()]
        if not waits:
            self._produce_done(slot, request, staged, None, t0, throttle_ms)
            return
        remaining = len(waits)

        def one_done(_: asyncio.Future[None]) -> None:
            nonlocal remaining
            remaining -= 1
            if not remaining:
                self._produce_done(slot, request, staged, None, t0, throttle_ms)

        for f in waits:
            f.add_done_callback(one_done)

    def _produce_done(
        self,
        slot: asyncio.Future[bytes | None],
        request: Request,
        staged: StagedProduce | None,
        exc: BaseException | None = None,
        t0: float = 0.0,
        throttle_ms: int = 0,
    ) -> None:
        if slot.done():  # cancelled: the connection is gone
            return
        if exc is None and staged is not None:
            try:
                response = staged.response()
                broker = self._server.broker
                broker.produce_latency.observe(asyncio.get_running_loop().time() - t0)
                broker.count_response(PRODUCE, response)
                if response is not None:
                    response = encode_response(request, with_throttle(response, throttle_ms))
                slot.set_result(response)
            except Exception as e:
                exc = e
        if exc is not None:
            self._log_failure(exc)
            slot.set_exception(exc)
        self._flush()

    @staticmethod
    def _log_failure(exc: BaseException) -> None:
        if isinstance(exc, CloseConnection):
            log.info("kafka connection closed: %s", exc)
        else:
            log.error("kafka handler failed; closing connection", exc_info=exc)

    def _on_done(self, task: asyncio.Task[bytes | None]) -> None:
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            self._log_failure(exc)
        if not self._flush_scheduled:  # coalesce every response done this tick into one write
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        chunks: list[bytes] = []
        while self._pending:
            head = self._pending[0]
            if isinstance(head, bytes):
                chunks.append(head)
            elif not head.done():
                break
            elif head.cancelled() or head.exception() is not None:
                self._closing = True
                for item in self._pending:
                    if isinstance(item, asyncio.Future):
                        item.cancel()
                self._pending.clear()
                break
            else:
                result = head.result()
                if result is not None:  # acks=0 produce: no response
                    chunks.append(result)
            self._pending.popleft()
        if chunks:  # one syscall: join small responses, writelines for big ones (fetch)
            if len(chunks) == 1:
                transport.write(chunks[0])
            elif sum(map(len, chunks)) < 65536:
                transport.write(b"".join(chunks))
            else:
                transport.writelines(chunks)
        if self._closing and not self._pending:
            self._close_transport(transport)
        else:
            self._update_reading()

    def _close_transport(self, transport: asyncio.Transport) -> None:
        """Close now, or after the failed-authentication delay (Kafka's
        `connection.failed.authentication.delay.ms`): a client that retries at once is slowed
        down, and the answer is read before the connection goes (kafka-python reads the close
        first otherwise)."""
        delay = self._close_delay
        if delay > 0:
            self._close_delay = -1
            transport.pause_reading()
            asyncio.get_running_loop().call_later(delay, transport.close)
        elif delay == 0:
            transport.close()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing() or self._closing:
            return
        full = (
            self._write_paused
            or bool(self._muted)
            or self._auth_busy
            or bool(self._held)
            or len(self._pending) >= self._server.config.max_inflight_requests
        )
        if full and not self._read_paused:
            transport.pause_reading()
            self._read_paused = True
        elif not full and self._read_paused:
            transport.resume_reading()
            self._read_paused = False

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        self._server.broker.counters["protocol_errors"] += 1
        log.warning(
            "kafka protocol error; closing connection",
            extra={"peer": self._info.peer_host, "reason": str(exc)},
        )
        self._closing = True
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()
            self._read_paused = True
        self._flush()

    def abort(self, reason: str) -> None:
        log.debug("kafka connection aborted", extra={"reason": reason})
        if self._transport is not None:
            self._transport.abort()
