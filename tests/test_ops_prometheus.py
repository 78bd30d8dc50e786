"""/metrics as Prometheus sees it: `promtool check metrics` on a real scrape, the exported
families equal the table (lightgate/metric_families.py) and the generated docs, internal
clients never counted, the alerting rules under `promtool test rules`, the Grafana dashboard's
queries naming exported metrics, and Debian's Prometheus server scraping a running gateway."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_process import ROOT, GatewayProcess
from mqtt_helpers import V5, V311, Client
from ops_helpers import get, sample, scrape, stats, total, wait_for
from prometheus_client.parser import text_string_to_metric_families

from lightgate import metrics_docs
from lightgate.metric_families import FAMILIES
from lightgate.status import render

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
NEEDS_PROMETHEUS = "needs Debian's prometheus (promtool; scripts/system-deps.sh installs it)"
RULES = ROOT / "docs" / "prometheus"
# Families of other subsystems the rules may name before the gateway exports them (none now).
PLANNED: set[str] = set()
N_CLIENTS = 7


def _families(text: str) -> dict[str, str]:
    """Family name as exposed (counters with `_total`) -> type."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name + ("_total" if fam.type == "counter" else "")] = fam.type
    return out


def _exported_names() -> set[str]:
    """Every family and sample name /metrics can carry (histograms' `_bucket`, `_sum`,
    `_count`)."""
    names = {f.name for f in FAMILIES}
    for f in FAMILIES:
        if f.kind == "histogram":
            names |= {f"{f.name}_bucket", f"{f.name}_sum", f"{f.name}_count"}
    return names


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\blightgate_[a-z0-9_]+", expr))


def _clients(port: int, n: int) -> list[Client]:
    out = []
    for i in range(n):
        c = Client(port, f"dev-{i}", version=V5 if i % 2 else V311).connect()
        c.subscribe(f"fleet/{i}/cmd", qos=1)
        out.append(c)
    return out


def test_the_docs_list_every_family() -> None:
    """docs/operations.md's metric table is generated from the table the collector yields
    (`python -m lightgate.metrics_docs` rewrites it)."""
    have = metrics_docs.DOCS.read_text()
    assert have == metrics_docs.docs_text(have), "run: python -m lightgate.metrics_docs"
    for f in FAMILIES:
        assert f.kind != "counter" or f.name.endswith("_total"), f.name
        assert f.kind == "counter" or not f.name.endswith("_total"), f.name
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.skipif(PROMTOOL is None, reason=NEEDS_PROMETHEUS)
def test_promtool_passes_a_real_scrape_and_clients_are_counted_right(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    """With probes every 100 ms: an idle gateway reports 0 clients; with 7 real clients every
    user figure (/metrics, /api/stats, `lightgate status`) says 7, and the probe is in the
    internal families only. The scrape passes `promtool check metrics` and has exactly the
    families of the table, each with its type."""
    gw = gateway_factory(None, "--set", "probe_interval_ms=100")
    http, port = gw.port("http"), gw.port("mqtt")
    wait_for(lambda: sample(scrape(http), "lightgate_probe_delivered_total") >= 3, what="probes")
    m = scrape(http)
    idle = (("process", "core"), ("protocol", "mqtt"), ("version", "3.1.1"))
    assert m[("lightgate_connections", idle)] == 0  # a zero, not a missing series
    assert total(m, "lightgate_connections", protocol="mqtt") == 0
    assert total(m, "lightgate_sessions") == 0
    assert total(m, "lightgate_subscriptions") == 0
    assert total(m, "lightgate_messages_total") == 0
    assert total(m, "lightgate_bytes_total") == 0
    assert total(m, "lightgate_mqtt_connects_total") == 0
    assert total(m, "lightgate_internal_connections") == 1
    assert total(m, "lightgate_internal_messages_total", direction="in") >= 3
    assert total(m, "lightgate_internal_bytes_total", direction="in") > 0
    assert not [k for k in m if k[0] == "lightgate_topic_records"]  # no user topic yet
    assert sample(m, "lightgate_internal_topic_records", topic="__lightgate_probe") >= 3
    st = stats(http)
    assert st["connections"]["mqtt"] == {} and st["sessions"]["live"] == 0
    assert st["messages_in"]["mqtt"] == 0 and st["topics"] == {}

    clients = _clients(port, N_CLIENTS)
    for i, c in enumerate(clients):
        c.publish(f"fleet/{i}/state", b"on", qos=1)
    wait_for(
        lambda: (
            total(scrape(http), "lightgate_messages_total", protocol="mqtt", direction="in")
            == N_CLIENTS
        ),
        what="the publishes counted",
    )
    time.sleep(0.5)  # a few more probes: they must not show anywhere below
    status, body = get(http, "/metrics")
    assert status == 200
    m = scrape(http)
    assert total(m, "lightgate_connections", protocol="mqtt") == N_CLIENTS
    assert total(m, "lightgate_connections", protocol="mqtt", process="core") == N_CLIENTS
    assert total(m, "lightgate_sessions", state="live") == N_CLIENTS
    assert total(m, "lightgate_subscriptions") == N_CLIENTS
    assert total(m, "lightgate_mqtt_connects_total") == N_CLIENTS
    assert total(m, "lightgate_mqtt_subscribes_total") == N_CLIENTS
    assert total(m, "lightgate_messages_total", protocol="mqtt", direction="in") == N_CLIENTS
    assert total(m, "lightgate_messages_total", protocol="mqtt", direction="out") == 0
    assert total(m, "lightgate_internal_connections") == 1
    assert {t for (n, ls), _v in m.items() if n == "lightgate_topic_records" for _k, t in ls} == {
        "fleet"
    }
    st = stats(http)
    assert sum(st["connections"]["mqtt"].values()) == N_CLIENTS
    assert st["sessions"]["live"] == N_CLIENTS and st["subscriptions"] == N_CLIENTS
    assert st["messages_in"]["mqtt"] == N_CLIENTS
    assert [t["topic"] for t in st["rates"]["top_topics"]] in ([], ["fleet"])
    table = render(st, "http://x")
    assert re.search(rf"^connections\s+{N_CLIENTS}\s+0$", table, re.M), table

    # promtool's lint (counter names, units, help, duplicates) on this very scrape.
    assert PROMTOOL is not None
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=body, capture_output=True, timeout=60
    )
    assert check.returncode == 0 and not check.stdout.strip() and not check.stderr.strip(), (
        check.stdout.decode() + check.stderr.decode()
    )
    # Exactly the families of the table, with their types; Kafka is on, so its are filled.
    families = _families(body.decode())
    assert families == {f.name: f.kind for f in FAMILIES}
    for name in ("lightgate_kafka_requests_total", "lightgate_data_dir_free_bytes"):
        assert (name, ()) in m, name
    for c in clients:
        c.disconnect()
    wait_for(lambda: total(scrape(http), "lightgate_connections", protocol="mqtt") == 0)


