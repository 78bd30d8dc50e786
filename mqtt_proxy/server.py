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
from time import time as _time
from typing import TYPE_CHECKING, Any

from mqtt_proxy.codec import EMPTY_PROPERTIES, Properties, Subscribe
from mqtt_proxy.connection.badclients import BadClientLog
from mqtt_proxy.connection.inbound import Inbound
from mqtt_proxy.connection.keepalive import KeepaliveWheel
from mqtt_proxy.connection.limits import ConnectionRate
from mqtt_proxy.connection.websocket import WebSocketProtocol
from mqtt_proxy.delivery.delivery import Delivery
from mqtt_proxy.device_events import DeviceEvents
from mqtt_proxy.ports import QueuesPort
from mqtt_proxy.sessions.manager import SessionManager
from mqtt_proxy.sessions.state import Will
from mqtt_proxy.sessions.topic_filters import FilterError, parse_filter
from mqtt_proxy.settings import ProxySettings
from mqtt_proxy.sys_topics import SysPublisher
from store.auth import Security
from store.auth.http_hook import PUBLISH, SUBSCRIBE, HttpAuth
from store.bans import BanList
from store.connlog import ConnLog
from store.latency import LatencyHistogram
from store.mapping import MqttMessage, MqttProperties

if TYPE_CHECKING:
    from mqtt_proxy.connection.connection import MqttConnection

log = logging.getLogger("lightgate.mqtt")

VERSION = "lightgate-0.1.0"

