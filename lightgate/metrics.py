"""Operations figures: one snapshot of the gateway, exported to Prometheus and to `/api/stats`.

Nothing here runs per message. The components keep plain counters and `store.latency`
histograms; `Figures.snapshot()` reads them when someone asks (a scrape, the dashboard, the 1 s
sampler), and `GatewayCollector` turns the snapshot into `prometheus_client` metric families in
the gateway's own `CollectorRegistry` (never the process-global default registry: tests run
several gateways in one process). In the split shape the MQTT proxy's figures come over the core
link (STATS), so every metric has the same name in both shapes. docs/operations.md lists them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from store.latency import BOUNDS, LatencyHistogram
from store.mapping import is_system_topic

if TYPE_CHECKING:
    from lightgate.app import Gateway
    from store import Store
    from store.kafka_log import KafkaLog

# snapshot key -> (Prometheus name, help)
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "puback": (
        "lightgate_puback_latency_seconds",
        "MQTT QoS 1/2 PUBLISH parsed to PUBACK/PUBREC sent (durable), per message",
    ),
    "fsync": ("lightgate_fsync_latency_seconds", "One partition fsync of the group commit"),
    "dispatch_batch": (
        "lightgate_dispatch_batch_latency_seconds",
        "One dispatch round (read the log, index into light queues, one LevelDB write)",
    ),
    "publish_deliver": (
        "lightgate_publish_deliver_latency_seconds",
        "Broker receive to PUBLISH written to a subscriber, per delivered copy (ms resolution)",
    ),
    "gc_pause": (
        "lightgate_gc_pause_seconds",
        "One CPython garbage collection of the gateway process (its event loop stopped)",
    ),
    "kafka_produce": (
        "lightgate_kafka_produce_latency_seconds",
        "Kafka Produce request received to response ready (durable under acks>=1)",
    ),
}
PROBE_HOPS = ("durable", "indexed", "delivered", "end_to_end")
RETAINED_EVERY_S = 30.0  # the retained count is a LevelDB key scan: at most this often
RATE_WINDOW_S = 5.0


def hist_summary(h: LatencyHistogram) -> dict[str, Any]:
    """JSON form: raw buckets (for merging and Prometheus) plus the percentiles people read."""
    out: dict[str, Any] = {"count": h.count, "sum": round(h.sum, 6), "counts": list(h.counts)}
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
        v = h.quantile(q)
        out[name] = None if v is None else round(v, 6)
    return out


def _hist(d: dict[str, Any] | None) -> LatencyHistogram:
    h = LatencyHistogram()
    if d:
        h.merge(d)
    return h


class Figures:
    """Reads the gateway's components into one JSON-able snapshot; keeps 1 s samples for rates."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self._retained = (0, -RETAINED_EVERY_S)
        # Seeded at gateway start (`seed`): message counters start at zero there, log topics
        # at their record counts then, so the first seconds have rates too; a topic missing
        # from an older sample did not exist then (0 records).
        self._samples: deque[tuple[float, dict[str, float]]] = deque([(time.monotonic(), {})])
        self.rates: dict[str, Any] = {}

    def seed(self, store: Store | KafkaLog) -> None:
        recs = {f"topic.{t}": float(n) for t, (_b, n) in store.disk_usage().items()}
        self._samples = deque([(time.monotonic(), recs)])

    def _retained_count(self) -> int:
        count, at = self._retained
        now = time.monotonic()
        queues = self.gw.queues
        if queues is not None and now - at >= RETAINED_EVERY_S:
            count = queues.retained.count()
            self._retained = (count, now)
        return count

    async def snapshot(self) -> dict[str, Any]:
        gw = self.gw
        mstats, mmetrics = await gw.mqtt_figures()
        kstats: dict[str, Any] = gw.kafka.stats() if gw.kafka is not None else {}
        kmetrics: dict[str, Any] = gw.kafka.metrics() if gw.kafka is not None else {}
        store, queues = gw.store, gw.queues
        hists: dict[str, Any] = {}
        for key, d in (mmetrics.get("histograms") or {}).items():
            hists[key] = _hist(d)
        for key, d in (kmetrics.get("histograms") or {}).items():
            hists[key] = _hist(d)
        if store is not None:
            hists["fsync"] = store.fsync_latency
        if gw.gc_pauses is not None:
            hists["gc_pause"] = gw.gc_pauses.histogram
        topics: dict[str, dict[str, int]] = {}
        if store is not None:
            for t, (nbytes, nrec) in store.disk_usage().items():
                topics[t] = {"disk_bytes": nbytes, "records": nrec, "lag": 0}
        lag_total = 0
        if queues is not None:
            d = queues.dispatcher
            hists["dispatch_batch"] = d.round_latency
            for t, n in d.behind_by_topic().items():
                topics.setdefault(t, {"disk_bytes": 0, "records": 0, "lag": 0})["lag"] = n
                lag_total += n
        routed, handed = gw.notifier.routes.counts() if gw.notifier is not None else (0, 0)
        probe = gw.probe.histograms() if gw.probe is not None else {}
        snap: dict[str, Any] = {
            "version": gw.version,
            "time": round(time.time(), 3),
            "uptime_s": round(time.time() - gw.started_at, 1),
            "health": gw.health(),
            "connections": {
                "mqtt": mmetrics.get("connections", {}),
                "kafka": kstats.get("kafka_connections", 0),
            },
            "sessions": mmetrics.get("sessions", {"live": 0, "persistent": 0, "offline": 0}),
            "subscriptions": mmetrics.get("subscriptions", 0),
            "wildcard_queues": queues.stats()["lightqueue_filters"] if queues else 0,
            **_traffic(mstats, kstats),
            "retained": self._retained_count(),
            "kafka_responses": kmetrics.get("responses", []),
            "consumer_groups": kstats.get("kafka_groups", 0),
            "topics": topics,
            "dispatch_lag": lag_total,
            "disk_bytes": sum(t["disk_bytes"] for t in topics.values()),
            "notify": {"events": routed, "coalesced": max(0, routed - handed)},
            "cache": {
                "hits": mmetrics.get("cache_hits", 0),
                "misses": mmetrics.get("cache_misses", 0),
            },
            "latency": {k: hist_summary(h) for k, h in hists.items()},
            "probe": {hop: hist_summary(h) for hop, h in probe.items()},
            "bounds": list(BOUNDS),
            "flat": await gw.flat_metrics(mstats),
        }
        snap["bridges"] = bridge_figures(gw)
        snap["rates"] = self._rates(snap)
        return snap

    async def tick(self) -> None:
        """A rate sample (the health watch, every second): counters only, no histograms, no
        per-session walk, so an idle dashboard costs next to nothing."""
        gw = self.gw
        if gw.mqtt is not None:
            mstats = gw.mqtt.stats()
        elif gw.link is not None:
            mstats = (await gw.link.figures(with_metrics=False))[0]
        else:
            mstats = {}
        kstats = gw.kafka.stats() if gw.kafka is not None else {}
        topics = {}
        if gw.store is not None:
            topics = {t: {"records": n} for t, (_b, n) in gw.store.disk_usage().items()}
        self._rates({**_traffic(mstats, kstats), "topics": topics})

    def _rates(self, snap: dict[str, Any]) -> dict[str, Any]:
        """Per-second rates over the last RATE_WINDOW_S of samples (this one included)."""
        now = time.monotonic()
        cur: dict[str, float] = {}
        for kind in ("messages_in", "messages_out", "bytes_in", "bytes_out"):
            for proto, v in snap[kind].items():
                cur[f"{kind}.{proto}"] = v
        for t, f in snap["topics"].items():
            cur[f"topic.{t}"] = f["records"]
        samples = self._samples
        samples.append((now, cur))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, old = samples[0]
        dt = now - t0
        out: dict[str, Any] = {"window_s": round(dt, 2)}
        by_kind: dict[str, dict[str, float]] = {}
        topics: dict[str, float] = {}
        for key, v in cur.items():
            kind, _, name = key.partition(".")
            base = old.get(key, 0)
            r = round(max(0.0, v - base) / dt, 1) if dt > 0 else 0.0
            if kind == "topic":
                if not is_system_topic(name):  # device events, probes: not user topics
                    topics[name] = r
            else:
                by_kind.setdefault(kind, {})[name] = r
        out.update(by_kind)
        top = sorted(topics.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
        out["top_topics"] = [{"topic": t, "rate": r} for t, r in top]
        self.rates = out
        return out


def bridge_figures(gw: Gateway) -> list[dict[str, Any]]:
    """Each bridge's figures object, refreshed now (its lag is two LevelDB reads)."""
    if gw.bridges is None:
        return []
    out = []
    for b in gw.bridges.bridges:
        b.refresh()
        out.append(b.figures.as_dict())
    return out


def bridge_metrics(bridges: list[dict[str, Any]]) -> Iterator[Metric]:
    """`lightgate_bridge_*`, one series per bridge (labels: bridge, and direction)."""
    up = GaugeMetricFamily(
        "lightgate_bridge_connected",
        "1 while the bridge is connected to its remote",
        labels=["bridge"],
    )
    lag = GaugeMetricFamily(
        "lightgate_bridge_lag_messages",
        "Messages of the bridge's out rules the remote has not acknowledged yet",
        labels=["bridge"],
    )
    lag_s = GaugeMetricFamily(
        "lightgate_bridge_lag_seconds",
        "Age of the oldest message the remote has not acknowledged (0 when caught up)",
        labels=["bridge"],
    )
    msgs = CounterMetricFamily(
        "lightgate_bridge_messages_total",
        "Messages forwarded: out (log to remote) and in (remote to log)",
        labels=["bridge", "direction"],
    )
    rec = CounterMetricFamily(
        "lightgate_bridge_reconnects_total",
        "Connection attempts after the first",
        labels=["bridge"],
    )
    for b in bridges:
        name = b["name"]
        up.add_metric([name], int(b["connected"]))
        lag.add_metric([name], b["lag_messages"])
        lag_s.add_metric([name], b["lag_seconds"])
        msgs.add_metric([name, "out"], b["messages_out"])
        msgs.add_metric([name, "in"], b["messages_in"])
        rec.add_metric([name], b["reconnects"])
    yield from (up, lag, lag_s, msgs, rec)


def _traffic(mstats: dict[str, Any], kstats: dict[str, Any]) -> dict[str, dict[str, int]]:
    return {
        "messages_in": {
            "mqtt": mstats.get("messages_received", 0),
            "kafka": kstats.get("kafka_produce_records_total", 0),
        },
        "messages_out": {
            "mqtt": mstats.get("messages_sent", 0),
            "kafka": kstats.get("kafka_fetch_records_total", 0),
        },
        "bytes_in": {
            "mqtt": mstats.get("bytes_received", 0),
            "kafka": kstats.get("kafka_produce_bytes_total", 0),
        },
        "bytes_out": {
            "mqtt": mstats.get("bytes_sent", 0),
            "kafka": kstats.get("kafka_fetch_bytes_total", 0),
        },
    }


def _buckets(d: dict[str, Any]) -> list[tuple[str, float]]:
    out, acc = [], 0
    for bound, c in zip(list(BOUNDS) + [float("inf")], d["counts"], strict=True):
        acc += c
        out.append(("+Inf" if bound == float("inf") else repr(bound), acc))
    return out


class GatewayCollector(Collector):
    """prometheus_client collector over the last snapshot (`/metrics` refreshes it first)."""

    def __init__(self) -> None:
        self.snap: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        s = self.snap
        if not s:
            return
        yield from _legacy(s["flat"])
        g = GaugeMetricFamily(
            "lightgate_connections", "Open client connections", labels=["protocol", "version"]
        )
        for version, n in sorted(s["connections"]["mqtt"].items()):
            g.add_metric(["mqtt", version], n)
        g.add_metric(["kafka", ""], s["connections"]["kafka"])
        yield g
        g = GaugeMetricFamily("lightgate_sessions", "MQTT sessions", labels=["state"])
        for state, n in sorted(s["sessions"].items()):
            g.add_metric([state], n)
        yield g
        yield GaugeMetricFamily(
            "lightgate_subscriptions", "MQTT subscriptions", value=s["subscriptions"]
        )
        yield GaugeMetricFamily(
            "lightgate_wildcard_queues", "Light queues of wildcard filters", s["wildcard_queues"]
        )
        for kind, doc in (
            ("messages_in", "Messages received (MQTT PUBLISH, Kafka produced records)"),
            ("messages_out", "Messages sent (MQTT PUBLISH, Kafka fetched records)"),
            ("bytes_in", "Bytes received"),
            ("bytes_out", "Bytes sent"),
        ):
            c = CounterMetricFamily(f"lightgate_{kind}", doc, labels=["protocol"])
            for proto, n in sorted(s[kind].items()):
                c.add_metric([proto], n)
            yield c
        yield GaugeMetricFamily("lightgate_retained_messages", "Retained topics", s["retained"])
        c = CounterMetricFamily(
            "lightgate_kafka_responses", "Kafka responses", labels=["api", "error_code"]
        )
        for r in s["kafka_responses"]:
            c.add_metric([r["api"], str(r["error_code"])], r["count"])
        yield c
        yield GaugeMetricFamily(
            "lightgate_kafka_consumer_groups", "Kafka consumer groups", s["consumer_groups"]
        )
        disk = GaugeMetricFamily("lightgate_disk_bytes", "Segment bytes", labels=["topic"])
        recs = GaugeMetricFamily("lightgate_log_records", "Records in the log", labels=["topic"])
        lag = GaugeMetricFamily(
            "lightgate_dispatch_lag_records",
            "Log end minus dispatcher checkpoint",
            labels=["topic"],
        )
        for t, f in sorted(s["topics"].items()):
            disk.add_metric([t], f["disk_bytes"])
            recs.add_metric([t], f["records"])
            lag.add_metric([t], f["lag"])
        yield from (disk, recs, lag)
        yield CounterMetricFamily(
            "lightgate_notify_events", "Notify events routed to proxies", s["notify"]["events"]
        )
        yield CounterMetricFamily(
            "lightgate_notify_events_coalesced",
            "Notify events merged into a pending one",
            s["notify"]["coalesced"],
        )
        yield CounterMetricFamily(
            "lightgate_cache_hits",
            "Entries resolved from the recent-append cache",
            s["cache"]["hits"],
        )
        yield CounterMetricFamily(
            "lightgate_cache_misses", "Entries read from the store", s["cache"]["misses"]
        )
        for key, (name, doc) in HISTOGRAMS.items():
            d = s["latency"].get(key)
            h = HistogramMetricFamily(name, doc)
            if d is not None:
                h.add_metric([], _buckets(d), d["sum"])
            yield h
        h = HistogramMetricFamily(
            "lightgate_probe_latency_seconds",
            "Latency probes: publish to durable, indexed (dispatched and notified), delivered",
            labels=["hop"],
        )
        for hop, d in s["probe"].items():
            h.add_metric([hop], _buckets(d), d["sum"])
        yield h
        yield GaugeMetricFamily(
            "lightgate_up", "1 when /health says ok", int(s["health"]["status"] == "ok")
        )
        yield from bridge_metrics(s.get("bridges", []))


def _legacy(flat: dict[str, float | int]) -> Iterator[Metric]:
    """The figures /metrics had before (`lightgate_mqtt_*`, `lightgate_kafka_*_total`, ...)."""
    for key in sorted(flat):
        name = key if key.startswith("lightgate_") else f"lightgate_{key}"
        if name.endswith("_total"):
            yield CounterMetricFamily(name, name, value=flat[key])
        else:
            yield GaugeMetricFamily(name, name, value=flat[key])
