"""Every family /metrics exports, in one table: name, type, labels, meaning, and how to read it
from a `Figures.snapshot()`.

The table is the single source: `GatewayCollector` yields it, `python -m lightgate.metrics_docs`
writes it into docs/operations.md, and the tests compare a real scrape, the docs, the Grafana
dashboard and the alerting rules with it. Conventions (Prometheus's): counters end in `_total`,
units are in the name (`_seconds`, `_bytes`), one family with labels rather than near-duplicate
families. MQTT figures carry `process` ("core" for the proxy inside `serve`, else the proxy's
id): each series is one process's, so `sum()` and `rate()` are right when a proxy restarts.
Internal clients and topics (latency probes, device events) are never in users' families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from store.latency import BOUNDS

Samples = Iterable[tuple[tuple[str, ...], Any]]  # (label values, value or histogram dict)


@dataclass(frozen=True)
class Family:
    name: str  # as exposed (a counter's with `_total`)
    kind: str  # counter, gauge, histogram
    labels: tuple[str, ...]
    help: str
    read: Callable[[dict[str, Any]], Samples]


def _one(key: str) -> Callable[[dict[str, Any]], Samples]:
    return lambda s: [((), s[key])]


def _proc(key: str, section: str = "") -> Callable[[dict[str, Any]], Samples]:
    """One MQTT proxy figure per process: `stats()[key]`, or `metrics()[section][key]`."""

    def read(s: dict[str, Any]) -> Samples:
        for proc, (st, m) in sorted(s["processes"].items()):
            src = (m.get(section) or {}) if section else st
            if key in src:
                yield (proc,), src[key]

    return read


MQTT_VERSIONS = ("3.1", "3.1.1", "5")


def _connections(s: dict[str, Any]) -> Samples:
    for proc, (_st, m) in sorted(s["processes"].items()):
        if "connections" not in m:
            continue
        conns = m["connections"]
        for version in sorted({*MQTT_VERSIONS, *conns}):  # zeros too: an idle gateway says 0
            yield ("mqtt", version, proc), conns.get(version, 0)
    yield ("kafka", "", "core"), s["connections"]["kafka"]


def _sessions(s: dict[str, Any]) -> Samples:
    for proc, (_st, m) in sorted(s["processes"].items()):
        sessions = m.get("sessions")
        if sessions:
            yield ("live", proc), sessions["live"]
            yield ("offline", proc), sessions["offline"]


def _traffic(
    kinds: tuple[str, str], kafka: tuple[str, str], section: str = ""
) -> Callable[[dict[str, Any]], Samples]:
    """MQTT per process and direction (`stats()` or `metrics()[section]`), then Kafka's."""

    def read(s: dict[str, Any]) -> Samples:
        for proc, (st, m) in sorted(s["processes"].items()):
            src = (m.get(section) or {}) if section else st
            for direction, key in zip(("in", "out"), kinds, strict=True):
                if key in src:
                    yield (*(("mqtt",) if not section else ()), direction, proc), src[key]
        if not section:
            for direction, key in zip(("in", "out"), kafka, strict=True):
                yield ("kafka", direction, "core"), s["kafka"].get(key, 0)

    return read


def _refused(s: dict[str, Any]) -> Samples:
    for proc, (_st, m) in sorted(s["processes"].items()):
        for reason, n in sorted((m.get("refused") or {}).items()):
            yield (reason, proc), n


def _cache(s: dict[str, Any]) -> Samples:
    for proc, (_st, m) in sorted(s["processes"].items()):
        if "cache_hits" in m:
            yield ("hit", proc), m["cache_hits"]
            yield ("miss", proc), m["cache_misses"]


def _proc_hist(key: str) -> Callable[[dict[str, Any]], Samples]:
    def read(s: dict[str, Any]) -> Samples:
        for proc, (_st, m) in sorted(s["processes"].items()):
            d = (m.get("histograms") or {}).get(key)
            if d is not None:
                yield (proc,), d

    return read


def _hist(key: str) -> Callable[[dict[str, Any]], Samples]:
    return lambda s: [((), s["latency"][key])] if key in s["latency"] else []


def _topics(section: str, key: str) -> Callable[[dict[str, Any]], Samples]:
    return lambda s: [((t,), f[key]) for t, f in sorted(s[section].items())]


