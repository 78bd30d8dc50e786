"""`acl_file` in Mosquitto's syntax and with its semantics, plus the two questions Lightgate adds.

Syntax (one rule a line; `#` starts a comment line; blank lines ignored):

    topic [read|write|readwrite|deny] FILTER     # no access word = readwrite
    user NAME                                    # the rest of the line is the name
    pattern [read|write|readwrite|deny] FILTER   # %u = user name, %c = client id

Semantics, as in Mosquitto:
- `topic` rules before the first `user` line apply to anonymous clients (no user name); after a `user`
  line, to that user only. A user with no section gets only the patterns.
- `pattern` rules apply to every client wherever they stand in the file. A pattern using `%u` does not
  apply to an anonymous client. A pattern whose substitution would bring `+`, `#` or `/` in from the user
  name or client id is skipped for that client (Mosquitto refuses such clients the patterns altogether:
  a client id cannot widen its own rule); a `deny` pattern is applied substituted all the same (it can
  only deny more; one made invalid by the substitution could only match a topic no client can send).
- A topic starting with `$` is matched only by a filter whose first level is not a wildcard.
- `deny` wins over any allow that matches the same topic (whatever the order in the file).

Questions beyond Mosquitto's (docs/security.md):
- `can_subscribe(filter)`: refused only when no topic the filter matches is readable. The check is
  exact for a read rule overlapping the filter and one deny covering the overlap; an overlap covered only
  by several denies together is granted, and delivery (`can_read`) filters every message, so the error
  is towards granting a subscription that receives nothing, never towards leaking.
- `covers_subtree(prefix, access)`: Kafka log topic `prefix` is the stream of every MQTT topic equal to or
  under it, so it needs one allow rule covering `prefix/#` and no deny overlapping it.

Everything here is pure; `ClientAcl` keeps a bounded per-topic decision cache, which a reload drops
with the old `Acl` object.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from store.auth.errors import AuthFileError

READ = 1
WRITE = 2
DENY = 0
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": DENY}
_CACHE_MAX = 4096  # decisions kept per client before the cache is cleared

Levels = tuple[str, ...]


def _levels(filt: str) -> Levels:
    return tuple(filt.split("/"))


def valid_filter(filt: str) -> bool:
    """MQTT filter rules: non-empty, `#` only as the whole last level, `+` only as a whole level."""
    if not filt:
        return False
    parts = filt.split("/")
    for i, part in enumerate(parts):
        if "#" in part and (part != "#" or i != len(parts) - 1):
            return False
        if "+" in part and part != "+":
            return False
    return True


def matches(filt: Levels, topic: Levels) -> bool:
    """True iff MQTT filter `filt` matches the (wildcard-free) topic."""
    if topic[0][:1] == "$" and filt[0] in ("+", "#"):
        return False
    n = len(filt)
    for i, part in enumerate(filt):
        if part == "#":
            return True  # also matches the parent level ("a/#" matches "a")
        if i >= len(topic):
            return False
        if part != "+" and part != topic[i]:
            return False
    return n == len(topic)


def intersect(a: Levels, b: Levels) -> Levels | None:
    """The filter matching exactly the topics both filters match, or None when there are none."""
    out: list[str] = []
    i = 0
    while True:
        a_end, b_end = i == len(a), i == len(b)
        if not a_end and a[i] == "#":
            if i == 0 and not b_end and b[0][:1] == "$":
                return None
            return (*out, *b[i:])
        if not b_end and b[i] == "#":
            if i == 0 and not a_end and a[0][:1] == "$":
                return None
            return (*out, *a[i:])
        if a_end or b_end:
            return tuple(out) if a_end and b_end else None
        x, y = a[i], b[i]
        if x == "+":
            if i == 0 and y[:1] == "$":
                return None
            out.append(y)
        elif y == "+":
            if i == 0 and x[:1] == "$":
                return None
            out.append(x)
        elif x == y:
            out.append(x)
        else:
            return None
        i += 1


def covers(outer: Levels, inner: Levels) -> bool:
    """True iff every topic `inner` matches is matched by `outer`."""
    i = 0
    while True:
        if i < len(outer) and outer[i] == "#":
            return not (i == 0 and i < len(inner) and inner[0][:1] == "$")
        if i == len(outer):
            return i == len(inner)
        if i == len(inner):
            return False
        x, y = outer[i], inner[i]
        if y == "#":
            # Only "+/#" covers "#" (a topic has at least one level: "+/#" matches "a" too).
            return i == 0 and x == "+" and outer[1:] == ("#",)
        if x == "+":
            if i == 0 and y[:1] == "$":
                return False
        elif x != y:
            return False
        i += 1


@dataclass(frozen=True, slots=True)
class Rule:
    """One `topic` or `pattern` line; `access` is READ|WRITE bits, DENY (0) for deny."""

    access: int
    filt: str
    line: int
    pattern: bool = False


class ClientAcl:
    """The rules of one (user, client id), compiled: exact topics in sets, wildcard filters in lists."""

    __slots__ = ("_read", "_write", "_deny", "_cache", "allow_all")

    def __init__(self, rules: list[tuple[int, str]], *, allow_all: bool = False) -> None:
        self.allow_all = allow_all
        self._read = _Matcher([f for a, f in rules if a & READ])
        self._write = _Matcher([f for a, f in rules if a & WRITE])
        self._deny = _Matcher([f for a, f in rules if a == DENY])
        self._cache: dict[tuple[int, str], bool] = {}

    def _check(self, matcher: _Matcher, bit: int, topic: str) -> bool:
        if self.allow_all:
            return True
        key = (bit, topic)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        levels = _levels(topic)
        result = not self._deny.any_match(topic, levels) and matcher.any_match(topic, levels)
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[key] = result
        return result

    def can_read(self, topic: str) -> bool:
        return self._check(self._read, READ, topic)

    def can_write(self, topic: str) -> bool:
        return self._check(self._write, WRITE, topic)

    def can_subscribe(self, filt: str) -> bool:
        if self.allow_all:
            return True
        want = _levels(filt)
        for rule in self._read.all:
            overlap = intersect(rule, want)
            if overlap is not None and not any(covers(d, overlap) for d in self._deny.all):
                return True
        return False

    def reads_all(self, filt: str) -> bool:
        """True iff every topic `filt` matches is readable: delivery then needs no per-message check."""
        if self.allow_all:
            return True
        want = _levels(filt)
        if any(intersect(d, want) is not None for d in self._deny.all):
            return False
        return any(covers(rule, want) for rule in self._read.all)

    def covers_subtree(self, prefix: str, access: str) -> bool:
        if self.allow_all:
            return True
        matcher = self._read if access == "read" else self._write
        subtree = (*_levels(prefix), "#")
        if any(intersect(d, subtree) is not None for d in self._deny.all):
            return False
        return any(covers(rule, subtree) for rule in matcher.all)


class _Node:
    __slots__ = ("children", "end", "hash")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.end = False  # a filter ends here
        self.hash = False  # a filter "<path to here>/#" (also matches this level itself)


class _Matcher:
    """Filters in a level trie: a topic is matched in O(levels), whatever the number of rules
    (a linear scan cost 3 ms a topic with 1,000 wildcard rules; the trie a few µs)."""

    __slots__ = ("root", "all")

    def __init__(self, filters: list[str]) -> None:
        self.root = _Node()
        self.all = [_levels(f) for f in dict.fromkeys(filters)]
        for levels in self.all:
            node = self.root
            for level in levels:
                if level == "#":
                    node.hash = True
                    break
                child = node.children.get(level)
                if child is None:
                    child = node.children[level] = _Node()
                node = child
            else:
                node.end = True

    def any_match(self, topic: str, levels: Levels) -> bool:
        return _walk(self.root, levels, 0, levels[0][:1] == "$")


def _walk(node: _Node, levels: Levels, i: int, dollar: bool) -> bool:
    wild = not (dollar and i == 0)  # `+` and `#` do not match a first level starting with `$`
    if node.hash and wild:
        return True
    if i == len(levels):
        return node.end
    child = node.children.get(levels[i])
    if child is not None and _walk(child, levels, i + 1, dollar):
        return True
    if wild:
        child = node.children.get("+")
        if child is not None and _walk(child, levels, i + 1, dollar):
            return True
    return False


class Acl:
    """A parsed acl_file (or allow-all). Immutable: a reload builds a new one."""

    __slots__ = ("anonymous", "users", "patterns", "allows_everything", "_clients")

    def __init__(
        self,
        anonymous: list[Rule] | None = None,
        users: dict[str, list[Rule]] | None = None,
        patterns: list[Rule] | None = None,
        *,
        allows_everything: bool = False,
    ) -> None:
        self.anonymous = list(anonymous or [])
        self.users = {u: list(r) for u, r in (users or {}).items()}
        self.patterns = list(patterns or [])
        # True only for allow_all(): callers skip every check (no per-message cost).
        self.allows_everything = allows_everything
        self._clients: dict[tuple[str | None, str], ClientAcl] = {}

    @classmethod
    def allow_all(cls) -> Acl:
        return cls(allows_everything=True)

    @classmethod
    def parse(cls, text: str, path: str = "<acl>") -> Acl:
        anonymous: list[Rule] = []
        users: dict[str, list[Rule]] = {}
        patterns: list[Rule] = []
        current = anonymous
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keyword, _, rest = line.partition(" ")
            if "\t" in keyword:
                keyword, _, more = keyword.partition("\t")
                rest = f"{more} {rest}"
            rest = rest.strip()
            if keyword == "user":
                if not rest:
                    raise AuthFileError(path, number, "missing user name")
                current = users.setdefault(rest, [])
            elif keyword in ("topic", "pattern"):
                rule = _parse_rule(rest, keyword == "pattern", path, number)
                (patterns if rule.pattern else current).append(rule)
            else:
                raise AuthFileError(
                    path, number, f"unknown keyword {keyword!r} (topic, user or pattern)"
                )
        return cls(anonymous, users, patterns)

    @classmethod
    def load(cls, path: str | Path) -> Acl:
        name = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AuthFileError(name, 0, f"cannot read: {exc}") from None
        return cls.parse(text, name)

    def rule_count(self) -> int:
        return len(self.anonymous) + sum(map(len, self.users.values())) + len(self.patterns)

    def for_client(self, user: str | None, client_id: str) -> ClientAcl:
        """The compiled rules of one client (cached per (user, client id) in this Acl)."""
        key = (user, client_id)
        found = self._clients.get(key)
        if found is None:
            if self.allows_everything:
                found = ClientAcl([], allow_all=True)
            else:
                found = ClientAcl(self._rules_for(user, client_id))
            if len(self._clients) >= _CACHE_MAX:
                self._clients.clear()
            self._clients[key] = found
        return found

    def _rules_for(self, user: str | None, client_id: str) -> list[tuple[int, str]]:
        own = self.anonymous if user is None else self.users.get(user, [])
        rules = [(r.access, r.filt) for r in own]
        for rule in self.patterns:
            filt = rule.filt
            uses_u, uses_c = "%u" in filt, "%c" in filt
            if uses_u and user is None:
                continue
            dangerous = (uses_u and _dangerous(user or "")) or (uses_c and _dangerous(client_id))
            if dangerous and rule.access != DENY:
                continue
            filt = _substitute(filt, user, client_id)
            if valid_filter(filt):
                rules.append((rule.access, filt))
        return rules

    def can_read(self, topic: str, user: str | None, client_id: str) -> bool:
        return self.allows_everything or self.for_client(user, client_id).can_read(topic)

    def can_write(self, topic: str, user: str | None, client_id: str) -> bool:
        return self.allows_everything or self.for_client(user, client_id).can_write(topic)

    def can_subscribe(self, filt: str, user: str | None, client_id: str) -> bool:
        return self.allows_everything or self.for_client(user, client_id).can_subscribe(filt)

    def covers_subtree(self, prefix: str, access: str, user: str | None, client_id: str) -> bool:
        if access not in ("read", "write"):
            raise ValueError(f"access must be 'read' or 'write', not {access!r}")
        return self.allows_everything or self.for_client(user, client_id).covers_subtree(
            prefix, access
        )


def _dangerous(name: str) -> bool:
    return "+" in name or "#" in name or "/" in name


def _substitute(filt: str, user: str | None, client_id: str) -> str:
    """Replace %c and %u in one left-to-right pass (a name containing "%u" is not substituted again)."""
    out: list[str] = []
    i = 0
    while i < len(filt):
        two = filt[i : i + 2]
        if two == "%c":
            out.append(client_id)
            i += 2
        elif two == "%u" and user is not None:
            out.append(user)
            i += 2
        else:
            out.append(filt[i])
            i += 1
    return "".join(out)


def _parse_rule(rest: str, pattern: bool, path: str, number: int) -> Rule:
    words = rest.split(None, 1)
    if not words:
        raise AuthFileError(path, number, "empty topic")
    if len(words) == 1:
        access, filt = READ | WRITE, words[0]
    else:
        if words[0] not in _ACCESS:
            raise AuthFileError(
                path, number, f"unknown access {words[0]!r} (read, write, readwrite or deny)"
            )
        access, filt = _ACCESS[words[0]], words[1].strip()
    if not valid_filter(filt.replace("%u", "u").replace("%c", "c") if pattern else filt):
        raise AuthFileError(path, number, f"invalid topic filter {filt!r}")
    return Rule(access, filt, number, pattern)
