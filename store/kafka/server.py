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

Authentication (`sasl.SaslSession`, one per connection) sits in front of dispatch: until the
connection has authenticated, only ApiVersions and the SASL requests pass, anything else closes
it. A SASL step that checks a password runs in a worker thread (PBKDF2 costs milliseconds); the
frames that arrive meanwhile are held and reading pauses, so nothing overtakes the step. The
gate is transport-agnostic: the same on the plain and the TLS listener.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store.connlog import ConnLog

from .broker import Broker
from .config import KafkaConfig
from .connection import KafkaConnection
from .handlers_sasl import SecurityView
from .protocol import API_NAMES

__all__ = ["KafkaServer"]

if TYPE_CHECKING:
    from store.store import Store

log = logging.getLogger("lightgate.kafka")


class KafkaServer:
    """The Kafka wire listener on a `store.Store`. Event-loop-only."""

    def __init__(
        self,
        store: Store,
        host: str = "127.0.0.1",
        port: int = 9092,
        config: KafkaConfig | None = None,
        state_dir: Path | None = None,
        security: SecurityView | None = None,
    ) -> None:
        """`security`: the gateway's shared users/ACL holder (None: no SASL, all allowed)."""
        self.store = store
        self.host = host
        self.port = port
        self.config = config or KafkaConfig()
        if state_dir is None:
            state_dir = Path(store.data_dir) / "kafka"
        self.broker = Broker(store, self.config, state_dir, security)
        self.tls_port = -1
        self._tls: ssl.SSLContext | None = None
        self._servers: list[asyncio.Server] = []
        # Connected / closed, one line each with the connection id (k1, ...), rate-limited.
        self.conn_log = ConnLog(logging.getLogger("lightgate.kafka.conn"),
                                self.config.conn_log_per_s, prefix="k")  # fmt: skip
        self._connections: set[KafkaConnection] = set()
        # TLS client certificate (as `getpeercert()` gives it) -> user name, or None. Set by
        # the embedder for `tls_identity_as_username`: such a connection starts authenticated.
        self.certificate_user: Callable[[dict[str, Any]], str | None] | None = None

    def add_tls_listener(self, port: int, ssl_ctx: ssl.SSLContext) -> None:
        """Also listen with TLS on `port` (before `start`): the same broker, the same requests.
        Metadata answers each client with the port it came in on (`ConnInfo.local_port`), so a
        TLS client is sent back to the TLS listener, as Kafka does per listener."""
        self.tls_port, self._tls = port, ssl_ctx

    async def start(self) -> None:
        """Listen on `port` (-1: no plaintext listener) and the TLS listener, if any."""
        loop = asyncio.get_running_loop()
        await self.broker.start()
        try:
            for port, ctx in ((self.port, None), (self.tls_port, self._tls)):
                if port == -1:
                    continue
                srv = await loop.create_server(
                    lambda: KafkaConnection(self), self.host, port, ssl=ctx, reuse_address=True
                )
                self._servers.append(srv)
                bound = srv.sockets[0].getsockname()[1]
                if ctx is None:
                    self.port = bound
                else:
                    self.tls_port = bound
                log.info("kafka listener up", extra={"host": self.host, "port": bound,
                                                     "tls": ctx is not None})  # fmt: skip
        except BaseException:
            for srv in self._servers:
                srv.close()
            self._servers.clear()
            await self.broker.close()
            raise
        self.broker.port = self.port if self.port != -1 else self.tls_port

    async def close(self) -> None:
        """Stop accepting, drop connections (pending requests are cancelled), persist state.

        Close this before the store: it snapshots producer state read from the store.
        """
        for srv in self._servers:
            srv.close()
        for conn in list(self._connections):
            conn.abort("server closing")
        for srv in self._servers:
            await srv.wait_closed()
        self._servers.clear()
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
