"""Settings of the Kafka listener (the `[kafka]` part of Lightgate's config)."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import DEFAULT_MAX_FRAME

__all__ = ["KafkaConfig"]


@dataclass(frozen=True, slots=True)
class KafkaConfig:
    """Defaults follow Kafka's broker defaults where one exists (names in brackets)."""

    # Largest request frame accepted; a larger declared size closes the connection
    # [socket.request.max.bytes, 100 MiB].
    max_frame_bytes: int = DEFAULT_MAX_FRAME
    # Metadata requests for unknown topics create them [auto.create.topics.enable].
    auto_create_topics: bool = True
    # Partitions for topics created by Metadata / CreateTopics(-1); None = the store's default.
    default_partitions: int | None = None
    node_id: int = 0
    # Host put in Metadata/FindCoordinator; None = the local address the client connected to.
    advertised_host: str | None = None
    cluster_id: str = "lightgate"
    # [group.min.session.timeout.ms], [group.max.session.timeout.ms]
    group_min_session_timeout_ms: int = 6000
    group_max_session_timeout_ms: int = 1_800_000
    # Wait after the first member joins an empty group [group.initial.rebalance.delay.ms is 3000;
    # 0 here answers a lone consumer at once, which suits a single-node gateway and its tests].
    group_initial_rebalance_delay_ms: int = 0
    # Cap on one Fetch response, whatever the client asks [fetch.max.bytes, 55 MiB].
    fetch_max_bytes: int = 55 * 1024 * 1024
    # Requests read ahead of their responses on one connection before reading pauses.
    max_inflight_requests: int = 64
    # A connection whose authentication failed is closed this long after the answer
    # [connection.failed.authentication.delay.ms, 100].
    failed_authentication_delay_ms: int = 100
    # Produce quota per connection, bytes a second; 0: none [quota producer_byte_rate, which
    # Kafka keys by user / client id]. Over it: throttle_time_ms and a muted channel (quota.py).
    produce_byte_rate: int = 0
    # Open Kafka connections, both listeners together; one more is closed at once, unanswered
    # [max.connections, which makes the acceptor wait instead]; 0: no limit.
    max_connections: int = 0
    # How often the idempotent-producer snapshot is rewritten when it changed.
    producer_snapshot_interval_s: float = 30.0
    # Connection lifecycle log lines per second (store/connlog.py); 0 logs none.
    conn_log_per_s: int = 20
