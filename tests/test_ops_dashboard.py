"""The dashboard at `/` in headless Chromium: loaded while paho clients publish it shows non-zero
rates (and a screenshot lands in the test's temp dir); loaded once they stop, every figure it
shows equals /api/stats and /metrics. The page's numbers are read from `--dump-dom` (each
figure carries `data-k`, its path in the /api/stats JSON)."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import Client
from ops_helpers import get, sample, scrape, stats, total, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/system-deps.sh installs it)"
)


def _chromium(url: str, *args: str) -> str:
    assert CHROMIUM is not None
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-proxy-server",
         "--no-first-run", "--virtual-time-budget=3000", *args, url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def _figures(url: str, *args: str) -> dict[str, str]:
    """The figures of the page's first rendered /api/stats answer (and, as `clipped`, what it
    found cut at the window's edge). Chromium's virtual time can run out before a slow answer
    arrives on a loaded machine: then try again."""
    for _ in range(3):
        dom = _chromium(url, *args, "--dump-dom")
        if 'data-ready="1"' in dom:
            out = dict(re.findall(r'data-k="([^"]+)"[^>]*>([^<]*)<', dom))
            out["clipped"] = re.findall(r'data-clipped="([^"]*)"', dom)[0]
            return out
    raise AssertionError("the page never rendered a /api/stats answer")


def test_dashboard_in_chromium(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gw = gateway_factory()
    http = gw.port("http")
    url = f"http://127.0.0.1:{http}/"
    status, page = get(http, "/")
    assert status == 200 and b"<script>" in page
    assert b"http://" not in page and b"https://" not in page  # nothing loaded from elsewhere

    sub = Client(gw.port("mqtt"), "dash-sub").connect()
    sub.subscribe("load/#", qos=1)
    pub = Client(gw.port("mqtt"), "dash-pub").connect()
    stop = threading.Event()
    sent = [0]

    # A long topic name and wide numbers in the per-topic table: it must still fit 1280 px.
    long_topic = "factory_floor_7.building_b.assembly_line_42.press_station.sensors_t/t"
    sub.subscribe(long_topic, qos=1)

    def load() -> None:
        while not stop.is_set():
            pub.publish(long_topic if sent[0] % 4 == 3 else "load/a", b"x" * 32, qos=1)
            sent[0] += 1
            stop.wait(0.005)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_for(lambda: stats(http)["rates"]["messages_in"]["mqtt"] > 0, 30, what="load")
        busy = _figures(url, "--window-size=1280,1000")
        png = tmp_path / "dashboard.png"
        _chromium(url, "--window-size=1280,1000", f"--screenshot={png}")
    finally:
        stop.set()
        loader.join()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert float(busy["rates.messages_in.mqtt"]) > 0
    assert float(busy["rates.messages_out.mqtt"]) > 0
    assert float(busy["top.load"]) > 0  # the top-topics table
    assert float(busy[f"top.{long_topic.split('/')[0]}"]) > 0
    assert busy["clipped"] == "", f"cut at the edge of 1280 px: {busy['clipped']}"

    # Quiet: everything delivered; then the page and /api/stats and /metrics agree.
    wait_for(
        lambda: stats(http)["messages_out"]["mqtt"] == sent[0], timeout=30, what="all delivered"
    )
    shown = _figures(url)
    st = stats(http)
    m = scrape(http)
    n = sent[0]
    assert shown["messages_in.mqtt"] == str(n) == str(st["messages_in"]["mqtt"])
    assert shown["messages_out.mqtt"] == str(n)
    assert total(m, "lightgate_messages_total", protocol="mqtt", direction="in") == n
    assert shown["connections.mqtt.total"] == "2"
    assert total(m, "lightgate_connections", protocol="mqtt", version="3.1.1") == 2
    assert shown["connections.kafka"] == "0"
    for key in ("sessions.live", "subscriptions", "wildcard_queues", "dispatch_lag"):
        value = st
        for part in key.split("."):
            value = value[part]
        assert shown[key] == str(value), key
    assert shown["topics.load.disk_bytes"] == str(st["topics"]["load"]["disk_bytes"])
    disk = sample(m, "lightgate_topic_disk_bytes", topic="load")
    assert float(shown["topics.load.disk_bytes"]) == disk
    for hop in ("puback", "publish_deliver"):
        d = st["latency"][hop]
        assert shown[f"latency.{hop}.count"] == str(d["count"]) == str(n)
        for q in ("p50", "p90", "p99"):
            # two decimals: JS toFixed rounds an exact tie such as 31.125 up, Python's format
            # to even; both are the API's value to the hundredth
            got = shown[f"latency.{hop}.{q}"]
            assert abs(float(got) - d[q] * 1000) <= 0.005 + 1e-9, (hop, q, got, d[q])
    assert total(m, "lightgate_puback_latency_seconds_count") == n
    assert shown["health.status"] == "ok"
    sub.disconnect()
    pub.disconnect()


def test_dashboard_counts_clients_not_the_probe(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    """Probes every 100 ms and three clients: the page says three connections, sessions and
    subscriptions (the probe is one more of each inside the gateway), as /metrics does."""
    gw = gateway_factory(None, "--set", "probe_interval_ms=100")
    http = gw.port("http")
    wait_for(lambda: sample(scrape(http), "lightgate_probe_delivered_total") >= 3, what="probes")
    clients = [Client(gw.port("mqtt"), f"dev-{i}").connect() for i in range(3)]
    for i, c in enumerate(clients):
        c.subscribe(f"dev/{i}/cmd", qos=1)
    shown = _figures(f"http://127.0.0.1:{http}/", "--window-size=1280,1000")
    assert shown["connections.mqtt.total"] == "3"
    assert shown["sessions.live"] == "3"
    assert shown["subscriptions"] == "3"
    assert shown["messages_in.mqtt"] == "0"
    assert shown["clipped"] == ""
    m = scrape(http)
    assert total(m, "lightgate_connections", protocol="mqtt") == 3
    assert total(m, "lightgate_internal_connections") == 1
    for c in clients:
        c.disconnect()
