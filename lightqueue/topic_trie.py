"""MQTT topic filters in a trie: which filters match a topic, without scanning every filter.

`FilterTrie` maps filters (with `+` / `#`) to values and answers `match(topic)` by walking at most
three branches per level (the literal level, `+`, `#`), so the cost depends on the topic's depth
and the number of matches, not on how many filters exist. One filter may hold several values (a
plain filter queue and any number of replay queues of the same filter all want its live records):
`add` adds a value beside the others, `remove(filt, value)` takes that one value away. Rules
(MQTT 5 §4.7):
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

_NONE: tuple[()] = ()


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
    __slots__ = ("children", "plus", "hash_values", "values")

    def __init__(self) -> None:
        self.children: dict[str, _Node[V]] = {}
        self.plus: _Node[V] | None = None
        self.hash_values: tuple[V, ...] = _NONE  # values of the filter ending in `#` here
        self.values: tuple[V, ...] = _NONE  # values of the filter ending exactly here

    def empty(self) -> bool:
        return not (self.children or self.plus is not None or self.hash_values or self.values)


class FilterTrie(Generic[V]):
    """Filters → values (several per filter); `match(topic)` returns the values of every
    matching filter.

    Not thread-safe; the dispatcher and the light queues use it from the event loop only.
    """

    __slots__ = ("_root", "_values", "_cache", "_cache_max")

    def __init__(self, cache_size: int = 65536) -> None:
        self._root: _Node[V] = _Node()
        self._values: dict[str, tuple[V, ...]] = {}
        self._cache: OrderedDict[str, list[V]] = OrderedDict()
        self._cache_max = cache_size

    def __len__(self) -> int:
        """Number of filters (not values)."""
        return len(self._values)

    def __contains__(self, filt: object) -> bool:
        return filt in self._values

    def get(self, filt: str) -> tuple[V, ...]:
        """The values `filt` holds (empty when it holds none)."""
        return self._values.get(filt, _NONE)

    def items(self) -> Iterator[tuple[str, tuple[V, ...]]]:
        return iter(list(self._values.items()))

    def _node(
        self, levels: list[str], create: bool
    ) -> tuple[_Node[V] | None, list[tuple[_Node[V], str]]]:
        """The node a filter ends at (for `#`: the node holding it) and the path to it."""
        node = self._root
        path: list[tuple[_Node[V], str]] = []
        for level in levels:
            if level == "#":  # always last (validated)
                break
            path.append((node, level))
            nxt = node.plus if level == "+" else node.children.get(level)
            if nxt is None:
                if not create:
                    return None, path
                nxt = _Node()
                if level == "+":
                    node.plus = nxt
                else:
                    node.children[level] = nxt
            node = nxt
        return node, path

    def add(self, filt: str, value: V) -> None:
        """Add `value` to the values of `filt` (validated); adding a value it holds is a no-op."""
        validate_filter(filt)
        held = self._values.get(filt, _NONE)
        if any(v is value for v in held):
            return
        levels = filt.split("/")
        node, _ = self._node(levels, create=True)
        assert node is not None
        vals = (*held, value)
        if levels[-1] == "#":
            node.hash_values = vals
        else:
            node.values = vals
        self._values[filt] = vals
        self._cache.clear()

    def remove(self, filt: str, value: V) -> bool:
        """Remove `value` from `filt` (the others stay); False if it was not there. A filter left
        with no value leaves the trie, and empty branches are pruned."""
        held = self._values.get(filt)
        if held is None or not any(v is value for v in held):
            return False
        vals = tuple(v for v in held if v is not value)
        levels = filt.split("/")
        node, path = self._node(levels, create=False)
        assert node is not None
        if levels[-1] == "#":
            node.hash_values = vals
        else:
            node.values = vals
        self._cache.clear()
        if vals:
            self._values[filt] = vals
            return True
        del self._values[filt]
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
        return True

    def match(self, topic: str) -> list[V]:
        """Values of all filters matching `topic` (each value once, in no particular order)."""
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
            if root.hash_values:
                out += root.hash_values
            stack = []
            child = root.children.get(levels[0])
            if child is not None:
                stack.append((child, 1))
            if root.plus is not None:
                stack.append((root.plus, 1))
        while stack:
            node, depth = stack.pop()
            # `#` below this node matches the remaining levels, including none (parent level).
            if node.hash_values:
                out += node.hash_values
            if depth == n:
                if node.values:
                    out += node.values
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
