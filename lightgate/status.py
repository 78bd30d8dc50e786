"""`lightgate status`: a running gateway's key figures from its `/api/stats`, as a terminal table.

Exit status: 0 healthy, 1 unhealthy (the reasons are printed), 2 unreachable. `--watch` redraws
every interval until Ctrl-C (`--count` stops after that many frames, for scripts).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

LATENCY_ROWS = (
    ("puback", "MQTT PUBACK (durable)"),
    ("publish_deliver", "publish → deliver"),
    ("fsync", "fsync"),
    ("dispatch_batch", "dispatch round"),
    ("kafka_produce", "Kafka produce"),
)


def fetch(url: str, timeout: float = 5.0) -> dict[str, Any]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    with opener.open(url.rstrip("/") + "/api/stats", timeout=timeout) as r:
        return dict(json.loads(r.read()))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d" if d else "") + f"{h:02d}:{m:02d}:{s:02d}"


def render(st: dict[str, Any], url: str) -> str:
    """The table for one `/api/stats` answer (pure: tests compare it with the JSON)."""
    h = st["health"]
    rates = st.get("rates", {})
    mqtt_conns = sum(st["connections"]["mqtt"].values())
    lines = [
        f"lightgate {st['version']}  {url}  {h['status'].upper()}  up {_uptime(st['uptime_s'])}",
    ]
    for r in h.get("reasons", []):
        lines.append(f"  ! {r}")
    lines.append("")
    lines.append(f"{'':22}{'mqtt':>12}{'kafka':>12}")
    lines.append(f"{'connections':22}{mqtt_conns:>12}{st['connections']['kafka']:>12}")
    for key, label in (("messages_in", "messages in /s"), ("messages_out", "messages out /s")):
        r = rates.get(key, {})
        lines.append(f"{label:22}{r.get('mqtt', 0.0):>12.1f}{r.get('kafka', 0.0):>12.1f}")
    for key, label in (
        ("messages_in", "messages in total"),
        ("messages_out", "messages out total"),
    ):
        v = st[key]
        lines.append(f"{label:22}{v.get('mqtt', 0):>12}{v.get('kafka', 0):>12}")
    s = st["sessions"]
    lines.append("")
    lines.append(
        f"sessions {s.get('live', 0)} live, {s.get('persistent', 0)} persistent, "
        f"{s.get('offline', 0)} offline; subscriptions {st['subscriptions']}; "
        f"wildcard queues {st['wildcard_queues']}; retained {st['retained']}"
    )
    lines.append(
        f"dispatch lag {st['dispatch_lag']} records; disk {_bytes(st['disk_bytes'])}; "
        f"consumer groups {st['consumer_groups']}"
    )
    lines.append("")
    lines.append(f"{'latency (ms)':22}{'p50':>9}{'p90':>9}{'p99':>9}{'count':>10}")
    rows = [(label, st["latency"].get(k)) for k, label in LATENCY_ROWS]
    rows += [(f"probe {hop}", d) for hop, d in st.get("probe", {}).items()]
    for label, d in rows:
        if d is None:
            continue
        lines.append(
            f"{label:22}{_ms(d['p50']):>9}{_ms(d['p90']):>9}{_ms(d['p99']):>9}{d['count']:>10}"
        )
    top = rates.get("top_topics", [])
    if top:
        lines.append("")
        lines.append("top topics (records/s)")
        for t in top[:5]:
            lines.append(f"  {t['topic']:30}{t['rate']:>10.1f}")
    bridges = st.get("bridges", [])
    if bridges:
        lines.append("")
        lines.append(
            f"{'bridge':16}{'state':>8}{'lag':>9}{'lag s':>9}{'out':>10}{'in':>10}  remote"
        )
        for b in bridges:
            state = "up" if b["connected"] else "down"
            lines.append(
                f"{b['name']:16}{state:>8}{b['lag_messages']:>9}{b['lag_seconds']:>9.1f}"
                f"{b['messages_out']:>10}{b['messages_in']:>10}  {b['remote']}"
            )
            if b["last_error"]:
                lines.append(f"  ! {b['name']}: {b['last_error']}")
    return "\n".join(lines)


def main(url: str, watch: float | None = None, count: int = 0) -> int:
    frames = 0
    code = 0
    while True:
        try:
            st = fetch(url)
        except (OSError, urllib.error.URLError, ValueError) as exc:
            print(f"lightgate status: cannot read {url}/api/stats: {exc}", file=sys.stderr)
            code = 2
        else:
            text = render(st, url)
            if watch:
                sys.stdout.write("\x1b[H\x1b[2J")  # home + clear: redraw in place
            print(text, flush=True)
            code = 0 if st["health"]["status"] == "ok" else 1
        frames += 1
        if not watch or (count and frames >= count):
            return code
        try:
            time.sleep(watch)
        except KeyboardInterrupt:
            return code
