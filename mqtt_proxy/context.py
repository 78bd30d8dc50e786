"""What a connection and its packet handlers use of the proxy around them, in one object.

The server builds one `ProxyContext` and hands it to every connection it accepts: the settings,
the loop, the counters, the collaborators (inbound batching, delivery, the session registry,
keep alive, the topic rights, the logs) and the shared maps (live connections, refusals). The
layers below the server name this object, never the server: it holds exactly what they use,
and nothing of the listeners, the lifecycle or the figures. Frozen and slotted: its fields are
read on the hot path, and nothing replaces them after the server is built.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from mqtt_proxy.access import TopicAccess
from mqtt_proxy.connection.badclients import BadClientLog
from mqtt_proxy.connection.inbound import Inbound
from mqtt_proxy.connection.keepalive import KeepaliveWheel
from mqtt_proxy.connection.limits import ConnectionRate
from mqtt_proxy.delivery.delivery import Delivery
from mqtt_proxy.device_events import DeviceEvents
from mqtt_proxy.ports import ClientPort, QueuesPort
from mqtt_proxy.sessions.manager import SessionManager
from mqtt_proxy.settings import ProxySettings
from store.bans import BanList
from store.connlog import ConnLog


@dataclass(frozen=True, slots=True, eq=False)
class ProxyContext:
    settings: ProxySettings
    loop: asyncio.AbstractEventLoop
    backend: QueuesPort  # the layers below (light queues, retained, sessions, the log)
    counters: dict[str, int]  # users' monotonic counters (a connection's default `counters`)
    internal_counters: dict[str, int]  # the same for internal clients (probes)
    internal_ids: set[str]  # client ids of connected internal clients
    refused: dict[str, int]  # refused CONNECTs by cause
    conns: dict[str, ClientPort]  # client id -> live connection
    access: TopicAccess
    bans: BanList
    inbound: Inbound
    delivery: Delivery
    sessions: SessionManager
    keepalive: KeepaliveWheel
    events: DeviceEvents
    conn_log: ConnLog
    bad_clients: BadClientLog
    connection_rate: ConnectionRate

    def connection_allowed(self, peer: object) -> bool:
        """A new connection from `peer` (its peername) is within `max_connection_rate`."""
        ip = peer[0] if isinstance(peer, tuple) else str(peer or "")
        return self.connection_rate.allow(ip, self.loop.time())

    def server_busy(self, client_id: str) -> bool:
        """`max_connections` reached: a new client (not one taking over its id) is refused."""
        limit = self.settings.max_connections
        return 0 < limit <= len(self.conns) and client_id not in self.conns