def test_several_proxies_label_their_figures(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """`mqtt_processes = 2` with probes on: each proxy's figures carry its id, their sum is
    every client (the probe, on one of the proxies, only in the internal families), and
    /api/stats shows the sum."""
    gw = gateway_factory(
        tmp_path / "two", "--set", "mqtt_processes=2", "--set", "probe_interval_ms=100"
    )
    http = gw.port("http")
    clients = _clients(gw.port("mqtt"), N_CLIENTS)
    for i, c in enumerate(clients):
        c.publish(f"fleet/{i}/state", b"on", qos=1)

    def counted() -> bool:
        m = scrape(http)
        return total(m, "lightgate_messages_total", protocol="mqtt", direction="in") == N_CLIENTS

    wait_for(counted, what="every proxy's counters")
    m = scrape(http)
    per_process = {
        dict(ls)["process"]: v for (n, ls), v in m.items() if n == "lightgate_mqtt_connects_total"
    }
    assert set(per_process) <= {"mqtt-1", "mqtt-2"} and sum(per_process.values()) == N_CLIENTS
    assert total(m, "lightgate_connections", protocol="mqtt") == N_CLIENTS
    assert sample(m, "lightgate_core_link_proxies") == 2
    wait_for(lambda: total(scrape(http), "lightgate_internal_connections") == 1, what="probe")
    assert total(scrape(http), "lightgate_connections", protocol="mqtt") == N_CLIENTS
    st = stats(http)
    assert sum(st["connections"]["mqtt"].values()) == N_CLIENTS
    assert st["messages_in"]["mqtt"] == N_CLIENTS
    assert "processes" not in st
    for c in clients:
        c.disconnect()


def test_refused_connects_are_counted_by_reason(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """Wrong passwords and anonymous clients are `bad_credentials` and `not_authorized` in
    `lightgate_mqtt_connect_refused_total{reason}` (the authentication-failure alert's family);
    the probe, refused too without a user name, is not counted there."""
    users = tmp_path / "passwords"
    made = subprocess.run(
        [sys.executable, "-m", "lightgate", "passwd", "-c", "-b", str(users), "alice", "pw"],
        cwd=ROOT, capture_output=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    gw = gateway_factory(None, "--set", f"password_file={users}", "--set", "probe_interval_ms=100")
    port, http = gw.port("mqtt"), gw.port("http")
    for i, (name, pw) in enumerate([("alice", "wrong"), ("mallory", "pw"), (None, None)]):
        c = Client(port, f"refused-{i}", V311)
        c.connect(username=name, password=pw, expect_ok=False)
        c.paho.loop_stop()
    ok = Client(port, "ok", V5).connect(username="alice", password="pw")
    wait_for(
        lambda: total(scrape(http), "lightgate_mqtt_connect_refused_total") >= 3,
        what="the refusals counted",
    )
    time.sleep(0.5)  # the probe keeps trying meanwhile
    m = scrape(http)
    assert total(m, "lightgate_mqtt_connect_refused_total", reason="bad_credentials") == 2
    assert total(m, "lightgate_mqtt_connect_refused_total", reason="not_authorized") == 1
    assert total(m, "lightgate_mqtt_connect_refused_total") == 3
    assert total(m, "lightgate_mqtt_connects_total") == 1
    assert total(m, "lightgate_connections", protocol="mqtt") == 1
    ok.disconnect()


@pytest.mark.skipif(PROMTOOL is None, reason=NEEDS_PROMETHEUS)
def test_alerting_rules_pass_their_tests() -> None:
    """`promtool test rules`: every alert fires on the series meant to fire it and not on the
    others (docs/prometheus/alerts_test.yml); every metric they name is exported."""
    assert PROMTOOL is not None
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        run = subprocess.run(
            [PROMTOOL, *args], cwd=RULES, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stdout + run.stderr
    rules = (RULES / "alerts.yml").read_text()
    named = _metric_names(rules)
    assert named - _exported_names() <= PLANNED, named - _exported_names()
    tested = (RULES / "alerts_test.yml").read_text()
    for alert in re.findall(r"- alert: (\w+)", rules):
        assert f"alertname: {alert}" in tested, f"{alert} has no test"
    assert _metric_names(tested) - _exported_names() <= PLANNED


def _dashboard_queries() -> list[str]:
    dash = json.loads((RULES / "grafana-dashboard.json").read_text())
    out = []

    def walk(panels: list[dict[str, object]]) -> Iterator[dict[str, object]]:
        for p in panels:
            yield p
            yield from walk(p.get("panels", []))  # type: ignore[arg-type]

    for p in walk(dash["panels"]):
        for t in p.get("targets", []):  # type: ignore[attr-defined]
            out.append(t["expr"])
    return out


def test_grafana_dashboard_names_exported_metrics() -> None:
    queries = _dashboard_queries()
    assert len(queries) > 20
    exported = _exported_names()
    for q in queries:
        names = _metric_names(q)
        assert names, q
        assert names <= exported, (q, names - exported)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _query(port: int, expr: str) -> dict[str, object]:
    q = urllib.parse.urlencode({"query": expr})
    status, body = get(port, f"/api/v1/query?{q}")
    answer: dict[str, object] = json.loads(body)
    assert status == 200 and answer["status"] == "success", (expr, body[:500])
    return answer


@pytest.mark.skipif(PROMETHEUS is None, reason=NEEDS_PROMETHEUS)
def test_a_real_prometheus_counts_the_clients(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """Debian's Prometheus scrapes the gateway every second with the shipped rules loaded; a
    PromQL query over its HTTP API returns the clients this test connected, and every query of
    the Grafana dashboard and of the rules is valid PromQL there."""
    gw = gateway_factory(None, "--set", "probe_interval_ms=200")
    clients = _clients(gw.port("mqtt"), N_CLIENTS)
    prom_port = _free_port()
    shutil.copy(RULES / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "rule_files: [alerts.yml]\n"
        "scrape_configs:\n"
        "  - job_name: lightgate\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{gw.port('http')}']}}]\n"
    )
    assert PROMETHEUS is not None
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - the child writes it
    prom = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"],
        stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
    )  # fmt: skip
    try:
        expr = 'sum(lightgate_connections{job="lightgate", protocol="mqtt"})'

        def clients_seen() -> float | None:
            try:
                result = _query(prom_port, expr)["data"]["result"]  # type: ignore[index]
            except (OSError, ValueError, AssertionError):
                return None
            return float(result[0]["value"][1]) if result else None

        wait_for(lambda: clients_seen() == N_CLIENTS, timeout=60, what="Prometheus's answer")
        assert clients_seen() == N_CLIENTS
        up = _query(prom_port, 'up{job="lightgate"}')["data"]["result"]  # type: ignore[index]
        assert float(up[0]["value"][1]) == 1
        for q in _dashboard_queries():
            _query(prom_port, q.replace("$__rate_interval", "1m").replace("$instance", ".*"))
        status, body = get(prom_port, "/api/v1/rules")
        groups = json.loads(body)["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert rules and all(r["health"] != "err" for r in rules), rules
        firing = [r["name"] for r in rules if r["state"] == "firing"]
        assert "LightgateDown" not in firing and "LightgateUnhealthy" not in firing
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        log.close()
        for c in clients:
            c.disconnect()
