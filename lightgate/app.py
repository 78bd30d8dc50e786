"""Wiring: store + light queues + notify + MQTT proxy + Kafka listener + HTTP in one process.

Start order follows the arrows (store first, listeners last) so that a listener never accepts a
client before what it needs is up; close runs in reverse: stop accepting, let proxies flush, stop the
dispatcher, then flush and fsync the store.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from lightgate import __version__
from lightgate.config import ConfigError, GatewayConfig
from lightgate.config_load import proxy_count
from lightgate.gc_pauses import GcPauses, freeze_startup_heap
from lightgate.health import HealthWatch
from lightgate.http import HttpServer
from lightgate.metrics import Figures
from lightgate.security import build_security, reload_security, reload_tls
from lightgate.tls import (
    TlsReloader,
    certificate_cn,
    check_tls_files,
    server_context,
    tls_context,
)
from store import Store, StoreConfig, StoreError, StoreLockedError
from store.auth import Security
from store.bans import BanList

if TYPE_CHECKING:
    from lightgate.cluster_sessions import ClusterSessions
    from lightgate.core_link import CoreLink
    from lightgate.probe import Probe
    from lightgate.supervisor import ProxySupervisor
    from lightqueue import LightQueues
    from mqtt_proxy.bridge import Bridges, BridgeSettings
    from mqtt_proxy.server import MqttServer
    from notify import InProcessNotifier
    from store.cluster.kafka_log import KafkaLog
    from store.kafka.server import KafkaServer

log = logging.getLogger("lightgate")
CLOSE_STEP_S = 25.0  # per component at shutdown (Gateway.close; the supervisor reaps in 20)


class _Closer(Protocol):
    """A component the gateway closes at stop, in reverse start order."""

    def close(self) -> Awaitable[None]: ...


class Gateway:
    """One embedded gateway. Event-loop-only."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.started_at = time.time()
        self.version = __version__
        self.store: Store | KafkaLog | None = None  # KafkaLog: log = "kafka"
        self.queues: LightQueues | None = None
        self.notifier: InProcessNotifier | None = None
        self.mqtt: MqttServer | None = None  # one-process shape
        self.link: CoreLink | None = None  # split shape (the proxies' figures)
        self.cluster_sessions: ClusterSessions | None = None  # log = "kafka": other nodes
        self.kafka: KafkaServer | None = None
        self.probe: Probe | None = None
        self.bridges: Bridges | None = None  # `[[bridge]]`s (mqtt_proxy/bridge)
        self.endpoints: dict[str, tuple[str, int]] = {}
        self.bans = BanList()  # the data dir's, once `start` has it (open_bans)
        # Proves this gateway's latency probes to its MQTT listeners (store.mapping): made anew
        # at each start, never written anywhere, handed to proxy children in their environment.
        self.internal_secret = secrets.token_bytes(32)
        self._closers: list[_Closer] = []
        # Users and rights, shared by the MQTT and Kafka servers, reloaded in place on SIGHUP.
        self.security: Security = build_security(cfg)
        self.certificates = TlsReloader(cfg)  # the TLS listeners' contexts, reloaded on SIGHUP
        self._proxy: ProxySupervisor | None = None  # when MQTT runs in a child process
        self.figures = Figures(self)
        self.gc_pauses: GcPauses | None = None  # `serve` times this process's collections
        self.watch = HealthWatch(self)

    async def start(self) -> None:
        cfg = self.cfg
        self._closers.append(self.security)  # closed last: its JWKS task, its hook session
        if cfg.log == "kafka":
            self.store = await open_cluster_log(cfg)
        else:
            self.store = await Store.open(cfg.data_path, StoreConfig.from_object(cfg))
        self._closers.append(self.store)
        self.figures.seed(self.store)
        self.bans = open_bans(cfg)
        await self._start_queues_and_mqtt()
        await self._start_kafka()
        if cfg.http_port != -1:
            http = HttpServer(
                cfg.host, cfg.http_port, self.figures.snapshot, self.health,
                bans=self.bans, admin_token=read_admin_token(cfg),
            )  # fmt: skip
            await http.start()
            self._closers.append(http)
            self.endpoints["http"] = (cfg.host, http.port)
        await self._start_probe()
        self.watch.start()
        self._closers.append(self.watch)

    async def _start_probe(self) -> None:
        """Latency probes through this gateway's own MQTT listener (lightgate/probe.py)."""
        if self.cfg.probe_interval_ms <= 0 or "mqtt" not in self.endpoints:
            return
        from lightgate.probe import Probe

        host, port = self.endpoints["mqtt"]
        self.probe = Probe(self.cfg, host, port, self.notifier, self.internal_secret)
        await self.probe.start()
        self._closers.append(self.probe)

    async def _start_queues_and_mqtt(self) -> None:
        """Light queues dispatching into notify, and the MQTT proxy pulling from them.

        The notifier is in-process (the proxy shares this loop); proxies in other processes reach
        its route table over the core link (lightgate/core_link.py).
        """
        from lightqueue import LightQueueConfig, LightQueues
        from mqtt_proxy.backends.backend import LocalBackend
        from mqtt_proxy.server import MqttServer
        from mqtt_proxy.settings import ProxySettings
        from notify import InProcessNotifier

        cfg = self.cfg
        assert self.store is not None
        lq_cfg = LightQueueConfig.from_object(cfg)
        lq_cfg.filter_grace_s = cfg.filter_grace_ms / 1000
        queues = self.queues = LightQueues.open(cfg.data_path, self.store, lq_cfg)
        self._closers.append(queues)
        notifier = self.notifier = InProcessNotifier(last_seq_of=queues.last_seq)
        queues.set_sink(notifier.publish)
        await queues.start()
        if cfg.log == "kafka":
            await catch_up(queues)
            if cfg.cluster_sessions_topic and has_mqtt_listeners(cfg):
                await self._start_cluster_sessions(queues)
        notifier.start()
        self._closers.append(notifier)
        self._start_bridges(queues, notifier)
        if not has_mqtt_listeners(cfg):
            if cfg.core_listen:  # a core for `lightgate proxy` elsewhere, no MQTT of its own
                await self._start_core_link(queues, notifier)
            return
        if proxy_count(cfg) > 0:
            await self._start_proxy_process(queues, notifier)
            return
        settings = ProxySettings.from_config(cfg)
        settings.internal_secret = self.internal_secret
        backend = LocalBackend(self.store, queues, notifier, "mqtt-0", settings.recent_cache_bytes)
        mqtt = self.mqtt = MqttServer(backend, settings, security=self.security, bans=self.bans)
        if self.cluster_sessions is not None:
            from lightgate.cluster_sessions import ServerOwner

            self.cluster_sessions.local = ServerOwner(mqtt, queues.sessions)
            mqtt.node_claim = self.cluster_sessions.claim_then
        await mqtt.start()
        self._closers.append(mqtt)
        if cfg.mqtt_port != -1:
            self.endpoints["mqtt"] = await mqtt.start_tcp(cfg.host, cfg.mqtt_port)
        if cfg.tls_cert and cfg.mqtts_port != -1:
            self.endpoints["mqtts"] = await mqtt.start_tls(
                cfg.host, cfg.mqtts_port, self.certificates.add(tls_context(cfg))
            )
        if cfg.ws_port != -1:
            self.endpoints["ws"] = await mqtt.start_ws(cfg.host, cfg.ws_port)
        if cfg.tls_cert and cfg.wss_port != -1:
            self.endpoints["wss"] = await mqtt.start_ws(
                cfg.host, cfg.wss_port, self.certificates.add(tls_context(cfg))
            )

    async def _start_cluster_sessions(self, queues: LightQueues) -> None:
        """Client ids and sessions shared with the other nodes of the Kafka cluster."""
        from lightgate.cluster_sessions import ClusterSessions, node_id

        cfg = self.cfg
        cs = ClusterSessions(
            cfg.kafka_bootstrap, dict(cfg.extra.get("kafka_client", {})),
            cfg.cluster_sessions_topic, node_id(cfg.data_path), queues, self.store,
            cfg.cluster_handover_wait_ms / 1000, cfg.kafka_replication_factor,
            cfg.cluster_sessions_poll_ms, cfg.cluster_state_flush_ms / 1000,
            cfg.cluster_node_timeout_ms / 1000,
        )  # fmt: skip
        await cs.start()
        self.cluster_sessions = cs
        self._closers.append(cs)

    def _start_bridges(self, queues: LightQueues, notifier: InProcessNotifier) -> None:
        """The `[[bridge]]`s, once per gateway: here, where the log and the light queues are
        (the one process, or the core of proxies in other processes)."""
        settings: list[BridgeSettings] = self.cfg.extra.get("bridges") or []
        if not settings:
            return
        from mqtt_proxy.bridge import Bridge, Bridges

        assert self.store is not None
        security = self.security

        def acl_of(s: BridgeSettings) -> Callable[[str], bool]:
            user = s.local_username or None
            return lambda topic: security.acl.can_write(topic, user, s.identity)

        self.bridges = Bridges(
            [Bridge(s, self.store, queues, notifier, acl_of(s)) for s in settings]
        )
        self.bridges.start()
        self._closers.append(self.bridges)

    async def _start_core_link(self, queues: LightQueues, notifier: InProcessNotifier) -> str:
        """The core link (store, light queues, notify) for MQTT proxies in other processes."""
        from lightgate.core_link import CoreLink
        from lightgate.split import core_address, core_link_security

        assert self.store is not None
        secret, ssl_ctx = core_link_security(self.cfg, server=True)
        link = self.link = CoreLink(
            self.store, queues, notifier, secret=secret, ssl_ctx=ssl_ctx, bans=self.bans
        )
        publish, on_round = notifier.publish, link.queue_service.on_round

        def sink(events: Iterable[tuple[str, int]]) -> None:
            publish(events)
            on_round()

        queues.set_sink(sink)
        if self.cluster_sessions is not None:
            self.cluster_sessions.local = link.clients
            link.clients.node = self.cluster_sessions
        address = await link.start(core_address(self.cfg))
        self._closers.append(link)
        if self.cfg.core_listen and not address.startswith("unix:"):
            host, _, port = address.rpartition(":")
            self.endpoints["core"] = (host, int(port))
        return address

    async def _start_proxy_process(self, queues: LightQueues, notifier: InProcessNotifier) -> None:
        """`mqtt_processes = 1`: the core link, then the proxy child (lightgate/split.py),
        whose listeners become this gateway's MQTT endpoints."""
        from lightgate.supervisor import ProxySupervisor

        address = await self._start_core_link(queues, notifier)
        for wildcard, loopback in (("0.0.0.0:", "127.0.0.1:"), (":::", "::1:")):
            if address.startswith(wildcard):  # the child is local; with core_tls the core's
                address = loopback + address[len(wildcard) :]  # certificate must name this
        supervisor = ProxySupervisor(
            self.cfg, address, proxy_count(self.cfg), internal_secret=self.internal_secret
        )
        self._proxy = supervisor
        self._closers.append(supervisor)
        self.endpoints.update(await supervisor.start())

    async def _start_kafka(self) -> None:
        cfg = self.cfg
        tls_port = cfg.kafka_tls_port if cfg.tls_cert else -1
        if (cfg.kafka_port == -1 and tls_port == -1) or cfg.log == "kafka":
            return  # log = "kafka": Kafka clients use the cluster itself
        from store.kafka.config import KafkaConfig
        from store.kafka.server import KafkaServer

        assert isinstance(self.store, Store)  # not with log = "kafka" (returned above)
        kcfg = KafkaConfig(
            max_frame_bytes=cfg.kafka_max_frame_bytes,
            auto_create_topics=cfg.kafka_auto_create_topics,
            default_partitions=cfg.default_partitions,
            produce_byte_rate=cfg.kafka_produce_byte_rate,
            max_connections=cfg.kafka_max_connections,
            conn_log_per_s=cfg.conn_log_per_s,
        )
        kafka = self.kafka = KafkaServer(
            self.store, cfg.host, cfg.kafka_port, kcfg, security=self.security
        )
        if tls_port != -1:  # Kafka has no answer for "certificate missing": the handshake fails
            kafka.add_tls_listener(tls_port, self.certificates.add(server_context(cfg)))
        if cfg.tls_identity_as_username:  # a client certificate's CN is the SASL user
            kafka.certificate_user = certificate_cn
        await kafka.start()
        self._closers.append(kafka)
        if cfg.kafka_port != -1:
            self.endpoints["kafka"] = (cfg.host, kafka.port)
        if kafka.tls_port != -1:
            self.endpoints["kafka_tls"] = (cfg.host, kafka.tls_port)

    def reload(self) -> bool:
        """SIGHUP: re-read password_file, acl_file, the JWT key files and the TLS certificate;
        the MQTT proxy children re-read them too (each process loads the files itself). A file
        that does not parse keeps the old rules (or certificate)."""
        ok = reload_security(self.security)
        ok = reload_tls(self.certificates) and ok
        if self._proxy is not None:
            self._proxy.reload()
        return ok

    def ready_line(self) -> str:
        order = ("mqtt", "mqtts", "ws", "wss", "kafka", "kafka_tls", "http", "core")
        parts = [
            f"{name}={host}:{port}"
            for name in order
            if name in self.endpoints
            for host, port in [self.endpoints[name]]
        ]
        return "lightgate ready " + " ".join(parts)

    async def mqtt_processes(self) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        """Process -> (MqttServer.stats(), MqttServer.metrics()): this process's proxy as
        "core" or, split, each proxy over the core link by its id."""
        if self.mqtt is not None:
            return {"core": (self.mqtt.stats(), self.mqtt.metrics())}
        if self.link is not None:
            return await self.link.figures()
        return {}

    def health(self) -> dict[str, Any]:
        """200 `ok` or 503 with the reasons: starting, dispatcher stopped or stuck, probes lost."""
        reasons = [] if self.store is not None else ["starting"]
        reasons += self.watch.reasons()
        return {
            "status": "ok" if not reasons else "unhealthy",
            "reasons": reasons,
            "version": __version__,
            "uptime_s": round(time.time() - self.started_at, 1),
            "listeners": {k: f"{h}:{p}" for k, (h, p) in self.endpoints.items()},
        }

    async def close(self) -> None:
        """Close every component, newest first. Each gets CLOSE_STEP_S: a component that does
        not finish by then is logged by name and left behind, so SIGTERM always ends the
        process (a split gateway was seen twice hanging after "shutting down", cause not found;
        what is not flushed then is what a kill -9 leaves, which recovery handles)."""
        for closer in reversed(self._closers):
            name = type(closer).__name__
            log.debug("closing %s", name)
            try:
                await asyncio.wait_for(closer.close(), CLOSE_STEP_S)
            except TimeoutError:
                log.error("%s did not close within %.0f s; going on without it", name,
                          CLOSE_STEP_S, extra={"component": name})  # fmt: skip
            except Exception:
                log.exception("error while closing", extra={"component": name})
        self._closers.clear()


