"""Overload: idle sockets and slowloris clients cannot starve a normal client or grow
the gateway's memory, and slowloris clients are cut by the CONNECT timeout and keep alive.

The full-size run (10,000 idle + 100 slowloris) is `bench/overload_bench.py`; this is the small
one, with a latency bound loose enough for a loaded CI machine.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from gateway_process import GatewayProcess

BENCH = Path(__file__).resolve().parents[1] / "bench" / "overload_bench.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("overload_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_idle_and_slowloris_do_not_starve_a_normal_client() -> None:
    res = _bench().run(idle=1000, slowloris=20, seconds=4.0, interval=0.01, connect_timeout=60)
    print(res)
    assert res["gateway_alive"]
    assert res["idle_open"] == 1000
    under = res["under_attack"]
    assert under["received"] == under["sent"], under
    assert under["median_ms"] < 50, under
    # 1,000 held sockets cost the gateway a few KiB each, not a buffer each.
    assert res["rss_kib_after"] - res["rss_kib_before"] < 48 * 1024, res


def test_slowloris_cut_by_connect_timeout_and_keepalive(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    """A CONNECT dribbled a byte a second is cut at connect_timeout_s from accept; a PUBLISH
    dribbled after CONNECT is cut by keep alive (which counts whole packets, not bytes)."""
    gw = gateway_factory(None, "--set", "connect_timeout_s=2")
    attack = _bench().Attack(gw.port("mqtt"), keepalive=2)
    attack.open_slowloris(6)
    try:
        deadline = time.monotonic() + 8  # 2 s timeout / 3 s keep alive, plus scheduling slack
        while attack.alive_loris() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert attack.alive_loris() == 0, attack.pos
        assert "no CONNECT in time" in gw.log_text()
    finally:
        attack.close()
