"""/health: 503 with the reason while the dispatcher is stopped (MQTT delivery stops with it),
200 again once it runs; the change is logged once, not every second. The gateway runs in this
test's event loop so the test can stop and restart its dispatcher task."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from mqtt_helpers import Client
from ops_helpers import health, sample, scrape

from lightgate.app import Gateway
from lightgate.config_load import load_config


async def _health(port: int) -> tuple[int, dict[str, object]]:
    return await asyncio.to_thread(health, port)


async def test_health_503_while_dispatcher_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_config(
        None,
        overrides={
            "data_dir": str(tmp_path / "data"),
            "mqtt_port": 0,
            "ws_port": -1,
            "kafka_port": -1,
            "http_port": 0,
            "probe_interval_ms": 0,
        },
    )
    gw = Gateway(cfg)
    await gw.start()
    sub = pub = None
    try:
        http, mqtt = gw.endpoints["http"][1], gw.endpoints["mqtt"][1]
        status, body = await _health(http)
        assert status == 200 and body["status"] == "ok" and body["reasons"] == []

        caplog.set_level(logging.INFO, logger="lightgate.health")
        gw.queues.dispatch_task.cancel()
        await asyncio.sleep(0.05)
        status, body = await _health(http)
        assert status == 503
        assert body["reasons"] == ["dispatcher stopped"]
        m = await asyncio.to_thread(scrape, http)
        assert sample(m, "lightgate_up") == 0

        # Really stopped: a published message is stored but nobody gets it, and the lag shows.
        sub = await asyncio.to_thread(lambda: Client(mqtt, "h-sub").connect())
        await asyncio.to_thread(sub.subscribe, "h/t", 1)
        pub = await asyncio.to_thread(lambda: Client(mqtt, "h-pub").connect())
        await asyncio.to_thread(pub.publish, "h/t", b"x", 1)
        await asyncio.sleep(2.5)  # two or three watch rounds: one log line, not three
        assert sub.messages.empty()
        m = await asyncio.to_thread(scrape, http)
        assert sample(m, "lightgate_dispatch_lag_records", topic="h") == 1
        lines = [r for r in caplog.records if r.name == "lightgate.health"]
        assert [r.getMessage() for r in lines] == ["unhealthy: dispatcher stopped"]

        assert gw.queues.start_dispatch()
        await asyncio.sleep(0.05)
        status, body = await _health(http)
        assert status == 200 and body["reasons"] == []
        got = await asyncio.to_thread(sub.expect, 1)
        assert got[0].payload == b"x"
        await asyncio.sleep(1.5)
        assert [r.getMessage() for r in caplog.records if r.name == "lightgate.health"][-1] == (
            "healthy again"
        )
    finally:
        for c in (sub, pub):
            if c is not None:
                await asyncio.to_thread(c.disconnect)
        await gw.close()


async def test_health_503_while_dispatcher_stuck(tmp_path: Path) -> None:
    """Running but not indexing: a dispatcher task that hangs (as on a LevelDB write that never
    returns) while records wait. 503 after `dispatch_stall_ms`, 200 once it indexes again."""
    cfg = load_config(
        None,
        overrides={
            "data_dir": str(tmp_path / "data"),
            "mqtt_port": 0,
            "ws_port": -1,
            "kafka_port": -1,
            "http_port": 0,
            "probe_interval_ms": 0,
            "dispatch_stall_ms": 1500,
        },
    )
    gw = Gateway(cfg)
    await gw.start()
    pub = None
    try:
        http, mqtt = gw.endpoints["http"][1], gw.endpoints["mqtt"][1]
        gw.queues.dispatch_task.cancel()
        await asyncio.sleep(0.05)
        hung = asyncio.get_running_loop().create_task(asyncio.Event().wait())
        gw.queues.dispatch_task = hung  # alive, never indexes
        pub = await asyncio.to_thread(lambda: Client(mqtt, "stuck-pub").connect())
        await asyncio.to_thread(pub.publish, "s/t", b"x", 1)
        assert (await _health(http))[0] == 200  # behind, but not for long yet
        await asyncio.sleep(3.2)
        status, body = await _health(http)
        assert status == 503
        assert len(body["reasons"]) == 1
        assert body["reasons"][0].startswith("dispatcher stuck: 1 records behind, nothing indexed")
        hung.cancel()
        await asyncio.sleep(0.05)
        assert gw.queues.start_dispatch()
        await asyncio.sleep(1.5)
        status, body = await _health(http)
        assert status == 200, body
    finally:
        if pub is not None:
            await asyncio.to_thread(pub.disconnect)
        await gw.close()
