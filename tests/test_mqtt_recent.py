"""The proxy's recent-append cache (mqtt_proxy.backends.backend): runs by log position, bounded by bytes.

Filled from real `Store.append_mqtt` results, checked against the offsets the store assigned.
"""

from __future__ import annotations

from pathlib import Path

from mqtt_proxy.backends.backend import RECENT_EVICT_FRACTION, RECENT_OVERHEAD, Backend
from store import MqttMessage, Store, StoreConfig


def _msgs(n: int, tag: str, size: int = 64) -> list[MqttMessage]:
    return [
        MqttMessage(f"r/{i % 3}", f"{tag}{i}".encode().ljust(size, b"."), 0, "c") for i in range(n)
    ]


async def test_runs_resolve_what_was_appended_and_miss_the_rest(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=3, fsync="never"))
    b = Backend(store, None, "p", recent_bytes=1 << 30)
    first, second = _msgs(50, "a"), _msgs(40, "b")
    r1 = store.append_mqtt(first, sync=False)
    # Records this proxy did not append (another producer) sit between its runs.
    store.append_mqtt(_msgs(7, "x"), sync=False)
    r2 = store.append_mqtt(second, sync=False)
    b.remember(first, r1.runs)  # type: ignore[arg-type]
    b.remember(second, r2.runs)  # type: ignore[arg-type]
    assert b.recent_count == 90
    wanted = list(r2.offsets or []) + [None] + list(r1.offsets or [])
    got, missing = b._from_recent(wanted)
    assert got == second + [None] + first and missing == []
    foreign = [(t, p, o) for (t, p, o) in (r1.offsets or [])]
    foreign = [(t, p, o + 1_000) for t, p, o in foreign[:3]] + [("nope", 0, 1)]
    got, missing = b._from_recent(foreign)
    assert got == [None] * 4 and missing == [0, 1, 2, 3]
    # The gap left by the other producer's records misses too.
    last_a = max(o for t, p, o in r1.offsets or [] if p == 0)
    first_b = min(o for t, p, o in r2.offsets or [] if p == 0)
    gap = [("r", 0, o) for o in range(last_a + 1, first_b)]
    assert gap and b._from_recent(gap)[1] == list(range(len(gap)))
    await store.close()


async def test_oldest_runs_go_first_past_the_byte_budget(tmp_path: Path) -> None:
    store = await Store.open(tmp_path, StoreConfig(default_partitions=1, fsync="never"))
    per_append = 100 * (RECENT_OVERHEAD + 64 + 40)  # about what one append of 100 costs
    b = Backend(store, None, "p", recent_bytes=3 * per_append)
    results = []
    for k in range(10):
        msgs = _msgs(100, f"m{k}-")
        res = store.append_mqtt(msgs, sync=False)
        b.remember(msgs, res.runs)  # type: ignore[arg-type]
        results.append((msgs, res))
        assert b.recent_bytes <= 3 * per_append
    kept = [k for k, (_m, res) in enumerate(results) if not b._from_recent(res.offsets or [])[1]]
    gone = [k for k, (_m, res) in enumerate(results) if b._from_recent(res.offsets or [])[1]]
    assert gone == list(range(len(gone))) and kept == list(range(len(gone), 10))
    assert 1 <= len(kept) <= 3 and b.recent_count == 100 * len(kept)
    await store.close()


async def test_eviction_drops_each_partitions_oldest_runs(tmp_path: Path) -> None:
    """Runs of several partitions interleave in the byte FIFO; one eviction drops many of them
    at once, each partition losing exactly its oldest: what stays resolves to the messages that
    were appended, what went misses, and no partition keeps a run older than one it lost."""
    store = await Store.open(tmp_path, StoreConfig(default_partitions=3, fsync="never"))
    per_append = 30 * (RECENT_OVERHEAD + 64 + 40)
    b = Backend(store, None, "p", recent_bytes=12 * per_append)
    results = []
    for k in range(40):
        msgs = _msgs(30 if k % 2 else 3, f"e{k}-")  # small appends make many small runs
        res = store.append_mqtt(msgs, sync=False)
        b.remember(msgs, res.runs)  # type: ignore[arg-type]
        results.append((msgs, res))
        assert b.recent_bytes <= 12 * per_append
    held = 0
    keys = {(o[0], o[1]) for _m, res in results for o in res.offsets or []}
    assert len(keys) > 1
    for key in keys:
        states = []
        for msgs, res in results:
            mine = [i for i, o in enumerate(res.offsets or []) if (o[0], o[1]) == key]
            if not mine:
                continue
            got, missing = b._from_recent([(res.offsets or [])[i] for i in mine])
            if missing:
                assert missing == list(range(len(mine))), "a run is kept or lost whole"
                states.append("lost")
            else:
                assert got == [msgs[i] for i in mine]
                held += len(mine)
                states.append("kept")
        n_lost = states.count("lost")
        assert states == ["lost"] * n_lost + ["kept"] * (len(states) - n_lost), states
        assert 0 < n_lost < len(states), "each partition lost its oldest runs, kept its newest"
    assert held == b.recent_count
    await store.close()


async def test_an_eviction_frees_a_small_slice_of_the_budget(tmp_path: Path) -> None:
    """Freeing is the messages' deallocation, on the event loop: once full, each eviction frees
    about budget / RECENT_EVICT_FRACTION (about a millisecond of work at 64 MiB), not an eighth of
    the budget at once (a loop stall of ~8 ms at 64 MiB, docs/performance-history.md)."""
    store = await Store.open(tmp_path, StoreConfig(default_partitions=2, fsync="never"))
    budget = 400 * (RECENT_OVERHEAD + 64 + 40) * 2
    b = Backend(store, None, "p", recent_bytes=budget)
    drops = []
    for k in range(400):
        msgs = _msgs(4, f"s{k}-")
        res = store.append_mqtt(msgs, sync=False)
        before = b.recent_bytes
        b.remember(msgs, res.runs)  # type: ignore[arg-type]
        assert b.recent_bytes <= budget
        if b.recent_bytes < before:
            drops.append(before - b.recent_bytes)
    one_append = 4 * (RECENT_OVERHEAD + 64 + 40)
    assert len(drops) >= 5, "the budget was crossed many times"
    assert max(drops) <= budget // RECENT_EVICT_FRACTION + one_append
    await store.close()
