"""Measure the micro-choices in `mqtt_proxy/codec/parser.py` by re-running its source with one
choice undone at a time (64-byte QoS 0 PUBLISH, 64 KiB chunks, best of 7).

Run: .venv/bin/python bench/mqtt_parser_variants.py
"""

from __future__ import annotations

import inspect
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mqtt_proxy.codec.parser as P  # noqa: E402
from mqtt_proxy.codec import Publish, encode  # noqa: E402

SRC = inspect.getsource(P.Parser)
PUB = encode(Publish("sensors/device-0042/temperature", bytes(64)), 4)
STREAM = PUB * 200_000
CHUNKS = [STREAM[i : i + 65536] for i in range(0, len(STREAM), 65536)]


class NoCache(dict):  # type: ignore[type-arg]
    def get(self, k: Any, d: Any = None) -> Any:
        return None


def variant(old: str, new: str, **extra: Any) -> type:
    src = SRC.replace(old, new)
    assert src != SRC, old
    g = dict(vars(P))
    g.update(extra)
    exec(src, g)
    return g["Parser"]  # type: ignore[no-any-return]


def rate(cls: type) -> float:
    best = 0.0
    for _ in range(7):
        p = cls(version=4)
        t = time.perf_counter()
        n = sum(len(p.feed(c)) for c in CHUNKS)
        best = max(best, n / (time.perf_counter() - t))
    return best


DEFAULTS = """        _tnew=tuple.__new__,
        Publish=Publish,
        EMPTY=EMPTY_PROPERTIES,
        decoders=DECODERS,
        flags_for=REQUIRED_FLAGS,
        strict_cache=_TOPICS_STRICT,
        lax_cache=_TOPICS_LAX,
"""
VARIANTS = {
    "as shipped": P.Parser,
    "no topic cache": variant(
        "cache_get = (strict_cache if strict else lax_cache).get",
        "cache_get = NoCache().get",
        NoCache=NoCache,
    ),
    "module globals, not default args": variant(
        DEFAULTS,
        "",
        _tnew=tuple.__new__,
        EMPTY=P.EMPTY_PROPERTIES,
        decoders=P.DECODERS,
        flags_for=P.REQUIRED_FLAGS,
        strict_cache=P._TOPICS_STRICT,
        lax_cache=P._TOPICS_LAX,
    ),
    "remaining length always via the varint loop": variant(
        "            if rl < 0x80:\n                s = pos + 2\n            else:\n"
        "                rl &= 0x7F\n                i = pos + 2\n                shift = 7\n",
        "            if True:\n                rl = 0\n                i = pos + 1\n"
        "                shift = 0\n",
    ),
    "struct.unpack_from for the topic length": variant(
        "p = s + 2 + ((buf[s] << 8) | buf[s + 1])",
        "p = s + 2 + _u16(buf, s)[0]",
        _u16=struct.Struct(">H").unpack_from,
    ),
}

if __name__ == "__main__":
    for name, cls in VARIANTS.items():
        print(f"{name:42s} {rate(cls):12,.0f} PUBLISH/s")