def open_bans(cfg: GatewayConfig) -> BanList:
    """The data dir's bans (`bans.json`) and the flapping policy (store/bans.py)."""
    try:
        return BanList(
            cfg.data_path / "bans.json",
            cfg.flapping_max_disconnects,
            cfg.flapping_window_s,
            cfg.flapping_ban_s,
            cfg.flapping_ban_address,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def read_admin_token(cfg: GatewayConfig) -> str | None:
    """`http_admin_token_file`'s token (trailing newline stripped); None when not set."""
    if not cfg.http_admin_token_file:
        return None
    try:
        token = Path(cfg.http_admin_token_file).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"http_admin_token_file {cfg.http_admin_token_file}: {exc}") from None
    if len(token) < 16:
        raise ConfigError(
            f"http_admin_token_file {cfg.http_admin_token_file}: the token must be at least "
            "16 characters (e.g. `openssl rand -hex 32`)"
        )
    return token


async def open_cluster_log(cfg: GatewayConfig) -> KafkaLog:
    """`log = "kafka"`: the log on the cluster at `kafka_bootstrap` (store.cluster.kafka_log)."""
    from store.cluster.kafka_log import KafkaLog, KafkaLogConfig

    kcfg = KafkaLogConfig(
        bootstrap=cfg.kafka_bootstrap,
        topic_partitions=cfg.kafka_topic_partitions or cfg.default_partitions,
        replication_factor=cfg.kafka_replication_factor,
        client=dict(cfg.extra.get("kafka_client", {})),
        connect_timeout_s=float(cfg.kafka_connect_timeout_s),
        private_topics=(cfg.cluster_sessions_topic,) if cfg.cluster_sessions_topic else (),
    )
    return await KafkaLog.open(cfg.data_path, kcfg)


