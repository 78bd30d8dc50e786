"""Several MQTT proxies' figures added into the whole gateway's (`/api/stats`, `$SYS`)."""

from __future__ import annotations

from typing import Any


def summed_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """Several proxies' `MqttServer.stats()` as one: numbers summed, the rest from the first."""
    out: dict[str, Any] = {}
    for st in stats:
        for k, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
            else:
                out.setdefault(k, v)
    return out


def summed(a: Any, b: Any) -> Any:
    """Two proxies' `MqttServer.metrics()` added: numbers summed, dicts key by key, a
    histogram's bucket counts element by element."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: summed(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a | b}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [summed(x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a + b
    return a
