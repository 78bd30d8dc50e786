"""Operations figures: one snapshot of the gateway, exported to Prometheus and to `/api/stats`.

Nothing here runs per message. The components keep plain counters and `store.latency`
histograms; `Figures.snapshot()` reads them when someone asks (a scrape, the dashboard, the 1 s
sampler), and `lightgate.metric_families` turns the snapshot into `prometheus_client` metric
families in the gateway's own `CollectorRegistry` (never the process-global default registry:
tests run several gateways in one process).

MQTT figures are kept per process (`processes`: "core" for the proxy inside `serve`, else each
proxy's id, over the core link), so /metrics labels them and Prometheus's `sum()` and `rate()`
stay right when one proxy restarts; `/api/stats` shows their sums, the whole gateway. Internal
clients (latency probes) and internal topics (device events, probes) are never in users'
figures: they have their own keys here and their own families there.
"""

from __future__ import annotations

import os
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from lightgate.figure_sums import summed, summed_stats
from store.latency import BOUNDS, LatencyHistogram
from store.mapping import is_system_topic

if TYPE_CHECKING:
    from lightgate.app import Gateway
    from store import Store
    from store.cluster.kafka_log import KafkaLog

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
        processes = await gw.mqtt_processes()
        mstats = summed_stats([st for st, _m in processes.values()])
        mmetrics: dict[str, Any] = {}
        for _st, m in processes.values():
            mmetrics = summed(mmetrics, m)
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
        internal_topics: dict[str, dict[str, int]] = {}
        if store is not None:
            for t, (nbytes, nrec) in store.disk_usage().items():
                into = internal_topics if is_system_topic(t) else topics
                into[t] = {"disk_bytes": nbytes, "records": nrec, "lag": 0}
        lag_total = 0
        if queues is not None:
            d = queues.dispatcher
            hists["dispatch_batch"] = d.round_latency
            for t, n in d.behind_by_topic().items():
                into = internal_topics if is_system_topic(t) else topics
                into.setdefault(t, {"disk_bytes": 0, "records": 0, "lag": 0})["lag"] = n
                lag_total += n
        routed, handed = gw.notifier.routes.counts() if gw.notifier is not None else (0, 0)
        probe = gw.probe
        snap: dict[str, Any] = {
            "version": gw.version,
            "time": round(time.time(), 3),
            "started_at": round(gw.started_at, 3),
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
            "internal_topics": internal_topics,
            "dispatch_lag": lag_total,
            "disk_bytes": sum(
                t["disk_bytes"] for t in (*topics.values(), *internal_topics.values())
            ),
            "data_dir": _data_dir(gw.cfg.data_path),
            "notify": {"events": routed, "coalesced": max(0, routed - handed)},
            "cache": {
                "hits": mmetrics.get("cache_hits", 0),
                "misses": mmetrics.get("cache_misses", 0),
            },
            "latency": {k: hist_summary(h) for k, h in hists.items()},
            "probe": {hop: hist_summary(h) for hop, h in probe.histograms().items()}
            if probe is not None
            else {},
            "probe_counts": {
                "sent": probe.sent,
                "delivered": probe.delivered,
                "connected": int(probe.connected),
            }
            if probe is not None
            else None,
            "internal": mmetrics.get("internal", {}),
            "bounds": list(BOUNDS),
            # Below: for /metrics only (`/api/stats` leaves them out).
            "processes": processes,
            "lightqueue": queues.stats() if queues is not None else {},
            "kafka": kstats,
            "kafka_log": store.stats() if isinstance(store, _HasStats) else {},
            "cluster_sessions": dict(gw.cluster_sessions.counters)
            if gw.cluster_sessions is not None
            else {},
            "core_link_proxies": len(gw.link.proxies) if gw.link is not None else None,
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
            mstats = await gw.link.stats()
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


def _data_dir(path: Path) -> dict[str, int]:
    """The data directory's file system: free bytes (for unprivileged users) and its size."""
    try:
        st = os.statvfs(path)
    except OSError:
        return {"free_bytes": 0, "size_bytes": 0}
    return {"free_bytes": st.f_bavail * st.f_frsize, "size_bytes": st.f_blocks * st.f_frsize}


@runtime_checkable
class _HasStats(Protocol):
    """A log with figures of its own (`store.cluster.kafka_log.KafkaLog`, with log = "kafka")."""

    def stats(self) -> dict[str, int]: ...
