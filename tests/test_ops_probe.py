"""Latency probes: timestamped messages through the whole pipeline give per-hop and end-to-end
histograms; `#` and `+` subscribers, Spark's default topics and Kafka's non-internal topics
never see them; a probe that stops arriving (MQTT proxy frozen) makes /health 503 with the
reason and one log line, and /health recovers when probes flow again."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaClient
from gateway_process import GatewayProcess
from mqtt_helpers import V5, Client
from ops_helpers import health, sample, scrape, wait_for

PROBE = ("--set", "probe_interval_ms=100", "--set", "probe_timeout_ms=1500")
HOPS = ("durable", "indexed", "delivered", "end_to_end")


async def _internal_topics(bootstrap: str) -> tuple[set[str], set[str]]:
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        return set(client.cluster.topics()), set(client.cluster.internal_topics)
    finally:
        await client.close()


def test_probes_measure_every_hop_and_stay_invisible(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    gw = gateway_factory(tmp_path / "data", *PROBE)
    http = gw.port("http")
    everything = Client(gw.port("mqtt"), "watcher").connect()
    everything.subscribe("#", qos=1)
    two_levels = Client(gw.port("mqtt"), "watcher2").connect()
    two_levels.subscribe("+/+", qos=0)

    def probed() -> bool:
        m = scrape(http)
        return all(sample(m, "lightgate_probe_latency_seconds_count", hop=h) >= 5 for h in HOPS)

    wait_for(probed, what="probe histograms for every hop")
    m = scrape(http)
    e2e = sample(m, "lightgate_probe_latency_seconds_sum", hop="end_to_end")
    assert 0 < e2e < 5 * sample(m, "lightgate_probe_latency_seconds_count", hop="end_to_end")
    status, body = health(http)
    assert status == 200, body

    # A user message still reaches `#`; no probe ever did.
    Client(gw.port("mqtt"), "user").connect().publish("plant/t", b"real", qos=1)
    got = everything.expect(1)
    assert [r.topic for r in got] == ["plant/t"]
    everything.expect_none(0.5)
    two_levels.expect(1)  # plant/t
    two_levels.expect_none(0.3)

    # Kafka lists the probes' log topic as internal; Spark's default topics leave it out.
    topics, internal = asyncio.run(_internal_topics(f"127.0.0.1:{gw.port('kafka')}"))
    assert "__lightgate_probe" in internal  # a client's default topic list skips it
    assert "__lightgate_probe" not in topics and "plant" in topics
    from spark_analytics.jobs import check_data

    assert "__lightgate_probe" not in check_data(tmp_path / "data")
    assert "plant" in check_data(tmp_path / "data")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(p) for p in (task / "children").read_text().split()]
    return out


def test_missing_probes_make_health_503_once(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path
) -> None:
    """Split shape: freezing the MQTT proxy process (SIGSTOP) stops the probes while the core,
    its dispatcher and HTTP keep running; only the probes can tell."""
    gw = gateway_factory(tmp_path / "split", "--set", "mqtt_processes=1", *PROBE)
    http = gw.port("http")
    wait_for(
        lambda: sample(scrape(http), "lightgate_probe_latency_seconds_count", hop="end_to_end"),
        what="a first probe",
    )
    assert gw.proc is not None
    (proxy,) = _children(gw.proc.pid)
    os.kill(proxy, signal.SIGSTOP)
    try:
        status, body = wait_for(lambda: (h := health(http))[0] == 503 and h, timeout=10, what="503")
        assert body["reasons"] == ["latency probe: not delivered within 1500 ms"]
        time.sleep(2.5)  # more watch rounds: still one line
        assert health(http)[0] == 503
    finally:
        os.kill(proxy, signal.SIGCONT)
    wait_for(lambda: health(http)[0] == 200, timeout=15, what="200 after SIGCONT")
    text = gw.log_text()
    assert text.count("unhealthy: latency probe") == 1, text
    wait_for(lambda: "healthy again" in gw.log_text(), timeout=5, what="recovery line")


def _secured(tmp: Path) -> tuple[str, ...]:
    """A password file with one user and an ACL that gives it one subtree: no anonymous access,
    and nothing of the probe's topics allowed to anyone."""
    pw, acl = tmp / "passwd", tmp / "acl"
    done = subprocess.run(
        [sys.executable, "-m", "lightgate", "passwd", "-c", "-b", str(pw), "alice", "alicepw"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    acl.write_text("user alice\ntopic readwrite dev/alice/#\n")
    return ("--set", f"password_file={pw}", "--set", f"acl_file={acl}")


@pytest.mark.parametrize("shape", ["one process", "split"])
def test_probes_pass_users_and_acl_and_no_device_can_pose_as_one(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path, shape: str
) -> None:
    """With users and an ACL the probe still gets through (its credential is the gateway's own,
    never a user's), so /health stays 200; a device naming itself like a probe is refused, with
    or without a user's password, so it can neither hide from users' figures nor skip the ACL."""
    split = ("--set", "mqtt_processes=1") if shape == "split" else ()
    gw = gateway_factory(tmp_path / "data", *split, *PROBE, *_secured(tmp_path))
    http = gw.port("http")
    wait_for(
        lambda: (
            sample(scrape(http), "lightgate_probe_latency_seconds_count", hop="end_to_end") >= 3
        ),
        what="probes delivered through a gateway with users and an ACL",
    )
    time.sleep(2)  # past probe_timeout_ms: a refused probe would have made /health 503 by now
    status, body = health(http)
    assert status == 200, body
    for user, password in ((None, None), ("alice", "alicepw")):
        poser = Client(gw.port("mqtt"), "__lightgate_probe-fake", V5)
        poser.connect(username=user, password=password, expect_ok=False)
        assert int(getattr(poser.connack, "value", poser.connack)) == 0x87, (user, poser.connack)
        poser.paho.loop_stop()
    alice = Client(gw.port("mqtt"), "alice-1").connect(username="alice", password="alicepw")
    alice.disconnect()