async def catch_up(queues: Any, every_s: float = 2.0) -> None:
    """Before `ready`: index the cluster's log up to its end as found now (all of it when the
    data dir was new or lost: the light queues are rebuilt from the cluster), logging progress."""
    disp = queues.dispatcher
    disp.refresh()
    target = {tp: min(h, disp._stable(tp)) for tp, h in disp.hwm.items()}  # open txns wait
    total = sum(max(0, h - disp.position(*tp)) for tp, h in target.items())
    if not total:
        return
    log.info("indexing %d records from the cluster before ready", total)
    t0 = last = time.monotonic()
    while True:
        left = sum(max(0, h - disp.position(*tp)) for tp, h in target.items())
        if not left:
            break
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            log.info(
                "indexing from the cluster: %d of %d records (%.0f s)",
                total - left,
                total,
                now - t0,
            )
        disp._wake.set()
        await asyncio.sleep(0.05)
    log.info("indexed %d records from the cluster in %.1f s", total, time.monotonic() - t0)


def has_mqtt_listeners(cfg: GatewayConfig) -> bool:
    """Whether `serve` opens an MQTT port (without one and with `core_listen`, it is a core)."""
    tls = bool(cfg.tls_cert)
    return (
        cfg.mqtt_port != -1
        or cfg.ws_port != -1
        or (tls and (cfg.mqtts_port != -1 or cfg.wss_port != -1))
    )


