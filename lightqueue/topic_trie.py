"""MQTT topic filters in a trie: which filters match a topic, without scanning every filter.

`FilterTrie` maps filters (with `+` / `#`) to values and answers `match(topic)` by walking at most
three branches per level (the literal level, `+`, `#`), so the cost depends on the topic's depth
and the number of matches, not on how many filters exist. Rules (MQTT 5 §4.7):
- `+` matches exactly one level (an empty level too); `#` matches any number of levels, including
  none, so `a/#` matches `a` (the parent level) as well as `a/b/c`.
- Topics starting with `$` are not matched by a filter whose first level is `+` or `#`.
- A filter without wildcards matches only the identical topic.

`match_cached` keeps an LRU of topic → matches, invalidated whenever a filter is added or removed;
the dispatcher keeps its own per-key cache on top (it caches the queues, not the filters).

`topic_matches` is the brute-force reference used by tests and by one-off checks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

V = TypeVar("V")

_NO = object()


class FilterError(ValueError):
    """A malformed topic filter (MQTT 5 §4.7.1)."""


def is_wildcard(filt: str) -> bool:
    return "+" in filt or "#" in filt


def validate_filter(filt: str) -> None:
    """`#` alone and last, `+` alone in its level, non-empty, no NUL."""
    if not filt:
        raise FilterError("empty topic filter")
    if "\x00" in filt:
        raise FilterError("NUL in topic filter")
    if not is_wildcard(filt):
        return
    levels = filt.split("/")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            raise FilterError(f"'#' must be a whole, last level: {filt!r}")
        if "+" in level and level != "+":
            raise FilterError(f"'+' must be a whole level: {filt!r}")


def topic_matches(filt: str, topic: str) -> bool:
    """Brute-force reference matcher (one filter, one topic)."""
    if topic[:1] == "$" and filt[:1] in ("+", "#"):
        return False
    f_levels = filt.split("/")
    t_levels = topic.split("/")
    for i, f in enumerate(f_levels):
        if f == "#":
            return True
        if i >= len(t_levels):
            return False
        if f != "+" and f != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


class _Node(Generic[V]):
    __slots__ = ("children", "plus", "hash_value", "value")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] = {}
        self.plus: _Node[V] | None = None
        self.hash_value: object = _NO  # value of the filter ending in `#` at this node
        self.value: object = _NO  # value of the filter ending exactly at this node

    def empty(self) -> bool:
        return (
            not self.children and self.plus is None and self.hash_value is _NO and self.value is _NO
        )


class FilterTrie(Generic[V]):
    """Filters → values; `match(topic)` returns the values of every matching filter.

    Not thread-safe; the dispatcher and the light queues use it from the event loop only.
    """

    __slots__ = ("_root", "_values", "_cache", "_cache_max")

    def __init__(self, cache_size: int = 65536) -> None:
        self._root: _Node[V] = _Node()
        self._values: dict[str, V] = {}
        self._cache: OrderedDict[str, list[V]] = OrderedDict()
        self._cache_max = cache_size

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, filt: object) -> bool:
        return filt in self._values

    def get(self, filt: str) -> V | None:
        return self._values.get(filt)

    def items(self) -> Iterator[tuple[str, V]]:
        return iter(list(self._values.items()))

    def add(self, filt: str, value: V) -> None:
        """Add or replace the value of `filt` (validated)."""
        validate_filter(filt)
        node = self._root
        levels = filt.split("/")
        for i, level in enumerate(levels):
            if level == "#":  # always last (validated)
                node.hash_value = value
                break
            if level == "+":
                if node.plus is None:
                    node.plus = _Node()
                node = node.plus
            else:
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
            if i == len(levels) - 1:
                node.value = value
        self._values[filt] = value
        self._cache.clear()

    def remove(self, filt: str) -> V | None:
        """Remove `filt`; returns its value (None if absent). Empty branches are pruned."""
        if filt not in self._values:
            return None
        value = self._values.pop(filt)
        path: list[tuple[_Node[V], str]] = []
        node = self._root
        levels = filt.split("/")
        for i, level in enumerate(levels):
            if level == "#":
                node.hash_value = _NO
                break
            path.append((node, level))
            nxt = node.plus if level == "+" else node.children.get(level)
            assert nxt is not None
            node = nxt
            if i == len(levels) - 1:
                node.value = _NO
        # Prune from the deepest node up while nodes are empty.
        child = node
        for parent, level in reversed(path):
            if not child.empty():
                break
            if level == "+":
                parent.plus = None
            else:
                del parent.children[level]
            child = parent
        self._cache.clear()
        return value

    def match(self, topic: str) -> list[V]:
        """Values of all filters matching `topic` (each once, in no particular order)."""
        levels = topic.split("/")
        n = len(levels)
        out: list[V] = []
        root = self._root
        # Level 0 handled apart: `$` topics skip the root's `+` and `#` (MQTT 5 §4.7.2).
        if topic[:1] == "$":
            child = root.children.get(levels[0])
            if child is None:
                return out
            stack = [(child, 1)]
        else:
            if root.hash_value is not _NO:
                out.append(root.hash_value)  # type: ignore[arg-type]
            stack = []
            child = root.children.get(levels[0])
            if child is not None:
                stack.append((child, 1))
            if root.plus is not None:
                stack.append((root.plus, 1))
        while stack:
            node, depth = stack.pop()
            # `#` below this node matches the remaining levels, including none (parent level).
            if node.hash_value is not _NO:
                out.append(node.hash_value)  # type: ignore[arg-type]
            if depth == n:
                if node.value is not _NO:
                    out.append(node.value)  # type: ignore[arg-type]
                continue
            child = node.children.get(levels[depth])
            if child is not None:
                stack.append((child, depth + 1))
            if node.plus is not None:
                stack.append((node.plus, depth + 1))
        return out

    def match_cached(self, topic: str) -> list[V]:
        """`match` through an LRU of recent topics (invalidated by every add/remove)."""
        cache = self._cache
        hit = cache.get(topic)
        if hit is not None:
            cache.move_to_end(topic)
            return hit
        res = self.match(topic)
        cache[topic] = res
        if len(cache) > self._cache_max:
            cache.popitem(last=False)
        return res
