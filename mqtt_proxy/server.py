"""The MQTT server: listeners, the session registry, hooks, inbound batching, stats.

`MqttServer(backend, settings)` is what `lightgate serve` embeds; the caller builds the backend:

    backend = LocalBackend(store, queues, notifier, "mqtt-0", settings.recent_cache_bytes)
    server = MqttServer(backend, settings, security=sec)
    server.authenticate = my_auth            # (client_id, username, password) -> bool
    server.authorize_subscribe = my_acl      # (client_id, filter) -> bool
    server.authorize_publish = my_acl        # (client_id, topic) -> bool
    await server.start()                     # notify consumer, session restore, $SYS timer
    host, port = await server.start_tcp("127.0.0.1", 1883)
    await server.start_ws("127.0.0.1", 8083) ; await server.start_tls(host, 8883, ssl_ctx)
    await server.start_ws(host, 8084, ssl_ctx)   # WSS
    ...
    await server.close()                     # stop accepting, flush, persist sessions

`security` (store.auth.Security: password file, ACL, anonymous policy) is shared with the Kafka
server and reloaded in place on SIGHUP; the hooks above are checked in addition to it.

Per-connection protocol work lives in `connection/`, session state in `sessions/`, the pull
side in `delivery/`; this module owns what crosses connections.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

from mqtt_proxy.access import AclHook, AuthHook, TopicAccess
from mqtt_proxy.connection.badclients import BadClientLog
from mqtt_proxy.connection.connection import MqttConnection
from mqtt_proxy.connection.inbound import Inbound
from mqtt_proxy.connection.keepalive import KeepaliveWheel
from mqtt_proxy.connection.limits import ConnectionRate
from mqtt_proxy.connection.websocket import WebSocketProtocol
from mqtt_proxy.context import ProxyContext
from mqtt_proxy.delivery.delivery import Delivery
from mqtt_proxy.device_events import DeviceEvents
from mqtt_proxy.ports import ClientPort, NodeClaim, QueuesPort
from mqtt_proxy.sessions.manager import SessionManager
from mqtt_proxy.settings import ProxySettings
from mqtt_proxy.sys_topics import SysPublisher
from store.auth import Security
from store.auth.http_hook import HttpAuth
from store.bans import BanList
from store.connlog import ConnLog
from store.latency import LatencyHistogram

log = logging.getLogger("lightgate.mqtt")

VERSION = "lightgate-0.1.0"


# The proxy's monotonic counters (`stats()`), kept twice: users' and internal clients'.
COUNTERS = (
    "connects",
    "connect_refused",
    "disconnects",
    "protocol_errors",
    "takeovers",
    "messages_received",
    "messages_sent",
    "bytes_received",
    "bytes_sent",
    "publish_dropped",
    "subscriptions",
    "wills_published",
    "sessions_expired",
    "write_pauses",
    "publish_rate_pauses",
    "publish_quota_exceeded",
    "publish_rate_disconnects",
    "slow_consumers_closed",
    "tokens_expired",
    "wills_refused",
)


class MqttServer:
    """One MQTT proxy: every listener of this process shares its sessions and delivery."""

    def __init__(
        self,
        backend: QueuesPort,
        settings: ProxySettings | None = None,
        *,
        reuse_port: bool = False,
        security: Security | None = None,
        bans: BanList | None = None,
    ) -> None:
        """Construct inside the running event loop: the server binds to it. `backend`: the
        layers below, built by the caller (`backends.LocalBackend` in one process,
        `backends.RemoteBackend` in a proxy process); `reuse_port`: several proxy processes
        share the listening ports."""
        self.loop = loop = asyncio.get_running_loop()
        self.settings = settings = settings or ProxySettings()
        self.proxy_id = backend.proxy_id
        self.reuse_port = reuse_port
        self.store = backend.store
        self.backend = backend
        # Users and rights (docs/security.md); with none given, anyone may do anything.
        self.security = security if security is not None else Security.open()
        self.security.on_reload(self._security_reloaded)
        # The rights the handlers ask: `security`, the web service deciding topic rights
        # (store.auth.http_hook) and the embedder's hooks (the properties below).
        self.access = TopicAccess(self.security, loop)
        # Banned client ids and addresses (store/bans.py): the core's list in one process, a
        # mirror the core keeps current when this proxy has its own process.
        self.bans = bans if bans is not None else BanList()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        # The same counters for internal clients (the gateway's latency probes): a connection
        # counts into one or the other (MqttConnection.counters), users' figures never see them.
        self.internal_counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.internal_ids: set[str] = set()  # client ids of connected internal clients
        self.refused: dict[str, int] = {}  # refused CONNECTs by cause (connect_handler)
        self.started_at = time.time()
        # Latency histograms (store/latency.py), read at scrape time: receive → PUBACK/PUBREC
        # sent (per fsync batch), and broker receive → PUBLISH written (per pump, ms resolution).
        self.puback_latency = LatencyHistogram()
        self.conns: dict[str, ClientPort] = {}  # client id -> live connection
        self.keepalive = KeepaliveWheel(loop)  # every connection's keep-alive deadline
        self.delivery = Delivery(backend, settings, self.counters, backend.set_interest)
        backend.entries_sink = self.delivery.on_entries
        backend.round_sink = self.delivery.on_round  # called by a local backend only
        backend.skip_known_events(self.delivery.knows)
        self.inbound = Inbound(
            backend, self.delivery.lag, self.puback_latency, self.settings.publish_gather_ms
        )
        self.events = DeviceEvents(backend.store)
        # Connected / refused / closed: one line each with the connection id, rate-limited.
        self.conn_log = ConnLog(logging.getLogger("lightgate.mqtt.conn"), settings.conn_log_per_s)
        self.sessions = SessionManager(
            backend, self.delivery, self.access, self.inbound.add,
            conns=self.conns, counters=self.counters, internal_counters=self.internal_counters,
            internal_ids=self.internal_ids, events=self.events, conn_log=self.conn_log,
        )  # fmt: skip
        # A disconnect is reported for flapping detection to the ban list itself, or (own
        # process) to the core (the wiring replaces it).
        if settings.flapping_max_disconnects > 0:
            self.sessions.report_disconnect = self.bans.disconnected
        self.inbound.sessions = self.sessions  # each needs the other: wills, QoS 2 ids
        self.sys = SysPublisher(
            self.stats,
            self.sessions.sessions,
            lambda: (c.session for c in self.conns.values() if c.session is not None),
            backend,
        )
        self.sessions.initial.sys = self.sys
        # Garbage, refused WebSocket handshakes, no CONNECT in time: one line each, rate-limited.
        self.bad_clients = BadClientLog(logging.getLogger("lightgate.mqtt.bad"))
        self.connection_rate = ConnectionRate(settings.max_connection_rate)
        # What every connection is handed instead of this server (context.py).
        self.ctx = ProxyContext(
            settings, loop, backend, self.counters, self.internal_counters, self.internal_ids,
            self.refused, self.conns, self.access, self.bans, self.inbound, self.delivery,
            self.sessions, self.keepalive, self.events, self.conn_log, self.bad_clients,
            self.connection_rate,
        )  # fmt: skip
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._closing = False
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Restore persistent sessions, start the notify consumer, resync and $SYS timers."""
        self._started = True
        await self.backend.start()
        await self.sessions.restore()
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._consume_events()))
        self._tasks.append(loop.create_task(self._periodic()))
        for t in self._tasks:
            t.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and not self._closing:
            log.error("mqtt background task failed", exc_info=task.exception())

    async def _consume_events(self) -> None:
        on_event = self.delivery.on_event
        async for batch in self.backend.batches():
            for queue, last_seq in batch.items():
                on_event(queue, last_seq)

    async def _periodic(self) -> None:
        s = self.settings
        flush_every = s.session_flush_ms / 1000
        next_sys = time.monotonic() + s.sys_interval_s
        next_limits = 0.0
        while True:
            await asyncio.sleep(flush_every)
            self.sessions.flush()
            now = time.monotonic()
            self.bad_clients.flush(now)
            self.conn_log.flush(now)
            if now >= next_limits:
                next_limits = now + 1.0
                self._check_limits()
            if s.sys_interval_s > 0 and now >= next_sys:
                next_sys = now + s.sys_interval_s
                self.sys.publish()

    @property
    def closing(self) -> bool:
        return self._closing

    # -- limits (docs/security.md "Limits") ---------------------------------------------------
    def _check_limits(self) -> None:
        """Once a second: close slow consumers, forget idle connection-rate buckets."""
        now = self.loop.time()
        self.connection_rate.prune(now)
        timeout = self.settings.slow_consumer_timeout_s
        if timeout > 0:
            since = now - timeout
            for conn in [c for c in self.conns.values() if not c.writable]:
                if not conn.closed and conn.paused_since <= since:
                    conn.slow_consumer(now - conn.paused_since)

    def _make_conn(self) -> MqttConnection:
        return MqttConnection(self.ctx)

    async def _listen(
        self,
        factory: Callable[[], asyncio.Protocol],
        host: str,
        port: int,
        ssl_ctx: ssl.SSLContext | None = None,
    ) -> tuple[str, int]:
        if not self._started:
            await self.start()
        loop = asyncio.get_running_loop()
        # SO_REUSEPORT for proxies in their own processes: N of them share each port and the
        # kernel spreads new connections over them (docs/architecture.md, "Processes and cores").
        srv = await loop.create_server(
            factory, host, port, ssl=ssl_ctx, reuse_address=True, backlog=4096,
            reuse_port=self.reuse_port or None,
        )  # fmt: skip
        self._servers.append(srv)
        addr = srv.sockets[0].getsockname()
        return addr[0], addr[1]

    async def start_tcp(self, host: str, port: int) -> tuple[str, int]:
        return await self._listen(self._make_conn, host, port)

    async def start_tls(self, host: str, port: int, ssl_ctx: ssl.SSLContext) -> tuple[str, int]:
        return await self._listen(self._make_conn, host, port, ssl_ctx)

    async def start_ws(
        self, host: str, port: int, ssl_ctx: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        """MQTT over WebSocket; over TLS (WSS) with `ssl_ctx`."""
        s, bad = self.settings, self.bad_clients
        return await self._listen(
            lambda: WebSocketProtocol(self._make_conn, s.ws_path, s.connect_timeout_s, bad.bad),
            host,
            port,
            ssl_ctx,
        )

    async def close(self) -> None:
        """Graceful: stop accepting, close connections (no wills), flush appends, persist."""
        if self._closing:
            return
        self._closing = True
        self.sessions.closing = True
        for srv in self._servers:
            srv.close()
        for conn in list(self.conns.values()):
            conn.shutdown()
        await asyncio.sleep(0)  # their connection_lost runs: disconnect events are buffered
        self.inbound.flush()
        await self.inbound.drain()
        self.sessions.flush(force=True)
        self.events.close()  # appended now; any later event is dropped (the store closes next)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except BaseException:
                pass
        for srv in self._servers:
            try:
                await asyncio.wait_for(srv.wait_closed(), 2.0)
            except (TimeoutError, Exception):
                pass
        self.keepalive.close()
        self.backend.close()

    # -- the embedder's hooks (kept by `access`, which the handlers ask) ----------------------
    @property
    def authenticate(self) -> AuthHook | None:
        return self.access.authenticate

    @authenticate.setter
    def authenticate(self, hook: AuthHook | None) -> None:
        self.access.authenticate = hook

    @property
    def authorize_subscribe(self) -> AclHook | None:
        return self.access.authorize_subscribe

    @authorize_subscribe.setter
    def authorize_subscribe(self, hook: AclHook | None) -> None:
        self.access.authorize_subscribe = hook

    @property
    def authorize_publish(self) -> AclHook | None:
        return self.access.authorize_publish

    @authorize_publish.setter
    def authorize_publish(self, hook: AclHook | None) -> None:
        self.access.authorize_publish = hook

    @property
    def topic_hook(self) -> HttpAuth | None:
        return self.access.topic_hook

    @property
    def report_disconnect(self) -> Callable[[str, str], object] | None:
        """Where a disconnect is reported for flapping detection (the session registry
        calls it); None: not detected."""
        return self.sessions.report_disconnect

    @report_disconnect.setter
    def report_disconnect(self, report: Callable[[str, str], object] | None) -> None:
        self.sessions.report_disconnect = report

    @property
    def node_claim(self) -> NodeClaim | None:
        """Other nodes on the same Kafka cluster (set by the wiring; the session registry
        holds it): see `SessionManager.node_claim`."""
        return self.sessions.node_claim

    @node_claim.setter
    def node_claim(self, claim: NodeClaim | None) -> None:
        self.sessions.node_claim = claim

    def _security_reloaded(self) -> None:
        """New rules: every open connection takes them for its next operation and delivery."""
        for conn in list(self.conns.values()):
            conn.refresh_acl()
        for qs in list(self.delivery.queues.values()):
            self.delivery.mark(qs)  # a reader the old rules skipped may read now

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for /metrics and $SYS (monotonic totals plus a few gauges), internal
        clients (probes) left out."""
        out: dict[str, Any] = dict(self.counters)
        internal = sum(1 for cid in self.internal_ids if cid in self.conns)
        out["clients_connected"] = len(self.conns) - internal
        out["sessions"] = len(self.sessions.sessions) - internal
        out["queues_active"] = len(self.delivery.queues)
        out["recent_cache_messages"] = self.backend.recent_count
        out["recent_cache_bytes"] = self.backend.recent_bytes
        out["inflight_appends"] = self.inbound.inflight
        out["ingest_backlog"] = self.inbound.backlog()
        out["ingest_throttled"] = int(self.inbound.throttled)
        out["uptime_s"] = int(time.time() - self.started_at)
        if self.security.http is not None:  # the auth hook's requests, failures, cache hits
            out.update(self.security.http.counters)
        out["version"] = VERSION
        return out

    def metrics(self) -> dict[str, Any]:
        """What /metrics adds to `stats()`: labelled gauges and histograms (JSON-able, so the
        split shape ships them over the core link and the core sums them)."""
        versions: dict[str, int] = {}
        internal_conns = 0
        for conn in self.conns.values():
            if conn.counters is self.internal_counters:
                internal_conns += 1
                continue
            v = "5" if conn.version == 5 else "3.1.1" if conn.version == 4 else "3.1"
            versions[v] = versions.get(v, 0) + 1
        live = persistent = offline = 0
        subs = 0
        internal_ids = self.internal_ids
        for s in self.sessions.sessions.values():
            if s.client_id in internal_ids:
                continue
            subs += len(s.subs)
            if s.conn is not None:
                live += 1
            else:
                offline += 1
            if s.persistent:
                persistent += 1
        b = self.backend
        return {
            "connections": versions,
            "sessions": {"live": live, "persistent": persistent, "offline": offline},
            "subscriptions": subs,
            "refused": dict(self.refused),
            "internal": {**self.internal_counters, "connections": internal_conns},
            "cache_hits": b.cache_hits,
            "cache_misses": b.cache_misses,
            "histograms": {
                "puback": self.puback_latency.to_dict(),
                "publish_deliver": self.delivery.deliver_latency.to_dict(),
            },
        }
