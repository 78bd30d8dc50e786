"""`lightgate serve` as users see it: ready line, ports, lock, HTTP endpoints, graceful stop."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from gateway_process import ROOT, GatewayProcess, parse_ready_line
from mqtt_broker import make_tls_context


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
    assert b"lightgate_start_time_seconds" in body
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


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m lightgate serve ...` on free ports, for commands expected to fail at start."""
    return subprocess.run(
        [sys.executable, "-m", "lightgate", "serve", "--mqtt-port", "0", "--ws-port", "0",
         "--kafka-port", "0", "--http-port", "0", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "LIGHTGATE_LOG_FORMAT": "text", **(env or {})},
    )  # fmt: skip


def _one_clean_line(proc: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightgate: "), proc.stderr
    for part in parts:
        assert part in lines[0], (part, lines[0])
    assert "lightgate ready" not in proc.stdout


@pytest.mark.parametrize(
    ("setting", "parts"),
    [
        ("receive_maximum=0", ("receive_maximum", "1..65535")),
        ("receive_maximum=-5", ("receive_maximum", "-5", "1..65535")),
        ("log_level=verbose", ("log_level", "verbose", "debug, info, warning, error")),
        ("segment_bytes=10", ("segment_bytes", "65536..")),
        ("gc_gen0=-1", ("gc_gen0", "0..")),
        ("fsync_interval_ms=0", ("fsync_interval_ms", "1..")),
        ("mqtt_prot=1884", ("unknown key 'mqtt_prot'", "did you mean 'mqtt_port'")),
    ],
)
def test_serve_refuses_a_bad_setting_in_one_line(
    setting: str, parts: tuple[str, ...], tmp_path: Path
) -> None:
    _one_clean_line(_serve("--data-dir", str(tmp_path / "d"), "--set", setting), *parts)


def test_unknown_toml_key_suggests_the_closest(tmp_path: Path) -> None:
    conf = tmp_path / "lg.toml"
    conf.write_text("recieve_maximum = 10\n")
    proc = _serve("--data-dir", str(tmp_path / "d"), "--config", str(conf))
    _one_clean_line(proc, str(conf), "'recieve_maximum'", "did you mean 'receive_maximum'")


def test_data_dir_that_is_a_file_is_named(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    _one_clean_line(_serve("--data-dir", str(afile)), f"data_dir {afile}", "not a directory")
    nested = afile / "data"
    _one_clean_line(_serve("--data-dir", str(nested)), str(nested), f"{afile} is not a directory")


def test_bad_host_is_named(tmp_path: Path) -> None:
    proc = _serve("--data-dir", str(tmp_path / "d"), "--host", "no-such-host.invalid")
    _one_clean_line(proc, "host 'no-such-host.invalid'", "cannot resolve")


@pytest.mark.parametrize("shape", [[], ["--set", "mqtt_processes=1"]], ids=["serve", "split"])
def test_tls_file_errors_name_the_file(tmp_path: Path, shape: list[str]) -> None:
    make_tls_context(tmp_path)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    data = str(tmp_path / "d")
    missing = tmp_path / "missing-key.pem"
    proc = _serve("--data-dir", data, "--set", f"tls_cert={cert}", "--set", f"tls_key={missing}",
                  *shape)  # fmt: skip
    _one_clean_line(proc, "tls_key", str(missing))
    # A cert and key that do not belong together: ssl says "PEM lib"; we add both paths.
    proc = _serve("--data-dir", data, "--set", f"tls_cert={cert}", "--set", f"tls_key={cert}",
                  *shape)  # fmt: skip
    _one_clean_line(proc, str(cert), "cannot load")
    assert key.exists()


def test_unknown_lightgate_env_var_is_warned_about(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    gw = gateway_factory(
        None, LIGHTGATE_MQTT_PROT="1884", LIGHTGATE_CONFIG="", LIGHTGATE_TEST_INPROCESS="0"
    )
    warned = [line for line in gw.log_text().splitlines() if "LIGHTGATE_" in line]
    assert len(warned) == 1, warned
    assert "LIGHTGATE_MQTT_PROT" in warned[0] and "LIGHTGATE_MQTT_PORT" in warned[0]
    assert "warning" in warned[0]
    assert gw.port("mqtt") != 1884  # ignored, not guessed


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "lightgate", "--version"], cwd=ROOT, capture_output=True,
        text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert out.strip() == f"lightgate {importlib.metadata.version('lightgate')}"


def test_make_run_passes_args_through() -> None:
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "run", "ARGS=--mqtt-port 1884 --set fsync=never"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert (
        out.strip().splitlines()[-1].endswith("lightgate serve --mqtt-port 1884 --set fsync=never")
    )


def test_serve_runs_on_the_example_config(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """The README's `cp lightgate.example.toml lightgate.toml; serve --config lightgate.toml`
    starts (flags still override the file: free ports and a tmp data dir here)."""
    conf = tmp_path / "lightgate.toml"
    conf.write_bytes((ROOT / "lightgate.example.toml").read_bytes())
    gw = gateway_factory(None, "--config", str(conf))
    assert {"mqtt", "ws", "kafka", "http"} <= set(gw.endpoints)
    assert "warning" not in gw.log_text()
    assert gw.stop() == 0


def test_rebuild_queues_names_a_bad_data_dir(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for data_dir, part in ((afile, "not a directory"), (tmp_path / "none", "no such directory")):
        proc = subprocess.run(
            [sys.executable, "-m", "lightgate", "rebuild-queues", "--data-dir", str(data_dir)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        _one_clean_line(proc, f"data_dir {data_dir}", part)
    assert not (tmp_path / "none").exists()


def test_rebuild_queues_progress_reaches_100_and_leaves_clean_lines(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """Connects and disconnects write device events to the log that index nothing: the bar
    still ends at 100 % (it counts log offsets), and the log line after it starts a line."""
    import paho.mqtt.client as mqtt

    data = tmp_path / "data"
    gw = gateway_factory(data)
    for i in range(5):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, f"rebuild-{i}")
        c.connect("127.0.0.1", gw.port("mqtt"))
        c.loop_start()
        c.subscribe(f"plant/{i}/+", 1)
        for j in range(20):
            c.publish(f"plant/{i}/t", f"{j}".encode(), qos=1).wait_for_publish(5)
        c.disconnect()
        c.loop_stop()
    assert gw.stop() == 0
    proc = subprocess.run(
        [sys.executable, "-m", "lightgate", "rebuild-queues", "--data-dir", str(data)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    bars = [
        ln
        for ln in lines
        if ln.startswith("rebuild-queues: count") or ln.startswith("rebuild-queues: index")
    ]
    assert [b.split()[1] for b in bars] == ["count", "index"], proc.stderr
    totals = []
    for bar in bars:
        done, total = bar.split()[3].split("/")
        assert done == total and bar.endswith("100%"), bar
        totals.append(int(total))
    assert totals[0] >= 100 and totals[1] > 100  # the log holds the events besides the 100 records
    assert any(ln.startswith("{") and "rebuilt" in ln for ln in lines), proc.stderr
    assert lines[-1].startswith("rebuild-queues: 100 records"), proc.stderr


def test_graceful_stop_records_the_disconnect_of_every_connected_client(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """Clients still connected at SIGTERM get their disconnect event in the log (it used to be
    appended after the store had closed: lost, with an error line)."""
    import paho.mqtt.client as mqtt
    from mqtt_broker import read_records

    data = tmp_path / "data"
    gw = gateway_factory(data)
    clients = []
    for i in range(5):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, f"stop-{i}")
        c.connect("127.0.0.1", gw.port("mqtt"))
        c.loop_start()
        clients.append(c)
    time.sleep(0.5)
    try:
        assert gw.stop() == 0
    finally:
        for c in clients:
            c.loop_stop()
    events = [json.loads(r.value) for r in read_records(data, "__lightgate_device_events")]
    gone = {e["client_id"] for e in events if e["event"] == "disconnect"}
    assert gone == {f"stop-{i}" for i in range(5)}, events
    assert "could not append" not in gw.log_text()
