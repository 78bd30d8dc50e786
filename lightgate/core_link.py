"""The core's end of the core link: `CoreLink` serves the store, the light queues and notify.

The services are in lightgate.link_services, the method numbers in one
lightgate.link_registry.MethodRegistry, the transport in notify.link. `CoreLink` adds what only
the wiring knows: which proxy is which (HELLO) and the proxies' MQTT figures (STATS) for the
core's `/metrics`. Event-loop-only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
from typing import TYPE_CHECKING, Any

from lightgate.figure_sums import summed_stats
from lightgate.link_registry import HELLO, STATS, MethodRegistry
from lightgate.link_services import LightQueueService, NotifyService, StoreService
from lightgate.owners import ClientRegistry
from lightgate.shares import SharedGroups
from mqtt_proxy.backends.cluster import BANS, FLAP, SYS
from notify.link import RpcPeer, RpcServer
from store.bans import Ban, BanList, encode_bans

if TYPE_CHECKING:
    from lightqueue import LightQueues
    from notify import InProcessNotifier
    from store import Store
    from store.cluster.kafka_log import KafkaLog

log = logging.getLogger("lightgate.split")


class CoreLink:
    """The core's end: store + light queues on the link, notify routed over it, proxies by id.

    One `MethodRegistry` holds the services' methods (lightgate.link_services) and HELLO; the
    `RpcServer` serves it to every proxy that passes the handshake.
    """

    def __init__(
        self,
        store: Store | KafkaLog,
        queues: LightQueues,
        notifier: InProcessNotifier,
        *,
        secret: bytes | None = None,
        ssl_ctx: ssl.SSLContext | None = None,
        bans: BanList | None = None,
    ) -> None:
        self.store_service = StoreService(store)
        self.queue_service = LightQueueService(queues)
        self.proxies: dict[str, RpcPeer] = {}
        self.notify_service = NotifyService(notifier.routes, self.proxies)
        # What must be one across several proxies: client ids, held sessions, wills, $share.
        self.bans = bans if bans is not None else BanList()
        self.clients = ClientRegistry(store, queues, self.bans)
        self.shares = SharedGroups(queues)
        self.shares.lag_peers = lambda: list(self.proxies.values())  # type: ignore[method-assign]
        self.shares.undispatched = lambda: int(queues.dispatcher.behind())
        self._tick: asyncio.TimerHandle | None = None
        self.registry = (
            MethodRegistry()
            .add("store", self.store_service.methods())
            .add("light queues", self.queue_service.methods())
            .add("notify", self.notify_service.methods())
            .add("wiring", {HELLO: self._hello})
            .add("client ids", self.clients.methods())
            .add("shared groups", self.shares.methods())
            .add("$SYS sums", {SYS: self._sys})
            .add("bans", {FLAP: self._flap})
        )
        # The one ban list: proxies mirror it (BANS on HELLO and on every change), report their
        # disconnects to it (FLAP) for flapping detection, and CLAIM checks it once more.
        self.bans.listeners.append(self._push_bans)
        self.server = RpcServer(
            self.registry.table(),
            on_connect=self._connected,
            on_lost=self._lost,
            secret=secret,
            ssl_ctx=ssl_ctx,
        )

    async def start(self, address: str) -> str:
        self.clients.start()
        self._tick = asyncio.get_running_loop().call_later(0.01, self._ticked)
        return await self.server.start(address)

    def _ticked(self) -> None:
        """Flow control across proxies: tell them the dispatcher's backlog as it moves."""
        if len(self.proxies) > 1:
            self.shares.tick()
        self._tick = asyncio.get_running_loop().call_later(0.01, self._ticked)

    def _connected(self, peer: RpcPeer) -> None:
        self.store_service.peer_connected(peer)
        self.queue_service.peer_connected(peer)

    def _hello(self, peer: RpcPeer, body: bytes) -> None:
        proxy_id = body.decode()
        old = self.proxies.get(proxy_id)
        if old is not None and old is not peer:
            old.abort()  # a restarted proxy: the old link's routes go with it
        peer.name = proxy_id
        peer.state["proxy_id"] = proxy_id
        self.proxies[proxy_id] = peer
        self.notify_service.proxy_joined(peer, proxy_id)
        peer.send(BANS, encode_bans(self.bans.in_force()))
        log.info("proxy %s connected to the core link", proxy_id)

    def _lost(self, peer: RpcPeer, exc: Exception | None) -> None:
        self.store_service.peer_lost(peer)
        self.queue_service.peer_lost(peer)
        self.clients.peer_lost(peer)
        self.shares.peer_lost(peer)
        pid = peer.state.get("proxy_id")
        if pid is not None and self.proxies.get(pid) is peer:
            del self.proxies[pid]
            self.notify_service.proxy_left(pid)
            log.info("proxy %s left the core link", pid)

    def _push_bans(self, bans: list[Ban]) -> None:
        body = encode_bans(bans)
        for peer in list(self.proxies.values()):
            if not peer.is_closing():
                peer.send(BANS, body)

    def _flap(self, peer: RpcPeer, body: bytes) -> None:
        client_id, address = json.loads(body)
        self.bans.disconnected(str(client_id), str(address))

    async def _sys(self, peer: RpcPeer, body: bytes) -> bytes:
        """A proxy's `$SYS` shows the gateway's figures: every proxy's counters, summed."""
        return json.dumps(await self.stats()).encode()

    async def stats(self) -> dict[str, Any]:
        """The MQTT counters of every connected proxy, summed (numbers only)."""
        per_proxy = await self.figures(with_metrics=False)
        return summed_stats([st for st, _m in per_proxy.values()])

    async def figures(
        self, with_metrics: bool = True
    ) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
        """Proxy id -> (its `MqttServer.stats()`, its `MqttServer.metrics()` or {}): what the
        one-process gateway reads from its own MqttServer, once per proxy, so that /metrics
        labels each process's figures (a restarted proxy's counters start again at zero, which
        Prometheus's rate() understands per series, not in a sum). The counters of proxies
        that went away (wills published, sessions expired by the core) come as proxy "core".
        A proxy that does not answer is logged once until it answers again."""
        out: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
        for pid, peer in list(self.proxies.items()):
            try:
                body = b"m" if with_metrics else b""
                stats = json.loads(await asyncio.wait_for(peer.call(STATS, body), 2.0))
            except Exception as exc:
                if not peer.state.get("stats_failing"):
                    log.warning("no stats from proxy %s: %r", peer.name, exc)
                peer.state["stats_failing"] = True
                continue
            peer.state["stats_failing"] = False
            metrics = stats.pop("metrics", None) or {}
            out[str(pid)] = (stats, metrics)
        gone = {k: self.clients.counters[k] for k in ("wills_published", "sessions_expired")}
        if any(gone.values()):
            out["core"] = (gone, {})
        return out

    async def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
        await self.server.close()
