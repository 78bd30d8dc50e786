"""`$SYS/broker/...` statistics, published by the proxy itself (never stored in the log).

`$` topics are not device data (docs/interfaces.md, "Topic mapping"), so these messages bypass
the store and the light queues: every `sys_interval_s` the proxy encodes each value once and
writes it to the local subscribers whose `$SYS` filter matches, and a new subscriber gets the
current values at once (as retained messages, as Mosquitto does). Names follow Mosquitto's
`$SYS` tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from mqtt_proxy.codec import EMPTY_PROPERTIES, Properties, PublishTemplate
from mqtt_proxy.sessions.topic_filters import topic_matches

if TYPE_CHECKING:
    from mqtt_proxy.ports import QueuesPort
    from mqtt_proxy.sessions.state import Session, Subscription


# Figures that are sums over every proxy of the gateway when there are several (the core sums
# them on request: mqtt_proxy.backends.cluster.ProxyCluster.sys_totals); the rest are this proxy's own.
SUMMED = (
    "clients_connected", "sessions", "messages_received", "messages_sent", "publish_dropped",
    "bytes_received", "bytes_sent",
)  # fmt: skip


class SysPublisher:
    """Gets what it reads: the server's `stats`, its sessions (all, and those connected) and
    the backend (with several proxies, its cluster sums the figures)."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        sessions: Mapping[str, Session],
        connected: Callable[[], Iterable[Session]],
        backend: QueuesPort,
    ) -> None:
        self._stats = stats
        self._sessions = sessions
        self._connected = connected
        self._backend = backend
        self.totals: dict[str, Any] = {}  # several proxies: the core's last sums (SUMMED keys)

    def values(self) -> dict[str, str]:
        st = self._stats()
        st.update((k, v) for k, v in self.totals.items() if k in SUMMED)
        return {
            "$SYS/broker/version": str(st["version"]),
            "$SYS/broker/uptime": f"{st['uptime_s']} seconds",
            "$SYS/broker/clients/connected": str(st["clients_connected"]),
            "$SYS/broker/clients/total": str(st["sessions"]),
            "$SYS/broker/messages/received": str(st["messages_received"]),
            "$SYS/broker/messages/sent": str(st["messages_sent"]),
            "$SYS/broker/publish/messages/dropped": str(st["publish_dropped"]),
            "$SYS/broker/bytes/received": str(st["bytes_received"]),
            "$SYS/broker/bytes/sent": str(st["bytes_sent"]),
            "$SYS/broker/subscriptions/count": str(
                sum(len(s.subs) for s in self._sessions.values())
            ),
        }

    def _send(self, subs: list[Subscription], values: dict[str, str], retain: bool) -> None:
        """QoS 0 only: statistics are a snapshot, a lost one is replaced next interval."""
        cache: dict[tuple[str, bool, int | None], bytes] = {}
        for sub in subs:
            conn = sub.session.conn
            if conn is None or not conn.writable:
                continue
            out = []
            sid = sub.sub_id if conn.v5 else None
            for topic, value in values.items():
                if not topic_matches(sub.spec.filter, topic):
                    continue
                key = (topic, conn.v5, sid)
                data = cache.get(key)
                if data is None:
                    props = Properties(subscription_identifiers=(sid,)) if sid else EMPTY_PROPERTIES
                    data = PublishTemplate.build(
                        topic, value.encode(), 0, retain, props, 5 if conn.v5 else 4
                    ).data
                    cache[key] = data
                out.append(data)
            if out:
                conn.write_delivery(b"".join(out), len(out), sum(map(len, out)))

    def publish(self) -> None:
        subs = [
            sub
            for session in self._connected()
            for sub in session.subs.values()
            if sub.local and sub.spec.filter.startswith("$SYS")
        ]
        if subs:
            self._send(subs, self.values(), False)
            cluster = self._backend.cluster
            if cluster is not None:  # the next interval shows every proxy's figures
                cluster.sys_totals(self.totals.update)

    def send_current(self, sub: Subscription) -> None:
        if sub.spec.filter.startswith("$SYS"):
            self._send([sub], self.values(), True)
