"""Thin asyncio shell around the sans-IO codec: one `asyncio.Protocol` per Kafka connection.

`data_received` splits the chunk into frames and decodes each; every request starts a task at
once (so a produce's appends happen in arrival order, and a long-polling fetch does not hold up
the produce behind it), and responses are written strictly in request order, as Kafka clients
require. Produce takes a shorter path when no task is waiting to start ahead of it: its appends
run at once in `data_received`, and its response is encoded and written from the callback of the
last durability future it waits on, one loop step after the commit tick's write (a task would
take four: wait callbacks, task wake-up, done callback, flush). So the response goes out before
work that the same write woke, such as a light-queue dispatch round, which yields once first. Memory per connection is bounded: one partial frame of at most `max_frame_bytes`, at
most `max_inflight_requests` requests awaiting their responses, and reading pauses while either
that limit or the transport's write buffer is full.

A frame over the size limit, a truncated or malformed request, or an unknown API key/version
closes that connection (after the responses already owed to it), which is what Kafka does; an
unexpected handler failure closes it too. The server keeps running in every case.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from pathlib import Path
from typing import Any, cast

from store.connlog import ConnLog

from .broker import Broker, ConnInfo
from .config import KafkaConfig
from .handlers_log import StagedProduce, stage_produce
from .protocol import (
    API_NAMES,
    CloseConnection,
    FrameReader,
    RemoteProtocolError,
    Request,
    api_versions_error_frame,
    decode_request,
    encode_response,
)

__all__ = ["KafkaServer"]

log = logging.getLogger("lightgate.kafka")

PRODUCE = 0


class KafkaServer:
    """The Kafka wire listener on a `store.Store`. Event-loop-only."""

    def __init__(
        self,
        store: Any,
        host: str = "127.0.0.1",
        port: int = 9092,
        config: KafkaConfig | None = None,
        state_dir: Path | None = None,
    ) -> None:
        self.store = store
        self.host = host
        self.port = port
        self.config = config or KafkaConfig()
        if state_dir is None:
            state_dir = Path(store.data_dir) / "kafka"
        self.broker = Broker(store, self.config, state_dir)
        # Connected / closed, one line each with the connection id (k1, ...), rate-limited.
        self.conn_log = ConnLog(logging.getLogger("lightgate.kafka.conn"),
                                self.config.conn_log_per_s, prefix="k")  # fmt: skip
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        await self.broker.start()
        try:
            self._server = await loop.create_server(
                lambda: _Connection(self), self.host, self.port, reuse_address=True
            )
        except BaseException:
            await self.broker.close()
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        self.broker.port = self.port
        log.info("kafka listener up", extra={"host": self.host, "port": self.port})

    async def close(self) -> None:
        """Stop accepting, drop connections (pending requests are cancelled), persist state.

        Close this before the store: it snapshots producer state read from the store.
        """
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.abort("server closing")
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        await self.broker.close()

    def stats(self) -> dict[str, int]:
        """Counters and gauges for the gateway's /metrics (names prefixed `kafka_`)."""
        b = self.broker
        out = {f"kafka_{k}_total": v for k, v in b.counters.items()}
        out["kafka_connections"] = len(self._connections)
        out["kafka_groups"] = len(b.groups.groups)
        return out

    def metrics(self) -> dict[str, Any]:
        """Labelled figures and histograms for the gateway's /metrics (lightgate/metrics.py)."""
        b = self.broker
        return {
            "responses": [
                {"api": API_NAMES.get(k, str(k)), "error_code": e, "count": n}
                for (k, e), n in sorted(b.responses.items())
            ],
            "histograms": {"kafka_produce": b.produce_latency.to_dict()},
        }

    async def __aenter__(self) -> KafkaServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class _Connection(asyncio.Protocol):
    __slots__ = ("_server", "_reader", "_transport", "_info", "_pending", "_closing",
                 "_read_paused", "_write_paused", "_flush_scheduled", "_unstarted",
                 "_cid")  # fmt: skip

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
        self._cid = ""

    # --- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, hence no isinstance check
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername") or ("", 0)
        local = transport.get_extra_info("sockname") or ("", 0)
        self._info = ConnInfo(str(peer[0]), str(local[0]), int(local[1]))
        self._server._connections.add(self)
        self._cid = self._server.conn_log.new_id()
        self._server.conn_log.event("connected", self._cid, "from %s:%s", peer[0], peer[1])

    def connection_lost(self, exc: Exception | None) -> None:
        self._server._connections.discard(self)
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
        for frame in frames:
            try:
                request = decode_request(frame)
            except RemoteProtocolError as exc:
                self._protocol_error(exc)
                return
            self._dispatch(request)
        self._update_reading()

    # --- requests and ordered responses ------------------------------------------------------

    def _dispatch(self, request: Request) -> None:
        if request.body is None:  # ApiVersions newer than ours (KIP-511)
            self._pending.append(api_versions_error_frame(request.correlation_id))
            self._flush()
            return
        if request.api_key == PRODUCE and not self._unstarted:
            self._produce(request)
            return
        self._unstarted += 1
        task = asyncio.get_running_loop().create_task(self._run(request))
        self._pending.append(task)
        task.add_done_callback(self._on_done)

    async def _run(self, request: Request) -> bytes | None:
        self._unstarted -= 1  # handlers append before their first await: this step does it
        broker = self._server.broker
        t0 = asyncio.get_running_loop().time()
        response = await broker.handle(request, self._info)
        if request.api_key == PRODUCE:
            broker.produce_latency.observe(asyncio.get_running_loop().time() - t0)
        broker.count_response(request.api_key, response)
        return None if response is None else encode_response(request, response)

    def _produce(self, request: Request) -> None:
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
            staged = stage_produce(broker, request)
        except Exception as exc:
            self._produce_done(slot, request, None, exc, t0)
            return
        waits = [f for f in staged.waits if not f.done()]
        if not waits:
            self._produce_done(slot, request, staged, None, t0)
            return
        remaining = len(waits)

        def one_done(_: asyncio.Future[None]) -> None:
            nonlocal remaining
            remaining -= 1
            if not remaining:
                self._produce_done(slot, request, staged, None, t0)

        for f in waits:
            f.add_done_callback(one_done)

    def _produce_done(
        self,
        slot: asyncio.Future[bytes | None],
        request: Request,
        staged: StagedProduce | None,
        exc: BaseException | None = None,
        t0: float = 0.0,
    ) -> None:
        if slot.done():  # cancelled: the connection is gone
            return
        if exc is None and staged is not None:
            try:
                response = staged.response()
                broker = self._server.broker
                broker.produce_latency.observe(asyncio.get_running_loop().time() - t0)
                broker.count_response(PRODUCE, response)
                slot.set_result(None if response is None else encode_response(request, response))
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
            transport.close()
        else:
            self._update_reading()

    def _update_reading(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing() or self._closing:
            return
        full = self._write_paused or len(self._pending) >= self._server.config.max_inflight_requests
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