def _lag(s: dict[str, Any]) -> Samples:
    topics = {**s["topics"], **s["internal_topics"]}
    return [((t,), f["lag"]) for t, f in sorted(topics.items())]


def _bridge(key: str) -> Callable[[dict[str, Any]], Samples]:
    """One figure per bridge (`Figures.snapshot()["bridges"]`, a list of BridgeFigures)."""
    return lambda s: [((b["name"],), int(b[key]) if key == "connected" else b[key])
                      for b in s.get("bridges", ())]  # fmt: skip


def _bridge_messages(s: dict[str, Any]) -> Samples:
    for b in s.get("bridges", ()):
        yield (b["name"], "out"), b["messages_out"]
        yield (b["name"], "in"), b["messages_in"]


def _of(section: str, key: str) -> Callable[[dict[str, Any]], Samples]:
    """A figure of a component that may not run here (Kafka listener, log = "kafka")."""
    return lambda s: [((), s[section][key])] if key in (s.get(section) or {}) else []


def _probe(key: str) -> Callable[[dict[str, Any]], Samples]:
    return lambda s: [((), s["probe_counts"][key])] if s["probe_counts"] else []


def _kafka_log_cache(s: dict[str, Any]) -> Samples:
    kl = s["kafka_log"]
    if kl:
        yield ("hit",), kl["kafka_log_cache_hits"]
        yield ("miss",), kl["kafka_log_cache_misses"]


