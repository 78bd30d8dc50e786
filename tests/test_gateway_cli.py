"""`lightgate serve` as users see it: ready line, ports, lock, HTTP endpoints, graceful stop."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

from gateway_process import ROOT, GatewayProcess, parse_ready_line


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_ready_line_lists_actual_ports(gateway: GatewayProcess) -> None:
    assert gateway.ready_line.startswith("lightgate ready ")
    for name in ("mqtt", "ws", "kafka", "http"):
        if name in gateway.endpoints:
            host, port = gateway.endpoints[name]
            assert host == "127.0.0.1" and port > 0
    assert "http" in gateway.endpoints and "kafka" in gateway.endpoints
    assert "mqtts" not in gateway.endpoints  # no certificate configured


def test_health_and_metrics(gateway: GatewayProcess) -> None:
    status, body = _get(gateway.port("http"), "/health")
    assert status == 200
    health = json.loads(body)
    assert health["status"] == "ok"
    assert health["listeners"]["kafka"].endswith(str(gateway.port("kafka")))
    status, body = _get(gateway.port("http"), "/metrics")
    assert status == 200
    assert b"lightgate_uptime_seconds" in body
    assert _get(gateway.port("http"), "/nope")[0] == 404


def test_second_serve_on_same_dir_fails_clearly(gateway: GatewayProcess, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--data-dir", str(gateway.data_dir),
         "--mqtt-port", "0", "--ws-port", "0", "--kafka-port", "0", "--http-port", "0"],
        cwd=ROOT, capture_output=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert b"locked" in proc.stderr
    assert b"lightgate ready" not in proc.stdout


def test_disabled_listener_left_out_and_graceful_stop(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    gw = gateway_factory(None, "--kafka-port", "-1")
    assert "kafka" not in gw.endpoints
    assert gw.stop() == 0


def test_parse_ready_line() -> None:
    line = "lightgate ready mqtt=127.0.0.1:1883 ws=127.0.0.1:8083 kafka=127.0.0.1:9092 http=127.0.0.1:8080"
    assert parse_ready_line(line) == {
        "mqtt": ("127.0.0.1", 1883),
        "ws": ("127.0.0.1", 8083),
        "kafka": ("127.0.0.1", 9092),
        "http": ("127.0.0.1", 8080),
    }


def test_help_lists_every_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--help"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    for flag in ("--config", "--data-dir", "--host", "--mqtt-port", "--mqtts-port", "--ws-port",
                 "--kafka-port", "--http-port"):  # fmt: skip
        assert flag in out
