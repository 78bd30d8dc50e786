"""Operations test helpers: read a running gateway's /metrics (Prometheus' own parser),
/api/stats and /health over plain HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# No HTTP proxy for 127.0.0.1 even if the environment sets one.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with _OPENER.open(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, parsed with prometheus_client's parser."""
    status, body = get(port, "/metrics")
    assert status == 200, body
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def sample(m: dict[Any, float], name: str, **labels: str) -> float:
    """The one series with exactly these labels (0 when absent)."""
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def total(m: dict[Any, float], name: str, **labels: str) -> float:
    """Every series of `name` that has these labels, summed (as PromQL's `sum()` would, over
    `process` and any other label not given)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in m.items() if n == name and want <= set(ls))


def stats(port: int) -> dict[str, Any]:
    status, body = get(port, "/api/stats")
    assert status == 200, body
    return dict(json.loads(body))


def health(port: int) -> tuple[int, dict[str, Any]]:
    status, body = get(port, "/health")
    return status, dict(json.loads(body))


def wait_for(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
