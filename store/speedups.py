"""The compiled modules (setup.py's list; docs/architecture.md lists what each holds), if built.

setup.py compiles them with Cython at install time (`pip install -e .`); when that is not
possible (no C compiler) install still succeeds and every caller uses its pure-Python twin, which
computes the same results (`store.twins` chooses and records each pair).
`LIGHTGATE_NO_EXTENSIONS=1` forces the pure-Python twins (as `AIOHTTP_NO_EXTENSIONS` does for
aiohttp); the tests run both.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

DISABLED = os.environ.get("LIGHTGATE_NO_EXTENSIONS", "") not in ("", "0")
MODULES = (
    "store._cmqtt_batches",
    "store._cmapping",
    "store._fsync",
    "store._slots",
    "mqtt_proxy.codec._cparser",
    "mqtt_proxy.delivery._cqueue_cache",
    "mqtt_proxy.delivery._ccohorts",
    "mqtt_proxy.delivery._cqos1_run",
    "mqtt_proxy.connection._chandlers",
    "mqtt_proxy.delivery._coutbound",
    "mqtt_proxy.backends._cbackend",
    "lightqueue._cblocks",
    "lightqueue._cindex",
    "lightqueue._cresolve",
)


def load(name: str) -> ModuleType | None:
    """The compiled module `name`, or None when disabled or not built."""
    if DISABLED:
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def status() -> dict[str, bool]:
    """Compiled module name -> in use (for `lightgate` diagnostics and the tests)."""
    return {name: load(name) is not None for name in MODULES}
