"""Optional C extensions: the compiled hot loops of MQTT fan-in (store.speedups explains).

Everything else is in pyproject.toml. `pip install -e .` builds the extensions in place with
Cython (a build requirement); if compiling fails (no C compiler), install still succeeds with a
warning and the pure-Python twins run. LIGHTGATE_NO_EXTENSIONS=1 at install skips the build.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = {
    "store._cmqtt_batches": "store/_cmqtt_batches.pyx",
    "store._cmapping": "store/_cmapping.pyx",
    "store._slots": "store/_slots.pyx",
    "store._fsync": "store/_fsync.pyx",
    "mqtt_proxy.codec._cparser": "mqtt_proxy/codec/_cparser.pyx",
    "mqtt_proxy.delivery._cqueue_cache": "mqtt_proxy/delivery/_cqueue_cache.pyx",
    "mqtt_proxy.delivery._ccohorts": "mqtt_proxy/delivery/_ccohorts.pyx",
    "mqtt_proxy.delivery._cqos1_run": "mqtt_proxy/delivery/_cqos1_run.pyx",
    "mqtt_proxy.connection._chandlers": "mqtt_proxy/connection/_chandlers.pyx",
    "mqtt_proxy.delivery._coutbound": "mqtt_proxy/delivery/_coutbound.pyx",
    "mqtt_proxy.backends._cbackend": "mqtt_proxy/backends/_cbackend.pyx",
    "lightqueue._cblocks": "lightqueue/_cblocks.pyx",
    "lightqueue._cindex": "lightqueue/_cindex.pyx",
    "lightqueue._cresolve": "lightqueue/_cresolve.pyx",
}


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: the extensions are an optimisation."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any compiler/toolchain failure
            print(f"WARNING: lightgate C extensions not built ({e}); pure Python", file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001
            print(f"WARNING: {ext.name} not built ({e}); pure Python", file=sys.stderr)


def extensions() -> list[Extension]:
    if os.environ.get("LIGHTGATE_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("WARNING: Cython missing, lightgate C extensions not built", file=sys.stderr)
        return []
    exts = [
        Extension(name, [src], extra_compile_args=["-O2"])
        for name, src in SOURCES.items()
        if os.path.exists(src)
    ]
    try:
        return cythonize(exts, language_level=3, quiet=True)  # type: ignore[no-any-return]
    except Exception as e:  # noqa: BLE001
        print(f"WARNING: cythonize failed ({e}); pure Python", file=sys.stderr)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