AuthHook = Callable[[str, str | None, bytes | None], bool]
AclHook = Callable[[str, str], bool]


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
        self.loop = asyncio.get_running_loop()
        self.settings = settings or ProxySettings()
        self.proxy_id = backend.proxy_id
        self.reuse_port = reuse_port
        self._conn_cls: type[MqttConnection] | None = None  # bound at the first connection
        self.store = backend.store
        self.backend = backend
        # Users and rights (docs/security.md); with none given, anyone may do anything.
        self.security = security if security is not None else Security.open()
        self.security.on_reload(self._security_reloaded)
        # Hooks the embedder may set, checked after `security`; None allows everything.
        self.authenticate: AuthHook | None = None
        self.authorize_subscribe: AclHook | None = None
        self.authorize_publish: AclHook | None = None
        # The web service deciding topic rights (store.auth.http_hook), None without `acl_url`:
        # its cached answers are read inline, a topic not cached makes only its connection wait.
        http = self.security.http
        self.topic_hook: HttpAuth | None = (
            http if http is not None and http.settings.acl_url else None
        )
        # Banned client ids and addresses (store/bans.py): the core's list in one process, a
        # mirror the core keeps current when this proxy has its own process. A disconnect is
        # reported for flapping detection to the list itself, or (own process) to the core.
        self.bans = bans if bans is not None else BanList()
        self.report_disconnect: Callable[[str, str], object] | None = (
            self.bans.disconnected if self.settings.flapping_max_disconnects > 0 else None
        )
        # Other nodes on the same Kafka cluster (set by the wiring): `node_claim(client_id,
        # then)` owns the id cluster-wide, then calls `then(moved, state)`: moved with the
        # session another node handed over (its queues held here), or None to start afresh;
        # not moved: this node's own copy is current.
        self.node_claim: Callable[[str, Callable[[bool, Any], None]], None] | None = None
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
        self.conns: dict[str, MqttConnection] = {}  # client id -> live connection
        self.keepalive = KeepaliveWheel(self.loop)  # every connection's keep-alive deadline
        self.delivery = Delivery(
            self.backend, self.settings, self.counters, self.backend.set_interest
        )
        self.backend.entries_sink = self.delivery.on_entries
        self.backend.round_sink = self.delivery.on_round  # called by a local backend only
        self.backend.skip_known_events(self.delivery.knows)
        self.inbound = Inbound(self)
        self.sessions = SessionManager(self)
        self.events = DeviceEvents(backend.store)
        self.sys = SysPublisher(
            self.stats,
            self.sessions.sessions,
            lambda: (c.session for c in self.conns.values() if c.session is not None),
            self.backend,
        )
        # Garbage, refused WebSocket handshakes, no CONNECT in time: one line each, rate-limited.
        self.bad_clients = BadClientLog(logging.getLogger("lightgate.mqtt.bad"))
        self.connection_rate = ConnectionRate(self.settings.max_connection_rate)
        # Connected / refused / closed: one line each with the connection id, rate-limited.
        self.conn_log = ConnLog(
            logging.getLogger("lightgate.mqtt.conn"), self.settings.conn_log_per_s
        )
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
    def connection_allowed(self, peer: object) -> bool:
        """A new connection from `peer` (its peername) is within `max_connection_rate`."""
        ip = peer[0] if isinstance(peer, tuple) else str(peer or "")
        return self.connection_rate.allow(ip, self.loop.time())

    def server_busy(self, client_id: str) -> bool:
        """`max_connections` reached: a new client (not one taking over its id) is refused."""
        limit = self.settings.max_connections
        return 0 < limit <= len(self.conns) and client_id not in self.conns

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
        cls = self._conn_cls
        if cls is None:  # imported here: connection.py imports this module's names
            from mqtt_proxy.connection.connection import MqttConnection

            cls = self._conn_cls = MqttConnection
        return cls(self)

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

    # -- messages --------------------------------------------------------------------------
    @staticmethod
    def message_properties(p: Properties) -> MqttProperties | None:
        """The v5 properties a stored message carries (`mqtt.*` headers, docs/topic-mapping.md),
        or None."""
        if p is EMPTY_PROPERTIES:
            return None
        if (
            p.payload_format_indicator is None
            and p.message_expiry_interval is None
            and p.content_type is None
            and p.response_topic is None
            and p.correlation_data is None
            and not p.user_properties
        ):
            return None
        return MqttProperties(
            p.payload_format_indicator,
            p.message_expiry_interval,
            p.content_type,
            p.response_topic,
            p.correlation_data,
            p.user_properties,
        )

    def make_message(
        self, topic: str, payload: bytes, qos: int, retain: bool, props: Properties, client_id: str
    ) -> MqttMessage:
        mp = None if props is EMPTY_PROPERTIES else self.message_properties(props)
        # The receive time is set here (not left 0 for the store to fill) so the message kept
        # for delivery (Backend.remember) carries the same timestamp as the stored record.
        return MqttMessage(topic, payload, qos, client_id, retain, mp, int(_time() * 1000))

    def publish_message(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        props: MqttProperties | None,
        client_id: str = "",
    ) -> None:
        """A message the broker itself publishes (wills): into the next append batch."""
        self.inbound.add(
            MqttMessage(topic, payload, qos, client_id, retain, props, int(_time() * 1000))
        )

    # -- hooks -----------------------------------------------------------------------------
    def check_auth(self, client_id: str, username: str | None, password: bytes | None) -> bool:
        """The embedder's hook, if any (after `security` accepted the client)."""
        if self.authenticate is not None:
            return bool(self.authenticate(client_id, username, password))
        return True

    def may_subscribe(self, conn: MqttConnection, filt: str) -> bool:
        acl = conn.acl
        if acl is not None and not acl.can_subscribe(filt):
            return False
        web = self.topic_hook
        if (
            web is not None
            and not conn.internal
            and not web.cached(conn.username, conn.client_id, filt, SUBSCRIBE)
        ):
            return False  # refused, or its answer aged out since subscribe_pending: fail closed
        hook = self.authorize_subscribe
        return True if hook is None else bool(hook(conn.client_id, filt))

    def may_publish(self, conn: MqttConnection, topic: str) -> bool:
        acl = conn.acl
        if acl is not None and not acl.can_write(topic):
            return False
        web = self.topic_hook
        if (
            web is not None
            and not conn.internal
            and web.cached(conn.username, conn.client_id, topic, PUBLISH) is False
        ):
            return False  # not asked yet (a will at CONNECT) is decided when it is published
        hook = self.authorize_publish
        return True if hook is None else bool(hook(conn.client_id, topic))

    def may_publish_hooked(self, conn: MqttConnection, topic: str) -> bool | None:
        """`may_publish` with the auth hook: its cached answer (one lookup), or None when it must
        be asked first: the connection then waits (its packets held, reading paused) and
        handles them again once the answer is cached."""
        web = self.topic_hook
        assert web is not None
        if topic[:1] == "$" or (conn.acl is not None and not conn.acl.can_write(topic)):
            return False  # refused without asking
        if conn.internal:
            return True
        answer = web.cached(conn.username, conn.client_id, topic, PUBLISH)
        if answer is None:
            conn.block()
            ask = web.authorize(conn.username, conn.client_id, topic, PUBLISH)
            self.loop.create_task(ask).add_done_callback(lambda _t: conn.unblock())
            return None
        hook = self.authorize_publish
        return answer and (hook is None or bool(hook(conn.client_id, topic)))

    def subscribe_pending(
        self, conn: MqttConnection, p: Subscribe, again: Callable[[Any, Subscribe], None]
    ) -> bool:
        """As `publish_pending` for a SUBSCRIBE's filters; `again(conn, p)` runs it once they
        are all answered (the connection stays blocked meanwhile)."""
        web = self.topic_hook
        assert web is not None
        user, cid = conn.username, conn.client_id
        ask = []
        for ts in p.subscriptions:
            try:
                filt = parse_filter(ts.filter, None).filter
            except FilterError:
                continue
            if web.cached(user, cid, filt, SUBSCRIBE) is None:
                ask.append(web.authorize(user, cid, filt, SUBSCRIBE))
        if not ask:
            return False
        conn.block()

        def answered(_t: asyncio.Future[Any]) -> None:
            if not conn.closed:
                again(conn, p)  # ends with the SUBACK and unblock(), as any SUBSCRIBE

        asyncio.gather(*ask, return_exceptions=True).add_done_callback(answered)
        return True

    def will_allowed(self, will: Will) -> bool | None:
        """The will's topic under the rules of now; None: the auth hook was not asked yet."""
        if will.topic[:1] == "$":
            return False
        acl = will.acl
        if acl is None and not self.security.acl.allows_everything:
            acl = self.security.acl.for_client(will.user, will.owner)
        if acl is not None and not acl.can_write(will.topic):
            return False
        web = self.topic_hook
        if web is not None:
            return web.cached(will.user, will.owner, will.topic, PUBLISH)
        hook = self.authorize_publish
        return True if hook is None else bool(hook(will.owner, will.topic))

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