def check_data_dir(cfg: GatewayConfig, must_exist: bool = False) -> None:
    """A data dir that is a file (or under one) fails with the path named, not `[Errno 17]`."""
    path = cfg.data_path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"data_dir {path}: exists and is not a directory")
    if must_exist and not path.exists():
        raise ConfigError(f"data_dir {path}: no such directory")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"data_dir {path}: {parent} is not a directory")
            break


def preflight(cfg: GatewayConfig) -> None:
    """What the config alone cannot tell, checked before anything starts, so that the error
    names its culprit (the OS's own errors for these name neither the key nor the value)."""
    check_data_dir(cfg)
    try:
        socket.getaddrinfo(cfg.host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"host {cfg.host!r}: cannot resolve it ({exc})") from None
    check_tls_files(cfg)
    read_admin_token(cfg)
    if proxy_count(cfg) > 0 or (cfg.core_listen and not has_mqtt_listeners(cfg)):
        from lightgate.split import core_link_security

        core_link_security(cfg, server=True)  # a TCP link without core_secret is refused here


async def serve(cfg: GatewayConfig) -> int:
    try:
        gateway = Gateway(cfg)
    except ConfigError as exc:
        print(f"lightgate: {exc}", file=sys.stderr)
        return 2
    gateway.gc_pauses = GcPauses().install()  # this process's collections, for /metrics
    # As Mosquitto: SIGHUP reloads the users and ACL, never stops the gateway (even while starting).
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, gateway.reload)
    try:
        preflight(cfg)
        await gateway.start()
    except ConfigError as exc:
        print(f"lightgate: {exc}", file=sys.stderr)
        await gateway.close()
        return 2
    except (StoreLockedError, StoreError) as exc:
        print(f"lightgate: {exc}", file=sys.stderr)
        await gateway.close()
        return 1
    except OSError as exc:
        print(f"lightgate: cannot start: {exc}", file=sys.stderr)
        await gateway.close()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if cfg.gc_freeze:
        frozen = freeze_startup_heap()
        log.info("froze the start-up heap", extra={"objects": frozen})
    print(gateway.ready_line(), flush=True)
    log.info("gateway ready", extra={"endpoints": gateway.ready_line()})
    await stop.wait()
    log.info("shutting down")
    await gateway.close()
    log.info("stopped")
    return 0
