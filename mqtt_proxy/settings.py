"""MQTT proxy settings: the subset of the gateway config the proxy reads.

(`allow_anonymous`, `password_file` and `acl_file` are not here: they make the
`store.auth.Security` the embedder passes to `MqttServer`, shared with the Kafka server.)
(`filter_grace_ms` is not here: it configures the light queues, `LightQueueConfig.filter_grace_s`.)

A plain dataclass so `mqtt_proxy` never imports `lightgate` (arrows point down); the embedder
builds it from `GatewayConfig` with `ProxySettings.from_mapping(vars-like object)`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class ProxySettings:
    max_packet_size: int = 1024 * 1024  # 0 = no limit of ours (MQTT's 256 MiB still applies)
    max_keepalive: int = 600
    receive_maximum: int = 64
    max_session_expiry: int = 7 * 24 * 3600
    max_replay_depth_ms: int = 7 * 24 * 3600 * 1000
    sys_interval_s: int = 10
    # TLS connections (mqtts, wss): a client certificate must be presented; its CN is the user.
    tls_require_client_cert: bool = False
    tls_identity_as_username: bool = False
    recent_cache_bytes: int = 64 << 20
    publish_gather_ms: int = 0  # a pass's PUBLISHes wait this long for more before the round
    # Limits (docs/security.md "Limits"); 0 = off.
    max_connections: int = 0  # connected MQTT clients (all MQTT listeners); beyond: 0x89 / 0x03
    max_connection_rate: int = 0  # new connections per second per source IP; 0x9F / 0x03
    max_publish_rate: int = 0  # PUBLISH per second per client: reading pauses, then 0x97
    max_publish_bytes_rate: int = 0  # PUBLISH payload bytes per second per client, likewise
    # Flapping detection (store/bans.py) is the core's; a proxy only needs to know whether to
    # report its disconnects.
    flapping_max_disconnects: int = 0
    slow_consumer_timeout_s: int = 60  # a socket full this long is closed (0 = never)
    conn_log_per_s: int = 20  # connection lifecycle lines per second (connlog.py)
    # Server-assigned topic aliases on outbound PUBLISH to v5 clients that accept them
    # (topic_aliases.py); max_topic_alias_out numbers the topics, shared by all connections.
    topic_alias_out: bool = True
    max_topic_alias_out: int = 256
    # Not in the gateway config (yet): internal knobs with sensible defaults.
    max_topic_alias: int = 64
    session_flush_ms: int = 100
    cache_per_queue: int = 1024
    read_batch: int = 256
    write_high_water: int = 256 * 1024
    ws_path: str = "/mqtt"
    # How long a new connection may take to send CONNECT (TCP, TLS) or to finish the WebSocket
    # upgrade (then CONNECT gets the same time again); then it is closed and logged.
    connect_timeout_s: float = 10.0
    # Not config: the embedder's secret that proves its own internal clients (latency probes;
    # store.mapping.internal_password). Empty: every internal client id is refused.
    internal_secret: bytes = b""

    @classmethod
    def from_config(cls, cfg: object) -> ProxySettings:
        """Copy the fields this class knows from any object with those attributes (GatewayConfig)."""
        values = {f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)}
        return cls(**values)
