"""`lightgate proxy`: the MQTT proxy process, over the core link (lightgate/split.py says why).

It connects to the core (`notify.link.connect`, the handshake with `core_secret`), says HELLO,
puts the clients of the store, the light queues and notify (mqtt_proxy.remote_*) in one
`MethodRegistry` with STATS, and runs an `MqttServer` on them until SIGTERM or the link drops.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import ssl
import sys
from collections.abc import Callable

from lightgate.config import ConfigError, GatewayConfig
from lightgate.gc_pauses import freeze_startup_heap
from lightgate.link_registry import HELLO, STATS, MethodRegistry
from lightgate.split import READY_PREFIX, core_link_security
from mqtt_proxy.backends.cluster import ProxyCluster
from mqtt_proxy.backends.remote_notify import LinkNotifier
from mqtt_proxy.backends.remote_queues import RemoteLightQueues
from mqtt_proxy.backends.remote_store import RemoteStore
from notify.link import RpcPeer, connect
from notify.link_frames import AUTH_FAILED, RpcError
from store.auth import Security

log = logging.getLogger("lightgate.split")


def exit_with_parent() -> None:
    """Linux: die with the process that started us (a `kill -9` of the core takes us along)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


async def run_proxy(
    cfg: GatewayConfig,
    core: str,
    proxy_id: str,
    security: Callable[[], Security],
    *,
    reload: Callable[[Security], object],
    tls_ctx: Callable[[], ssl.SSLContext] | None = None,
    internal_secret: bytes = b"",
) -> int:
    """`lightgate proxy`: MQTT listeners over a remote core until SIGTERM or the link drops.

    The caller (lightgate.cli) hands in what the core process builds from the same config, so
    this module needs neither the gateway (`lightgate.app`) nor the TLS setup: `security` builds
    the users and ACL (a ConfigError exits 2), `reload` re-reads them on SIGHUP, `tls_ctx` makes
    the mqtts/wss listeners' context (None: no TLS listeners)."""
    from mqtt_proxy.backends.remote import RemoteBackend
    from mqtt_proxy.server import MqttServer
    from mqtt_proxy.settings import ProxySettings

    rs, rq, notifier = RemoteStore(), RemoteLightQueues(), LinkNotifier(proxy_id)
    cluster = ProxyCluster()
    server: MqttServer | None = None

    def stats(peer: RpcPeer, body: bytes) -> bytes:
        if server is None:
            return b"{}"
        if body != b"m":  # counters only (the core's 1 s rate sample)
            return json.dumps(server.stats()).encode()
        return json.dumps({**server.stats(), "metrics": server.metrics()}).encode()

    methods = (
        MethodRegistry()
        .add("store", rs.methods())
        .add("light queues", rq.methods())
        .add("notify", notifier.methods())
        .add("wiring", {STATS: stats})
        .add("client ids and shared groups", cluster.methods())
        .table()
    )
    secret, ssl_ctx = core_link_security(cfg, server=False, address=core)
    try:
        peer = await connect(core, methods, name="core", secret=secret, ssl_ctx=ssl_ctx)
    except RpcError as exc:  # the handshake failed; a refusal was logged already (notify.link)
        if exc.code != AUTH_FAILED:
            print(f"lightgate proxy: the core link to {core} failed: {exc}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        print(f"lightgate proxy: cannot reach the core at {core}: {exc}", file=sys.stderr)
        return 1
    peer.send(HELLO, proxy_id.encode())
    for part in (rs, rq, notifier, cluster):
        part.attach(peer)
    await rs.start()
    try:
        users = security()
    except ConfigError as exc:
        print(f"lightgate proxy: {exc}", file=sys.stderr)
        peer.close()
        return 2
    # Each process reads the files itself: `serve` forwards its SIGHUP here (ProxySupervisor).
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload, users)
    settings = ProxySettings.from_config(cfg)
    settings.internal_secret = internal_secret
    backend = RemoteBackend(rs, rq, notifier, proxy_id, settings.recent_cache_bytes)
    backend.cluster = cluster
    server = MqttServer(backend, settings, reuse_port=True, security=users, bans=cluster.bans)
    server.delivery.leases = cluster
    if server.report_disconnect is not None:  # flapping detection: the core counts
        server.report_disconnect = cluster.flapped
    cluster.delivery, cluster.sessions = server.delivery, server.sessions
    endpoints: dict[str, tuple[str, int]] = {}
    try:
        await server.start()
        if cfg.mqtt_port != -1:
            endpoints["mqtt"] = await server.start_tcp(cfg.host, cfg.mqtt_port)
        if tls_ctx is not None and cfg.tls_cert and cfg.mqtts_port != -1:
            endpoints["mqtts"] = await server.start_tls(cfg.host, cfg.mqtts_port, tls_ctx())
        if cfg.ws_port != -1:
            endpoints["ws"] = await server.start_ws(cfg.host, cfg.ws_port)
        if tls_ctx is not None and cfg.tls_cert and cfg.wss_port != -1:
            endpoints["wss"] = await server.start_ws(cfg.host, cfg.wss_port, tls_ctx())
    except OSError as exc:
        print(f"lightgate proxy: cannot start: {exc}", file=sys.stderr)
        await server.close()
        peer.close()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    peer.closed.add_done_callback(lambda _f: stop.set())
    parts = " ".join(f"{k}={h}:{p}" for k, (h, p) in endpoints.items())
    print(f"{READY_PREFIX} {parts}".rstrip(), flush=True)
    if cfg.gc_freeze:
        freeze_startup_heap()
    log.info("mqtt proxy ready", extra={"proxy_id": proxy_id, "core": core})
    await stop.wait()
    lost = peer.closed.done()
    if lost:
        log.error("core link lost; the proxy stops (its supervisor starts a new one)")
    await server.close()
    if not lost:
        try:
            await asyncio.wait_for(rs.barrier(), 5)  # the core has what close() sent
        except Exception as exc:
            log.warning("no answer from the core before closing: %r", exc)
    peer.close()
    return 1 if lost else 0
