"""FilterTrie against the brute-force matcher, plus the MQTT corner cases by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightqueue.topic_trie import FilterError, FilterTrie, topic_matches, validate_filter

LEVELS = st.sampled_from(["a", "b", "c", "", "$SYS", "x y", "ü"])
TOPICS = st.lists(LEVELS, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(
        st.lists(st.sampled_from(["a", "b", "c", "", "+", "$SYS"]), min_size=1, max_size=5)
    )
    if draw(st.booleans()):
        levels.append("#")
    f = "/".join(levels)
    return f or "#"


@pytest.mark.parametrize(
    ("filt", "topic", "expected"),
    [
        ("a/#", "a", True),  # `#` matches the parent level
        ("a/#", "a/b/c", True),
        ("a/+", "a", False),
        ("a/+", "a/", True),  # `+` matches an empty level
        ("+/+", "/x", True),
        ("#", "$SYS/x", False),  # wildcards at level 0 never match `$` topics
        ("+/x", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("$SYS/+", "$SYS/x", True),
        ("a/b", "a/b", True),
        ("a/b", "a/b/c", False),
        ("#", "a", True),
        ("+", "a/b", False),
    ],
)
def test_named_cases(filt: str, topic: str, expected: bool) -> None:
    assert topic_matches(filt, topic) is expected
    t: FilterTrie[str] = FilterTrie()
    t.add(filt, filt)
    assert (t.match(topic) == [filt]) is expected


@settings(max_examples=300, deadline=None)
@given(st.lists(filters(), min_size=0, max_size=30, unique=True), st.lists(TOPICS, max_size=30))
def test_trie_equals_brute_force(fs: list[str], topics: list[str]) -> None:
    t: FilterTrie[str] = FilterTrie(cache_size=8)
    for f in fs:
        t.add(f, f)
    for topic in topics:
        want = sorted(f for f in fs if topic_matches(f, topic))
        assert sorted(t.match(topic)) == want
        assert sorted(t.match_cached(topic)) == want
    # Removing half keeps the rest exact (and prunes without breaking shared branches).
    for f in fs[::2]:
        assert t.remove(f, f)
        assert not t.remove(f, f)
    kept = fs[1::2]
    for topic in topics:
        assert sorted(t.match_cached(topic)) == sorted(f for f in kept if topic_matches(f, topic))
    for f in kept:
        t.remove(f, f)
    assert len(t) == 0 and t._root.empty()


def test_invalid_filters() -> None:
    for bad in ["", "a/#/b", "a#", "a/b+", "a\x00b"]:
        with pytest.raises(FilterError):
            validate_filter(bad)


def test_match_does_not_scan_filters() -> None:
    """10,000 filters under distinct first levels: one lookup visits a handful of nodes."""
    t: FilterTrie[int] = FilterTrie()
    for i in range(10_000):
        t.add(f"site{i}/+/temp", i)
    t.add("#", -1)
    assert sorted(t.match("site42/dev/temp")) == [-1, 42]
    assert t.match("$SYS/x") == []


def test_one_filter_holds_several_values() -> None:
    """A plain filter queue and replay queues of the same filter all want its records: adding
    one must not replace another, and removing one leaves the others matched."""
    t: FilterTrie[str] = FilterTrie()
    for f in ("a/+", "a/#"):
        t.add(f, "plain")
        t.add(f, "replay1")
        t.add(f, "replay2")
        t.add(f, "replay1")  # again: still once
        assert t.get(f) == ("plain", "replay1", "replay2")
    assert sorted(t.match_cached("a/x")) == sorted(["plain", "replay1", "replay2"] * 2)
    assert t.remove("a/+", "replay2") and not t.remove("a/+", "nope")
    assert sorted(t.match_cached("a/x")) == sorted(["plain", "replay1"] * 2 + ["replay2"])
    assert t.remove("a/+", "plain") and t.remove("a/+", "replay1")
    assert "a/+" not in t and sorted(t.match("a/x")) == ["plain", "replay1", "replay2"]
    for v in ("plain", "replay1", "replay2"):
        t.remove("a/#", v)
    assert len(t) == 0 and t._root.empty()
