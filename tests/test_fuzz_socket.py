"""A short socket-fuzzer run (tests/socket_fuzzer.py) as part of the suite: a fixed seed, the
same bytes on every run, then a random seed, printed and named in any failure so that
`python tests/socket_fuzzer.py --seed S --batch B` replays it. `make fuzz` runs it for longer."""

from __future__ import annotations

import asyncio
import random

import pytest
from gateway_process import GatewayProcess
from socket_fuzzer import Target, fuzz

pytestmark = pytest.mark.timeout(180)

FIXED_SEED = 20261126


def test_socket_fuzzer_short_run(gateway: GatewayProcess) -> None:
    assert gateway.proc is not None and gateway.log_path is not None
    target = Target(gateway.endpoints, gateway.proc.pid, gateway.log_path, gateway)
    seed = random.SystemRandom().randrange(2**32)
    print(f"socket fuzzer: fixed seed {FIXED_SEED}, random seed {seed}")

    async def run() -> None:
        await fuzz(target, FIXED_SEED, seconds=9, conns=16)
        await fuzz(target, seed, seconds=6, conns=16)

    asyncio.run(run())
