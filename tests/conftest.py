"""Shared fixtures: a real `lightgate serve` process per test that asks for one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from tansu import Tansu, start_tansu


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


@pytest.fixture
def tansu(tmp_path: Path) -> Iterator[Tansu]:
    """A real Kafka-compatible cluster (Tansu, memory storage) on a free port, stopped by PID."""
    t = start_tansu(tmp_path)
    try:
        yield t
    finally:
        t.stop()