P = ("process",)
C, G, H = "counter", "gauge", "histogram"
FAMILIES: tuple[Family, ...] = (
    # -- the gateway ---------------------------------------------------------------------------
    Family("lightgate_up", G, (), "1 when /health answers ok (200), 0 when it answers 503",
           lambda s: [((), int(s["health"]["status"] == "ok"))]),
    Family("lightgate_build_info", G, ("version",), "Always 1; the gateway's version as a label",
           lambda s: [((s["version"],), 1)]),
    Family("lightgate_start_time_seconds", G, (), "Unix time the gateway started",
           _one("started_at")),
    # -- clients: users' figures only (internal clients below) ---------------------------------
    Family("lightgate_connections", G, ("protocol", "version", "process"),
           "Open client connections: MQTT by protocol version (3.1, 3.1.1, 5), Kafka (version "
           "empty)", _connections),
    Family("lightgate_sessions", G, ("state", "process"),
           "MQTT sessions, live (connected) or offline (persistent, waiting for their client)",
           _sessions),
    Family("lightgate_persistent_sessions", G, P,
           "MQTT sessions that outlive their connection, live or offline",
           _proc("persistent", "sessions")),
    Family("lightgate_subscriptions", G, P, "MQTT subscriptions of the sessions",
           lambda s: [((p,), m["subscriptions"]) for p, (_st, m) in sorted(s["processes"].items())
                      if "subscriptions" in m]),
    Family("lightgate_messages_total", C, ("protocol", "direction", "process"),
           "Messages received (in: MQTT PUBLISH, Kafka produced records) and sent (out: MQTT "
           "PUBLISH, Kafka fetched records)",
           _traffic(("messages_received", "messages_sent"),
                    ("kafka_produce_records_total", "kafka_fetch_records_total"))),
    Family("lightgate_bytes_total", C, ("protocol", "direction", "process"),
           "Bytes received and sent (MQTT: on the wire; Kafka: record batches)",
           _traffic(("bytes_received", "bytes_sent"),
                    ("kafka_produce_bytes_total", "kafka_fetch_bytes_total"))),
    # -- the MQTT proxies ----------------------------------------------------------------------
    Family("lightgate_mqtt_connects_total", C, P, "MQTT CONNECTs accepted", _proc("connects")),
    Family("lightgate_mqtt_disconnects_total", C, P, "MQTT connections of a session closed",
           _proc("disconnects")),
    Family("lightgate_mqtt_connect_refused_total", C, ("reason", *P),
           "MQTT CONNECTs refused, by cause: bad_credentials, not_authorized, bad_auth_method, "
           "bad_client_id, server_busy (max_connections), rate_exceeded (max_connection_rate), "
           "other", _refused),
    Family("lightgate_mqtt_protocol_errors_total", C, P,
           "MQTT connections closed for a protocol error", _proc("protocol_errors")),
    Family("lightgate_mqtt_takeovers_total", C, P,
           "MQTT connections ended by a newer one with the same client id", _proc("takeovers")),
    Family("lightgate_mqtt_publish_dropped_total", C, P,
           "MQTT PUBLISH not stored (`$` topics, topics the ACL refuses)",
           _proc("publish_dropped")),
    Family("lightgate_mqtt_subscribes_total", C, P, "MQTT subscriptions made (new filters)",
           _proc("subscriptions")),
    Family("lightgate_mqtt_wills_published_total", C, P, "MQTT wills published",
           _proc("wills_published")),
    Family("lightgate_mqtt_sessions_expired_total", C, P, "MQTT sessions expired",
           _proc("sessions_expired")),
    Family("lightgate_mqtt_write_pauses_total", C, P,
           "Times a subscriber's socket buffer filled and delivery to it paused",
           _proc("write_pauses")),
    Family("lightgate_mqtt_publish_rate_pauses_total", C, P,
           "Times a publisher was paused by max_publish_rate", _proc("publish_rate_pauses")),
    Family("lightgate_mqtt_publish_quota_exceeded_total", C, P,
           "PUBLISH refused (v5 0x97) or dropped past max_publish_rate's burst",
           _proc("publish_quota_exceeded")),
    Family("lightgate_mqtt_publish_rate_disconnects_total", C, P,
           "v5 clients disconnected (0x96) for a QoS 0 flood past their publish rate",
           _proc("publish_rate_disconnects")),
    Family("lightgate_mqtt_tokens_expired_total", C, P,
           "MQTT connections closed when their JWT expired (v5 DISCONNECT 0xA0)",
           _proc("tokens_expired")),
    Family("lightgate_mqtt_wills_refused_total", C, P,
           "Wills not published: the ACL in force at publish time refused their topic",
           _proc("wills_refused")),
    Family("lightgate_mqtt_slow_consumers_closed_total", C, P,
           "Subscribers closed for not reading (slow_consumer_timeout_ms)",
           _proc("slow_consumers_closed")),
    Family("lightgate_mqtt_cache_lookups_total", C, ("result", *P),
           "Light-queue entries resolved from the recent-append cache (hit) or read from the "
           "store (miss)", _cache),
    Family("lightgate_mqtt_active_queues", G, P, "Light queues with a reader in this proxy",
           _proc("queues_active")),
    Family("lightgate_mqtt_recent_cache_messages", G, P, "Messages in the recent-append cache",
           _proc("recent_cache_messages")),
    Family("lightgate_mqtt_recent_cache_bytes", G, P, "Bytes in the recent-append cache",
           _proc("recent_cache_bytes")),
    Family("lightgate_mqtt_inflight_appends", G, P,
           "PUBLISH batches handed to the store, not yet durable", _proc("inflight_appends")),
    Family("lightgate_mqtt_ingest_backlog_messages", G, P,
           "Messages appended and not yet indexed, or owed to readers that can take them",
           _proc("ingest_backlog")),
    Family("lightgate_mqtt_ingest_throttled", G, P,
           "1 while publishers are held back because the backlog is over its bound",
           _proc("ingest_throttled")),
    Family("lightgate_puback_latency_seconds", H, P,
           "MQTT QoS 1/2 PUBLISH parsed to PUBACK/PUBREC sent (durable), per message",
           _proc_hist("puback")),
    Family("lightgate_publish_deliver_latency_seconds", H, P,
           "Broker receive to PUBLISH written to a subscriber, per delivered copy (ms "
           "resolution)", _proc_hist("publish_deliver")),
    # -- internal clients: the latency probes --------------------------------------------------
    Family("lightgate_internal_connections", G, P,
           "MQTT connections of the gateway's own clients (latency probes)",
           _proc("connections", "internal")),
    Family("lightgate_internal_messages_total", C, ("direction", *P),
           "MQTT PUBLISH received from and sent to the gateway's own clients",
           _traffic(("messages_received", "messages_sent"), ("", ""), "internal")),
    Family("lightgate_internal_bytes_total", C, ("direction", *P),
           "MQTT bytes received from and sent to the gateway's own clients",
           _traffic(("bytes_received", "bytes_sent"), ("", ""), "internal")),
    Family("lightgate_probe_latency_seconds", H, ("hop",),
           "Latency probes, per hop: durable, indexed, delivered, end_to_end",
           lambda s: [((hop,), d) for hop, d in s["probe"].items()]),
    Family("lightgate_probe_sent_total", C, (), "Latency probes published", _probe("sent")),
    Family("lightgate_probe_delivered_total", C, (), "Latency probes delivered back",
           _probe("delivered")),
    Family("lightgate_probe_connected", G, (), "1 while the probe client is connected",
           _probe("connected")),
    # -- Kafka listener ------------------------------------------------------------------------
    Family("lightgate_kafka_requests_total", C, (), "Kafka requests",
           _of("kafka", "kafka_requests_total")),
    Family("lightgate_kafka_responses_total", C, ("api", "error_code"),
           "Kafka responses by API and their first non-zero error code",
           lambda s: [((r["api"], str(r["error_code"])), r["count"])
                      for r in s["kafka_responses"]]),
    Family("lightgate_kafka_protocol_errors_total", C, (),
           "Kafka connections closed for a protocol error",
           _of("kafka", "kafka_protocol_errors_total")),
    Family("lightgate_kafka_produce_throttled_total", C, (),
           "Kafka Produce requests throttled by kafka_produce_byte_rate",
           _of("kafka", "kafka_produce_throttled_total")),
    Family("lightgate_kafka_authentication_failures_total", C, (),
           "Kafka SASL authentications that failed", _of("kafka", "kafka_auth_failures_total")),
    Family("lightgate_kafka_authorization_failures_total", C, (),
           "Kafka requests refused by the ACL", _of("kafka", "kafka_authorization_failures_total")),
    Family("lightgate_kafka_connections_refused_total", C, (),
           "Kafka connections closed at accept: kafka_max_connections reached",
           _of("kafka", "kafka_connections_refused_total")),
    Family("lightgate_kafka_consumer_groups", G, (), "Kafka consumer groups",
           _of("kafka", "kafka_groups")),
    Family("lightgate_kafka_produce_latency_seconds", H, (),
           "Kafka Produce request received to response ready (durable under acks>=1)",
           _hist("kafka_produce")),
    # -- the log and its disk --------------------------------------------------------------------
    Family("lightgate_topic_disk_bytes", G, ("topic",), "Segment bytes per user log topic",
           _topics("topics", "disk_bytes")),
    Family("lightgate_topic_records", G, ("topic",),
           "Records per user log topic (high watermark minus log start)",
           _topics("topics", "records")),
    Family("lightgate_internal_topic_disk_bytes", G, ("topic",),
           "Segment bytes per internal log topic (device events, probes)",
           _topics("internal_topics", "disk_bytes")),
    Family("lightgate_internal_topic_records", G, ("topic",),
           "Records per internal log topic (device events, probes)",
           _topics("internal_topics", "records")),
    Family("lightgate_data_dir_free_bytes", G, (),
           "Free bytes of the data directory's file system",
           lambda s: [((), s["data_dir"]["free_bytes"])]),
    Family("lightgate_data_dir_size_bytes", G, (),
           "Size in bytes of the data directory's file system",
           lambda s: [((), s["data_dir"]["size_bytes"])]),
    Family("lightgate_fsync_latency_seconds", H, (), "One partition fsync of the group commit",
           _hist("fsync")),
    Family("lightgate_retained_messages", G, (),
           "Retained topics (a key scan, at most every 30 s)", _one("retained")),
    # -- light queues and notify ---------------------------------------------------------------
    Family("lightgate_dispatch_lag_records", G, ("topic",),
           "Log end minus the dispatcher's checkpoint, per log topic", _lag),
    Family("lightgate_lightqueue_dispatched_records_total", C, (),
           "Records the dispatcher indexed into light queues",
           _of("lightqueue", "lightqueue_dispatched_records")),
    Family("lightgate_lightqueue_corrupt_batches_total", C, (),
           "Record batches the dispatcher skipped as corrupt",
           _of("lightqueue", "lightqueue_corrupt_batches")),
    Family("lightgate_lightqueue_queues", G, (), "Light queues",
           _of("lightqueue", "lightqueue_queues")),
    Family("lightgate_wildcard_queues", G, (), "Light queues of wildcard filters",
           _one("wildcard_queues")),
    Family("lightgate_lightqueue_backfills", G, (), "Light queues being backfilled from the log",
           _of("lightqueue", "lightqueue_backfills")),
    Family("lightgate_dispatch_batch_latency_seconds", H, (),
           "One dispatch round (read the log, index into light queues, one LevelDB write)",
           _hist("dispatch_batch")),
    Family("lightgate_notify_events_total", C, (), "Notify events routed to proxies",
           lambda s: [((), s["notify"]["events"])]),
    Family("lightgate_notify_events_coalesced_total", C, (),
           "Notify events merged into one already pending",
           lambda s: [((), s["notify"]["coalesced"])]),
    Family("lightgate_core_link_proxies", G, (),
           "MQTT proxies connected to the core link (mqtt_processes >= 1, core_listen)",
           lambda s: [] if s["core_link_proxies"] is None else [((), s["core_link_proxies"])]),
    Family("lightgate_gc_pause_seconds", H, (),
           "One CPython garbage collection of the gateway process (its event loop stopped)",
           _hist("gc_pause")),
    # -- log = "kafka": the log on a Kafka cluster ---------------------------------------------
    Family("lightgate_kafka_log_fetches_total", C, (), "Fetch requests sent to the cluster",
           _of("kafka_log", "kafka_log_fetches")),
    Family("lightgate_kafka_log_polls_total", C, (), "Polls of every partition's tail",
           _of("kafka_log", "kafka_log_polls")),
    Family("lightgate_kafka_log_cache_bytes", G, (), "Bytes in the fetched-batch cache",
           _of("kafka_log", "kafka_log_cache_bytes")),
    Family("lightgate_kafka_log_cache_lookups_total", C, ("result",),
           "Reads served by the fetched-batch cache (hit) or fetched (miss)", _kafka_log_cache),
    Family("lightgate_cluster_sessions_total", C, ("event",),
           "Client ids across nodes (cluster_sessions_topic): claims made, sessions handed to "
           "another node, sessions taken from one, hand-overs not answered in time, session "
           "state records written, nodes found dead, sessions of dead nodes adopted here",
           lambda s: sorted(((k,), v) for k, v in (s.get("cluster_sessions") or {}).items())),
    # -- bridges to other MQTT brokers ---------------------------------------------------------
    Family("lightgate_bridge_connected", G, ("bridge",),
           "1 while the bridge is connected to its remote", _bridge("connected")),
    Family("lightgate_bridge_lag_messages", G, ("bridge",),
           "Messages of the bridge's out rules the remote has not acknowledged yet",
           _bridge("lag_messages")),
    Family("lightgate_bridge_lag_seconds", G, ("bridge",),
           "Age of the oldest message the remote has not acknowledged (0 when caught up)",
           _bridge("lag_seconds")),
    Family("lightgate_bridge_messages_total", C, ("bridge", "direction"),
           "Messages forwarded: out (log to remote, acknowledged) and in (remote to log)",
           _bridge_messages),
    Family("lightgate_bridge_reconnects_total", C, ("bridge",),
           "Connection attempts after the first", _bridge("reconnects")),
)  # fmt: skip


def _buckets(d: dict[str, Any]) -> list[tuple[str, float]]:
    out, acc = [], 0
    for bound, c in zip(list(BOUNDS) + [float("inf")], d["counts"], strict=True):
        acc += c
        out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
    return out


def family_metric(f: Family, snap: dict[str, Any]) -> Metric:
    labels = list(f.labels)
    if f.kind == "histogram":
        h = HistogramMetricFamily(f.name, f.help, labels=labels)
        for values, d in f.read(snap):
            h.add_metric(list(values), _buckets(d), d["sum"])
        return h
    m: CounterMetricFamily | GaugeMetricFamily
    if f.kind == "counter":
        m = CounterMetricFamily(f.name, f.help, labels=labels)
    else:
        m = GaugeMetricFamily(f.name, f.help, labels=labels)
    for values, v in f.read(snap):
        m.add_metric(list(values), v)
    return m


class GatewayCollector(Collector):
    """prometheus_client collector over the last snapshot (`/metrics` refreshes it first)."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        if not self.snap:
            return
        for f in FAMILIES:
            yield family_metric(f, self.snap)
