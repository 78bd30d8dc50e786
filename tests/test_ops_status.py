"""`lightgate status` against a running gateway: the table shows what /api/stats says, `--watch`
redraws, and an unreachable gateway exits 2."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

from gateway_process import ROOT, GatewayProcess
from mqtt_helpers import Client
from ops_helpers import stats, wait_for


def _status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lightgate", "status", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _row(text: str, label: str) -> list[str]:
    for line in text.splitlines():
        if line.startswith(label):
            return line[len(label) :].split()
    raise AssertionError(f"no row {label!r} in:\n{text}")


def test_status_table_matches_api_stats(gateway_factory: Callable[..., GatewayProcess]) -> None:
    gw = gateway_factory()
    http = gw.port("http")
    url = f"http://127.0.0.1:{http}"
    sub = Client(gw.port("mqtt"), "st-sub").connect()
    sub.subscribe("st/#", qos=1)
    pub = Client(gw.port("mqtt"), "st-pub").connect()
    for i in range(25):
        pub.publish("st/x", str(i), qos=1)
    sub.expect(25)
    wait_for(lambda: stats(http)["messages_out"]["mqtt"] == 25, what="deliveries counted")

    proc = _status("--url", url)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    st = stats(http)
    assert float(_row(out, "messages in /s")[0]) > 0  # published within the rate window
    assert out.startswith(f"lightgate {st['version']}  {url}  OK")
    assert _row(out, "connections") == [str(sum(st["connections"]["mqtt"].values())), "0"]
    assert _row(out, "messages in total") == ["25", "0"]
    assert _row(out, "messages out total") == ["25", "0"]
    assert "sessions 2 live, 0 persistent, 0 offline; subscriptions 1; wildcard queues 1" in out
    p99 = st["latency"]["puback"]["p99"] * 1000
    assert _row(out, "MQTT PUBACK (durable)")[2:] == [f"{p99:.1f}", "25"]

    # --watch redraws in place (clear-screen between frames) until --count frames.
    proc = _status("--url", url, "--watch", "0.2", "--count", "2")
    assert proc.returncode == 0
    assert proc.stdout.count("\x1b[H\x1b[2J") == 2
    assert len(re.findall(r"^lightgate ", proc.stdout.replace("\x1b[H\x1b[2J", ""), re.M)) == 2

    sub.disconnect()
    pub.disconnect()
    gw.stop()
    proc = _status("--url", url)
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr
