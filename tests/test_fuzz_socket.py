"""A short socket-fuzzer run (tests/socket_fuzzer.py) as part of the suite: fixed seeds, the same
bytes on every run, so that a red run is a regression and never a roll of the dice. Exploring
new seeds is `make fuzz`'s job (or set LIGHTGATE_FUZZ_RANDOM=1 to add a random seed here); a
failure names its seed and batch, and `python tests/socket_fuzzer.py --seed S --batch B` replays
it. Every seed that found a crash stays in FIXED_SEEDS."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
from gateway_process import GatewayProcess
from socket_fuzzer import Target, fuzz

pytestmark = pytest.mark.timeout(180)

# 20261126: the suite's seed; 2957979978: found a ListOffsets read_committed crash (batch 0).
FIXED_SEEDS = (20261126, 2957979978)


def test_socket_fuzzer_short_run(gateway: GatewayProcess) -> None:
    assert gateway.proc is not None and gateway.log_path is not None
    target = Target(gateway.endpoints, gateway.proc.pid, gateway.log_path, gateway)
    seeds = list(FIXED_SEEDS)
    if os.environ.get("LIGHTGATE_FUZZ_RANDOM") == "1":
        seeds.append(random.SystemRandom().randrange(2**32))
    print(f"socket fuzzer: seeds {seeds}")

    async def run() -> None:
        for seed in seeds:
            await fuzz(target, seed, seconds=6, conns=16)

    asyncio.run(run())
