"""Shared fixtures, found by name (never imported by test files): `gateway` / `gateway_factory`
(a real `lightgate serve` process), `broker` / `embedded` (the MQTT gateway under test, see
mqtt_broker.py) and `spark` (one local SparkSession per test process, see spark_helpers.py)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_broker import InProcessBroker, ProcessBroker, serve_has_mqtt
from spark_helpers import JAVA_MISSING


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    """Start gateways on tmp data dirs; every one started is stopped at teardown."""
    started: list[GatewayProcess] = []

    def start(data_dir: Path | None = None, *args: str, **env: str) -> GatewayProcess:
        gw = GatewayProcess(data_dir or tmp_path / "data", list(args), dict(env))
        started.append(gw)
        return gw.start()

    yield start
    for gw in started:
        try:
            gw.stop()
        except Exception:
            gw.kill()


@pytest.fixture
def gateway(gateway_factory: Callable[..., GatewayProcess]) -> GatewayProcess:
    return gateway_factory()


@pytest.fixture(params=["serve", "split"])
def broker(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[InProcessBroker | ProcessBroker]:
    """Every MQTT end-to-end test runs twice: against `lightgate serve` as one process, and with
    `mqtt_processes=1` (the proxy in its own process, over the core link)."""
    b: InProcessBroker | ProcessBroker
    if os.environ.get("LIGHTGATE_TEST_INPROCESS") == "1" or not serve_has_mqtt():
        if request.param == "split":
            pytest.skip("the in-process broker has no split mode")
        b = InProcessBroker(tmp_path / "data", {}).start()
    elif request.param == "split":
        b = ProcessBroker(tmp_path / "data", split=True).start()
    else:
        b = ProcessBroker(tmp_path / "data").start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[InProcessBroker]:
    """An in-process broker, for tests that set embedder hooks or read server internals."""
    b = InProcessBroker(tmp_path / "embedded", {}).start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """Shared local SparkSession: 2 cores, UI off, 2 shuffle partitions, the venv's python."""
    if shutil.which("java") is None:
        pytest.skip(JAVA_MISSING)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import spark_analytics

    session = (
        SparkSession.builder.master("local[2]")
        .appName("lightgate-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    spark_analytics.register(session)
    yield session
    session.stop()
