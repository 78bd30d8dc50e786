"""Compiled twins: each compiled function (or class) and the pure-Python one it must equal.

A module that has a compiled version of one of its functions binds it with one call::

    fill_cache = twin(fill_cache_py, "mqtt_proxy.delivery._cqueue_cache", "fill_cache", what="...")

which returns the compiled one unless its module is not built or LIGHTGATE_NO_EXTENSIONS=1
(`store.speedups`), and the pure one otherwise. Every call is recorded in `REGISTRY`, which is
the single list of pairs: the tests switch every site to pure Python through it (`use_pure`),
fail for a pair without an equivalence test, and `python -m lightgate.twins_docs` writes the
list in docs/compiled-twins.md from it. It lives in store, the package every other may import.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from store.speedups import load

__all__ = ["REGISTRY", "Twin", "twin", "use_pure"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Twin:
    """One registered pair. `pure` None: the site's own Python path runs instead (`fallback`)."""

    site: str  # the module that binds the chosen implementation
    module: str  # the compiled module
    name: str  # the attribute of `module`
    pure: Any
    compiled: Any  # None when not built or disabled
    what: str  # what it does, for the docs
    fallback: str

    @property
    def key(self) -> str:
        """`module.name`, the pair's name in tests and docs."""
        return f"{self.module}.{self.name}"

    @property
    def pure_name(self) -> str:
        if self.pure is None:
            return self.fallback
        return f"{self.pure.__module__}.{self.pure.__qualname__}"


REGISTRY: list[Twin] = []


def twin(pure: T, module: str, name: str, *, what: str, fallback: str = "") -> T:
    """The compiled `module.name` if in use, else `pure`; records the pair in REGISTRY.

    Called once per pair at import of the module that uses it (the site, taken from the caller).
    """
    site = sys._getframe(1).f_globals["__name__"]
    if pure is None and not fallback:
        raise ValueError(f"{module}.{name}: a twin without a pure function needs a fallback")
    compiled_module = load(module)
    compiled = None if compiled_module is None else getattr(compiled_module, name)
    if not any(t.site == site and t.module == module and t.name == name for t in REGISTRY):
        REGISTRY.append(Twin(site, module, name, pure, compiled, what, fallback))
    return pure if compiled is None else compiled  # type: ignore[no-any-return]


def use_pure(setattr_: Callable[[Any, str, Any], None], keys: Iterable[str] | None = None) -> int:
    """Rebind every module global that holds a registered compiled object to its pure twin
    (`keys`: only those pairs), through `setattr_` (a test's monkeypatch.setattr, which undoes
    it). Every loaded module of ours is searched, so re-imported names switch too; a class
    already built on a compiled base keeps it. Returns the number of names rebound."""
    wanted = None if keys is None else set(keys)
    pairs = {
        id(t.compiled): t.pure
        for t in REGISTRY
        if t.compiled is not None and (wanted is None or t.key in wanted)
    }
    compiled_modules = {t.module for t in REGISTRY}
    n = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.partition(".")[0] not in _OURS or mod_name in compiled_modules:
            continue
        for attr, value in list(vars(mod).items()):
            if id(value) in pairs and not attr.startswith("__"):
                setattr_(mod, attr, pairs[id(value)])
                n += 1
    return n


_OURS = {"store", "lightqueue", "mqtt_proxy", "notify", "lightgate", "spark_analytics"}
