"""The compiled hot loops (store.speedups.MODULES, each pair registered with store.twins) are
built and in use, are switched off by LIGHTGATE_NO_EXTENSIONS=1, sit beside the pure module they
speed up, and compute exactly what their pure-Python twins compute (same batch bytes, same
light-queue entries, same packets and errors): each pair has a test here marked with its name."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from conftest import require_extensions
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lightqueue.dispatcher as dispatcher
import store.mqtt_batches as mqtt_batches
from lightgate.twins_docs import import_all
from lightqueue.db import Queue
from lightqueue.keys import entry_head
from lightqueue.model import StoredMessage
from mqtt_proxy.codec import EMPTY_PROPERTIES, Parser, Properties, Publish, RemoteProtocolError
from store.mapping import MqttMessage, MqttProperties, headers_for
from store.record_batch import build_batch, check_batch, check_records
from store.speedups import MODULES

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


def compiled() -> tuple[Any, Any]:
    """(store's compiled loops: the batch builder's and mapping's, as one namespace; the parser's)."""
    require_extensions()
    import types

    from mqtt_proxy.codec import _cparser  # type: ignore[attr-defined]
    from store import _cmapping, _cmqtt_batches  # type: ignore[attr-defined]

    store_loops = types.SimpleNamespace(
        **{k: getattr(m, k) for m in (_cmqtt_batches, _cmapping) for k in dir(m)
           if not k.startswith("_")}
    )  # fmt: skip
    return store_loops, _cparser


def compiled_delivery() -> Any:
    """The compiled delivery loops, each from the module beside the pure one it speeds up."""
    require_extensions()
    import importlib
    import types

    names = (
        "delivery._cqueue_cache",
        "delivery._ccohorts",
        "delivery._cqos1_run",
        "connection._chandlers",
        "delivery._coutbound",
        "backends._cbackend",
    )
    mods = [importlib.import_module(f"mqtt_proxy.{n}") for n in names]
    return types.SimpleNamespace(
        **{k: getattr(m, k) for m in mods for k in dir(m) if not k.startswith("_")}
    )


def compiled_blocks() -> Any:
    require_extensions()
    from lightqueue import _cblocks  # type: ignore[attr-defined]

    return _cblocks


def compiled_index() -> Any:
    require_extensions()
    from lightqueue import _cindex  # type: ignore[attr-defined]

    return _cindex


def compiled_resolve() -> Any:
    require_extensions()
    from lightqueue import _cresolve  # type: ignore[attr-defined]

    return _cresolve


def test_extensions_built_and_in_use() -> None:
    """On a machine with a C compiler `pip install -e .` builds them, and the hot paths call
    them (not the twins)."""
    sp, cp = compiled()
    assert mqtt_batches._build_records is sp.build_records
    assert dispatcher._index_batch is compiled_index().index_batch
    import mqtt_proxy.codec.parser as parser

    assert parser._walk is cp.walk
    import store.mapping as mapping

    assert mapping.murmur2 is sp.murmur2
    import lightqueue.resolver as resolver

    assert resolver._decode_records is compiled_resolve().decode_records
    import lightqueue._cblocks as cb

    import lightqueue.index_batch as index_batch
    import lightqueue.queues as queues

    assert queues._read_entries is cb.read_entries and index_batch._put_blocks is cb.put_blocks
    import lightqueue.db as lqdb

    assert lqdb._encode_block is cb.encode_block
    cr = compiled_resolve()
    assert resolver._resolve_cached is cr.resolve_cached
    assert resolver._cache_records is cr.cache_records and resolver._evict is cr.evict
    assert resolver._group_offsets is cr.group_offsets
    assert resolver._resolve_records is cr.resolve_records
    assert cp.__file__.endswith(".so")
    import mqtt_proxy.delivery.cohorts as cohorts
    import mqtt_proxy.delivery.queue_cache as queue_cache

    cd = compiled_delivery()
    assert cohorts.qos0_run is cd.qos0_run and queue_cache.fill_cache is cd.fill_cache
    assert queue_cache.evict_oldest is cd.evict_oldest
    import mqtt_proxy.connection.handlers as handlers

    assert handlers._publish_messages is cd.publish_messages
    import mqtt_proxy.delivery.outbound as outbound

    assert outbound.acks is cd.acks
    import mqtt_proxy.delivery.qos1_run as qos1_run

    assert qos1_run.qos1_run is cd.qos1_run
    import mqtt_proxy.backends.backend as backend

    assert backend._from_recent_runs is cd.from_recent
    assert issubclass(queue_cache.CachedMsg, cd.CachedBase)


def test_env_var_forces_pure_python() -> None:
    """LIGHTGATE_NO_EXTENSIONS=1: no compiled module loads and every registered site holds its
    pure twin (a class keeps the pure base it was built on)."""
    code = (
        "import store.speedups as s; from lightgate.twins_docs import import_all; "
        "twins = import_all(); print(s.status()); "
        "print(len(twins), all(t.compiled is None for t in twins)); "
        "import mqtt_proxy.delivery.queue_cache as q, mqtt_proxy.delivery.outbound as o, mqtt_proxy.connection.endpoint as mc, "
        "mqtt_proxy.codec.parser as p, store.commit as sc, lightqueue.dispatcher as d; "
        "print(q.CachedMsg.__base__ is q._CachedFields, mc.acks is o.acks_py, "
        "p._walk is p.Parser._walk, sc._FsyncPool, d._index_batch is d._index_batch_py)"
    )
    env = {**os.environ, "LIGHTGATE_NO_EXTENSIONS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    status, pairs, sites = out.stdout.splitlines()
    assert "True" not in status and status.count("False") == len(MODULES)
    n, all_pure = pairs.split()
    assert int(n) >= 20 and all_pure == "True"
    assert sites.split() == ["True", "True", "True", "None", "True"]


def test_every_twin_is_in_use() -> None:
    """Where the compiled modules are built, every registered site chose the compiled one."""
    compiled()
    twins = import_all()
    assert twins and [t.key for t in twins if t.compiled is None] == []
    for t in twins:
        assert sys.modules[t.module].__file__.endswith(".so"), t.module


def test_every_twin_has_an_equivalence_test() -> None:
    """Each registered pair is named by `@pytest.mark.twin(...)` on a test of this file that
    runs both implementations (a new compiled function needs its test before it can ship)."""
    marked: set[str] = set()
    for obj in list(globals().values()):
        for mark in getattr(obj, "pytestmark", []):
            if mark.name == "twin":
                marked.update(mark.args)
    registered = {t.key for t in import_all()}
    assert registered - marked == set(), "compiled twins without an equivalence test"
    assert marked - registered == set(), "marked twins that are not registered"


def test_each_compiled_module_sits_beside_the_one_module_it_speeds_up() -> None:
    """All pure twins of a compiled module live in one module, in the same package: the
    compiled code of a component is found next to it, and moves with it."""
    homes: dict[str, set[str]] = {}
    for t in import_all():
        home = t.site if t.pure is None else t.pure.__module__
        homes.setdefault(t.module, set()).add(home)
    for module, pure_modules in homes.items():
        assert len(pure_modules) == 1, f"{module} speeds up {sorted(pure_modules)}"
        (pure_module,) = pure_modules
        assert module.rpartition(".")[0] == pure_module.rpartition(".")[0], (module, pure_module)


def test_twins_table_in_docs_is_generated() -> None:
    """docs/architecture.md lists exactly the registered pairs (`python -m lightgate.twins_docs`)."""
    from lightgate.twins_docs import DOCS, docs_text

    have = DOCS.read_text()
    assert have == docs_text(have, import_all()), "run: python -m lightgate.twins_docs"


_header = st.one_of(
    st.tuples(st.just("mqtt.qos"), st.sampled_from([b"0", b"1", b"2", b"3", b"", b"01", None])),
    st.tuples(st.just("mqtt.client_id"), st.one_of(st.none(), st.binary(max_size=20))),
    st.tuples(st.sampled_from(["mqtt.retain", "x", "é", ""]), st.one_of(st.none(), st.binary(max_size=5))),
)  # fmt: skip
_plain = st.tuples(
    st.tuples(st.just("mqtt.qos"), st.sampled_from([b"0", b"1", b"2"])),
    st.tuples(st.just("mqtt.client_id"), st.binary(max_size=20)),
).map(list)
_record = st.tuples(
    st.integers(0, 2**45),
    st.one_of(st.none(), st.binary(max_size=30)),
    st.one_of(st.none(), st.binary(max_size=200)),
    st.one_of(_plain, st.lists(_header, max_size=4)),
)


@pytest.mark.twin("lightqueue._cresolve.decode_records")
@SETTINGS
@given(
    st.lists(_record, min_size=1, max_size=30),
    st.integers(0, 2**40),
    st.sampled_from([-1, 0, 2**41]),
    st.binary(max_size=3),
)
def test_decode_records_same_tuples(records: list[Any], base: int, lat: int, pad: bytes) -> None:
    """The compiled record reader and its twin (aiokafka's reader) give the same tuples: QoS
    and client id for exactly a plain PUBLISH's two headers, the header list otherwise."""
    sp, _ = compiled()
    from lightqueue.resolver import _decode_records_py

    batch = pad + bytes(build_batch(records, base))
    got = compiled_resolve().decode_records(batch, len(pad), len(batch) - len(pad), lat)
    assert got == _decode_records_py(batch, len(pad), len(batch) - len(pad), lat)
    assert [r[0] for r in got] == list(range(base, base + len(records)))
    for r, (ts, key, value, hs) in zip(got, records, strict=True):
        assert r[1:4] == (key, value, ts if lat < 0 else lat)
        plain = (
            len(hs) == 2 and hs[0][0] == "mqtt.qos" and hs[0][1] in (b"0", b"1", b"2")
            and hs[1][0] == "mqtt.client_id" and hs[1][1] is not None
        )  # fmt: skip
        assert (r[4] >= 0) == plain and (r[6] is None) == plain


@SETTINGS
@given(
    st.lists(_record, min_size=1, max_size=30),
    st.integers(0, 2**40),
    st.integers(-3, 33),
    st.integers(-3, 33),
)
def test_decode_records_range(records: list[Any], base: int, lo: int, hi: int) -> None:
    """With [lo, hi] both readers give exactly the records of the whole batch in that range (a
    reader far behind asks for a few hundred records of a batch of thousands)."""
    sp, _ = compiled()
    from lightqueue.resolver import _decode_records_py

    batch = bytes(build_batch(records, base))
    whole = compiled_resolve().decode_records(batch, 0, len(batch), -1)
    want = [r for r in whole if base + lo <= r[0] <= base + hi]
    assert compiled_resolve().decode_records(batch, 0, len(batch), -1, base + lo, base + hi) == want
    assert _decode_records_py(batch, 0, len(batch), -1, base + lo, base + hi) == want


_entry = st.one_of(
    st.none(),  # a void entry
    st.tuples(st.integers(0, 2**20), st.integers(0, 2**31 - 1), st.integers(0, 2**63 - 1)),
)


@pytest.mark.twin("lightqueue._cblocks.read_entries")
@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 3), _entry), max_size=40),
    st.integers(0, 2**40),
    st.integers(0, 3),
    st.lists(st.integers(0, 6), max_size=10),
    st.integers(0, 10),
)
def test_read_entries_same_as_twin(
    gaps_entries: list[Any], first: int, tail: int, cuts: list[int], back: int
) -> None:
    """A light queue's entries read back from LevelDB's (key, block) pairs, compiled and pure:
    the same tuples, None for void entries, retired topic ids and sequences no block holds,
    whichever way the entries were cut into blocks and wherever in a block the read starts."""
    sp, _ = compiled()
    from lightqueue.keys import (
        VOID_TID,
        block_count,
        encode_block_py,
        entry_key,
        pack_entry,
        read_entries_py,
    )

    names = ["", "t0", "t1"]  # topic id 0 is retired
    want: list[Any] = []
    runs: list[list[bytes]] = [[]]  # consecutive sequences: one or more blocks each
    run_first = [first]
    seq = first
    for gap, e in gaps_entries:
        if gap:
            want += [None] * gap
            seq += gap
            runs.append([])
            run_first.append(seq)
        if e is None:
            runs[-1].append(pack_entry(VOID_TID, 0, 0))
            want.append(None)
        else:
            tid = e[0] % 3
            runs[-1].append(pack_entry(tid, e[1], e[2]))
            want.append((names[tid], e[1], e[2]) if tid else None)
        seq += 1
    pairs = []
    cut_at = iter(cuts)
    for f, ents in zip(run_first, runs, strict=True):
        i = 0
        while i < len(ents):
            n = max(1, next(cut_at, len(ents)))
            pairs.append((entry_key(7, f + i), encode_block_py(b"".join(ents[i : i + n]))))
            i += n
    want += [None] * tail
    end = seq + tail
    # A read starts `back` entries into the data (the block holding its first sequence).
    start = min(first + back, end)
    want = want[start - first :]
    pairs = [p for p in pairs if int.from_bytes(p[0][5:], "big") + block_count(p[1]) > start]
    got = compiled_blocks().read_entries(iter(pairs), start, end, names)
    assert got == read_entries_py(iter(pairs), start, end, names) == want


@pytest.mark.twin("lightqueue._cblocks.put_blocks")
@SETTINGS
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 2**40)), max_size=6),
    st.integers(1, 8),
)
def test_put_blocks_same_as_twin(bufs: list[tuple[int, int]], block_max: int) -> None:
    """A round's entries per queue become the same (key, block) puts, compiled and pure: the
    first key at `next - n`, blocks of at most `block_max` entries, every entry once, in order;
    each queue's buffer is reset."""
    sp, _ = compiled()
    from lightqueue.keys import (
        decode_block_py,
        encode_block_py,
        entry_key,
        pack_entry,
        put_blocks_py,
    )

    results = []
    for fn in (put_blocks_py, compiled_blocks().put_blocks):
        qs, want = [], []
        for i, (n, nxt) in enumerate(bufs):
            q = Queue(f"q{i}", i, 0, 0, nxt + n)
            ents = [pack_entry(i, 0, nxt + j) for j in range(n)]
            q.buf = bytearray(b"".join(ents)) if n or i % 2 else None
            qs.append(q)
            want += [
                (entry_key(i, nxt + j), ents[j : j + block_max]) for j in range(0, n, block_max)
            ]
        puts: list[tuple[bytes, bytes]] = []
        fn(qs, lambda k, v, a=puts.append: a((k, v)), block_max)
        assert puts == [(k, encode_block_py(b"".join(e))) for k, e in want]
        assert [decode_block_py(v) for _, v in puts] == [b"".join(e) for _, e in want]
        assert all(q.buf is None for q in qs)
        results.append(puts)
    assert results[0] == results[1]


_block_entry = st.one_of(
    st.none(),  # void
    st.tuples(st.integers(0, 20), st.integers(0, 3), st.integers(-3, 3)),  # near the last offset
    st.tuples(st.integers(0, 20), st.integers(0, 3), st.integers(0, 2**63 - 1)),  # anywhere
)


@pytest.mark.twin("lightqueue._cblocks.encode_block")
@SETTINGS
@given(
    st.lists(_block_entry, max_size=80), st.lists(st.tuples(st.integers(0), st.integers(0, 255)))
)
@example([(0, 0, 2**63 - 1), (0, 0, 0), (0, 0, 2**63 - 1)], [])  # the widest jumps both ways
def test_block_codec_same_as_twin(ents: list[Any], damage: list[tuple[int, int]]) -> None:
    """Entries -> a compact block -> the same entries, compiled and pure byte for byte: runs,
    jumps both ways, voids and more heads than the encoder scans. A damaged block is refused
    (ValueError) by both or read the same by both, never read past."""
    from lightqueue.keys import (
        VOID_ENTRY,
        block_count,
        block_entries,
        decode_block_py,
        encode_block_py,
        pack_entry,
    )

    cb = compiled_blocks()
    last: dict[tuple[int, int], int] = {}
    raw = b""
    for e in ents:
        if e is None:
            raw += VOID_ENTRY
            continue
        tid, part, off = e
        if -3 <= off <= 3:
            off = min(max(last.get((tid, part), 0) + 1 + off, 0), 2**63 - 1)
        last[(tid, part)] = off
        raw += pack_entry(tid, part, off)
    v = encode_block_py(raw)
    assert cb.encode_block(raw) == v
    assert decode_block_py(v) == cb.decode_block(v) == raw
    assert block_count(v) == len(ents)
    assert len(block_entries(v)) == len(ents)
    bad = bytearray(v)
    for at, byte in damage:
        if bad:
            bad[at % len(bad)] = byte
    for cut in (len(bad), len(bad) // 2):
        outs = []
        for fn in (decode_block_py, cb.decode_block):
            try:
                outs.append(fn(bytes(bad[:cut])))
            except ValueError:
                outs.append(None)
        assert outs[0] == outs[1]


@pytest.mark.twin(
    "lightqueue._cresolve.resolve_cached",
    "lightqueue._cresolve.cache_records",
    "lightqueue._cresolve.evict",
)
@SETTINGS
@given(
    st.lists(_record, min_size=1, max_size=30),
    st.lists(st.one_of(st.none(), st.integers(0, 40)), max_size=40),
    st.sets(st.integers(0, 40)),
    st.booleans(),
)
def test_resolve_cached_same_as_twin(
    records: list[Any], wanted: list[int | None], asked: set[int], known_topics: bool
) -> None:
    """Entries -> messages from the resolver's cache, compiled and pure: the same messages
    (a plain PUBLISH built in place by the compiled one, any other record through
    `Resolver._message`), the same offsets missing, grouped by partition, and the same cache
    after (each record asked for replaced by its message); a message built in place is left
    off the cyclic GC's lists."""
    import gc

    from lightqueue.model import StoredMessage
    from lightqueue.resolver import Resolver, cache_records_py, evict_py, resolve_cached_py

    sp, _ = compiled()
    cr = compiled_resolve()
    batch = bytes(build_batch(records, 0))
    recs = compiled_resolve().decode_records(batch, 0, len(batch), -1)
    entries = [None if o is None else (("t", 0, o) if o % 7 else ("u", 1, o)) for o in wanted]
    outs = []
    for resolve, cache_records in ((resolve_cached_py, cache_records_py),
                                   (cr.resolve_cached, cr.cache_records)):  # fmt: skip
        res = Resolver(None)  # type: ignore[arg-type]  # only its record -> message view is used
        cache: dict[Any, Any] = {}
        order: deque[Any] = deque()
        assert cache_records(recs, cache, order, "t", 0) == len(recs)
        # already there: kept, not listed twice
        assert cache_records(recs[:3], cache, order, "t", 0) == min(3, len(recs))
        assert list(order) == list(cache) == [("t", 0, o) for o in range(len(recs))]
        for o in sorted(asked):  # asked for before: already a message in the cache
            if ("t", 0, o) in cache:
                cache[("t", 0, o)] = res._message("t", 0, cache[("t", 0, o)])
        if known_topics:
            for r in recs:
                res._message("t", 0, r)  # fills its topic mapping
        out, missing = resolve(entries, cache, res._topics, StoredMessage, res._message)
        assert len(out) == len(entries)
        for e, m in zip(entries, out, strict=True):
            assert (m is None) == (e is None or e not in cache)
            if m is not None:
                assert type(m) is StoredMessage and cache[e] is m
                assert (m.log_topic, m.partition, m.offset) == e
                built_here = known_topics and e[0] == "t" and e[2] not in asked
                if built_here and recs[e[2]][6] is None and resolve is cr.resolve_cached:
                    assert not gc.is_tracked(m)
        outs.append((out, missing, cache, order))
    (o1, m1, c1, d1), (o2, m2, c2, d2) = outs
    assert o1 == o2 and m1 == m2 and c1 == c2 and d1 == d2
    want: dict[Any, list[int]] = {}
    for e in entries:
        if e is not None and e not in c1:
            want.setdefault(e[:2], []).append(e[2])
    assert m1 == want
    # Eviction: the oldest keys go first, keys already gone are skipped, the rest stay.
    keep = len(c1) // 2
    for k in list(d1)[:2]:  # forgotten (e.g. a deleted topic) while still listed
        c1.pop(k, None)
        c2.pop(k, None)
    evict_py(c1, d1, keep)
    cr.evict(c2, d2, keep)
    assert c1 == c2 and d1 == d2 and len(c1) <= keep
    assert list(c1) == [k for k in d1 if k in c1]


@pytest.mark.twin("lightqueue._cresolve.group_offsets", "lightqueue._cresolve.resolve_records")
@SETTINGS
@given(
    st.lists(_record, min_size=1, max_size=30),
    st.lists(st.one_of(st.none(), st.integers(0, 40)), max_size=40),
    st.integers(0, 5),
    st.booleans(),
    st.booleans(),
)
def test_resolve_records_same_as_twin(
    records: list[Any], wanted: list[int | None], gap: int, known_topics: bool, shuffle: bool
) -> None:
    """A cold read's entries -> messages straight from the records read, compiled and pure:
    grouped offsets, then the same messages (each the record at its offset; None for a void
    entry or an offset no record has: past the end, in a gap, an unknown partition), whether
    the entries are in offset order per partition or not; a plain PUBLISH built in place is
    left off the cyclic GC's lists."""
    import gc
    import random

    from lightqueue.model import StoredMessage
    from lightqueue.resolver import Resolver, group_offsets_py, resolve_records_py

    sp, _ = compiled()
    cr = compiled_resolve()
    batch = bytes(build_batch(records, 0))
    recs = compiled_resolve().decode_records(batch, 0, len(batch), -1)
    recs = [r for r in recs if r[0] < 3 or r[0] >= 3 + gap]  # a hole in the records
    runs = {("t", 0): recs, ("u", 1): recs[: len(recs) // 2]}
    entries = [None if o is None else [("t", 0, o), ("u", 1, o), ("v", 2, o)][o % 3]
               for o in wanted]  # fmt: skip
    if shuffle:
        random.Random(len(entries)).shuffle(entries)
    assert group_offsets_py(entries) == cr.group_offsets(entries)
    outs = []
    for resolve in (resolve_records_py, cr.resolve_records):
        res = Resolver(None)  # type: ignore[arg-type]  # only its record -> message view is used
        if known_topics:
            for r in recs:
                res._message("t", 0, r)  # fills its topic mapping
                res._message("u", 1, r)
        out = resolve(entries, runs, res._topics, StoredMessage, res._message)
        assert len(out) == len(entries)
        for e, m in zip(entries, out, strict=True):
            have = e is not None and any(r[0] == e[2] for r in runs.get(e[:2], []))
            assert (m is not None) == have
            if m is not None:
                assert (m.log_topic, m.partition, m.offset) == e
                r = next(r for r in runs[e[:2]] if r[0] == e[2])
                assert m == res._message(e[0], e[1], r)
                if known_topics and r[6] is None and resolve is cr.resolve_records:
                    assert not gc.is_tracked(m)
        outs.append(out)
    assert outs[0] == outs[1]


@pytest.mark.twin("store._cmapping.murmur2")
@SETTINGS
@given(st.binary(max_size=80))
def test_murmur2_same_hash(key: bytes) -> None:
    sp, _ = compiled()
    from store.mapping import murmur2_py

    assert sp.murmur2(key) == murmur2_py(key)


props = st.one_of(
    st.none(),
    st.builds(
        MqttProperties,
        payload_format=st.sampled_from([None, 0, 1]),
        message_expiry=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
        content_type=st.one_of(st.none(), st.text(max_size=8)),
        user_properties=st.lists(
            st.tuples(st.text(max_size=6), st.text(max_size=6)), max_size=3
        ).map(tuple),
    ),
)
message = st.builds(
    MqttMessage,
    topic=st.sampled_from(["a", "a/b", "sensors/é/t", "x" * 300]),
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    client_id=st.text(max_size=10),
    retain=st.booleans(),
    properties=props,
    timestamp_ms=st.one_of(st.just(0), st.integers(0, 2**45)),
)


class _AttrMessage:
    """A message with MqttMessage's fields as plain attributes (no slots)."""

    def __init__(self, m: MqttMessage) -> None:
        self.topic, self.payload, self.qos = m.topic, m.payload, m.qos
        self.client_id, self.retain, self.properties = m.client_id, m.retain, m.properties
        self.timestamp_ms = m.timestamp_ms


@pytest.mark.twin("store._cmqtt_batches.build_records")
@SETTINGS
@given(st.lists(message, min_size=1, max_size=40), st.sampled_from([1, 200, 1 << 20]))
def test_build_records_same_bytes(msgs: list[MqttMessage], max_bytes: int) -> None:
    sp, _ = compiled()
    # Every third message of a class without slots: the compiled loop reads a MqttMessage's
    # fields from its slots and any other message by attribute, switching as the type changes.
    msgs = [_AttrMessage(m) if i % 3 == 2 else m for i, m in enumerate(msgs)]  # type: ignore[misc]
    keys = [m.topic.encode() for m in msgs]
    idxs = list(range(len(msgs)))
    j0 = 0
    while j0 < len(msgs):
        a, ja, ta = mqtt_batches._build_records_py(msgs, idxs, j0, keys, 1234, {}, max_bytes)
        b, jb, tb = sp.build_records(msgs, idxs, j0, keys, 1234, {}, max_bytes)
        assert (bytes(a), ja, ta) == (bytes(b), jb, tb)
        assert type(b) is bytearray  # the store rewrites the base offset in place
        check_batch(b)
        check_records(b)
        j0 = ja


@pytest.mark.twin("store._cmqtt_batches.group_by_slot")
@SETTINGS
@given(
    st.lists(st.sampled_from(["a", "a/b", "b/c", "bad", "x" * 300]), max_size=40),
    st.integers(1, 4),
    st.booleans(),
)
def test_group_by_slot_same_as_twin(topics: list[str], nslots: int, as_tuple: bool) -> None:
    """An append's partition groups and keys, compiled and pure: the same groups in the same
    order, one route call per topic, and the same error when a topic cannot be routed (plain
    and slot-less messages mixed, runs of one topic object and equal but distinct strs)."""
    sp, _ = compiled()
    msgs: list[Any] = []
    for i, t in enumerate(topics):
        if i % 2:
            t = "".join(list(t))  # an equal str that is not the same object
        m = MqttMessage(t, b"p", 0, "c")
        msgs.append(_AttrMessage(m) if i % 5 == 4 else m)
    results = []
    for fn in (mqtt_batches.group_by_slot_py, sp.group_by_slot):
        calls: list[str] = []

        def route(topic: str, calls: list[str] = calls) -> tuple[int, bytes]:
            calls.append(topic)
            if topic == "bad":
                raise ValueError("cannot route")
            return len(topic) % nslots, topic.encode()

        try:
            res: Any = fn(tuple(msgs) if as_tuple else msgs, route)
        except ValueError as e:
            res = str(e)
        results.append((res, sorted(calls)))
    assert results[0] == results[1]
    res, calls = results[1]
    assert len(calls) == len(set(calls))  # one route call per topic
    if not isinstance(res, str):
        groups, keys = res
        assert sorted(i for g in groups.values() for i in g) == list(range(len(msgs)))
        assert keys == [m.topic.encode() for m in msgs]


@pytest.mark.twin("mqtt_proxy.delivery._cqueue_cache.cached_end")
@SETTINGS
@given(st.sets(st.integers(0, 80)), st.integers(-5, 90), st.integers(0, 40))
def test_cached_end_same_as_twin(held: set[int], pos: int, n: int) -> None:
    """Where a reader's cached run from `pos` ends (at most `n` on), compiled and pure."""
    from mqtt_proxy.delivery.queue_cache import cached_end_py

    cache: dict[int, Any] = dict.fromkeys(held)
    got = compiled_delivery().cached_end(cache, pos, pos + n)
    assert got == cached_end_py(cache, pos, pos + n)
    assert pos <= got <= pos + n and all(s in cache for s in range(pos, got))
    assert got == pos + n or got not in cache


@SETTINGS
@given(st.lists(st.integers(0, 60), unique=True), st.integers(-5, 70))
def test_trim_below_same_as_twin(keys: list[int], low: int) -> None:
    """A queue's cache trimmed to what its readers still need (`Delivery._trim`: the eviction
    over the whole cache): every key below `low` goes, wherever it was inserted, compiled and
    pure; the rest keep their order."""
    from mqtt_proxy.delivery.queue_cache import evict_oldest_py

    a: dict[int, Any] = {k: str(k) for k in keys}
    b = dict(a)
    compiled_delivery().evict_oldest(a, len(a), low)
    evict_oldest_py(b, len(b), low)
    assert list(a.items()) == list(b.items()) == [(k, str(k)) for k in keys if k >= low]


@pytest.mark.twin("mqtt_proxy.delivery._cqueue_cache.evict_oldest")
@SETTINGS
@given(st.lists(st.integers(0, 60), unique=True), st.integers(0, 70), st.integers(-5, 70))
def test_evict_oldest_same_as_twin(keys: list[int], over: int, start: int) -> None:
    """A queue's cache held to its size: the oldest `over` keys below `start` go, compiled and
    pure; insertion order (not key order) says which are oldest."""
    from mqtt_proxy.delivery.queue_cache import evict_oldest_py

    a: dict[int, Any] = dict.fromkeys(keys)
    b = dict(a)
    compiled_delivery().evict_oldest(a, over, start)
    evict_oldest_py(b, over, start)
    assert list(a) == list(b)
    oldest = keys[:over]
    assert list(a) == [k for k in keys if not (k in oldest and k < start)]


def _index_both(data: bytes, base: int, c: int, end: int, budget: int, gated: bool) -> list[Any]:
    """Run both implementations on fresh queues; return what each did."""
    sp, _ = compiled()
    results = []
    for fn in (dispatcher._index_batch_py, compiled_index().index_batch):
        filt = Queue("f/#", 1, 1, 0, 0)
        qs: dict[bytes | None, Queue] = {}
        if gated:
            filt.gate = {(3, 0): base + 2}
        grown: list[Queue] = []

        def targets(
            k: bytes | None, qs: dict[bytes | None, Queue] = qs, filt: Queue = filt
        ) -> tuple[Queue, ...]:
            q = qs.setdefault(k, Queue(repr(k), 10 + len(qs), 0, 5, 5))
            q.watch = []
            return (q, filt)

        try:
            r: Any = fn(
                data, 0, len(data), base, c, end, 0, budget, {}, targets,
                entry_head(3, 0), 7, grown, (3, 0) if gated else None, "t", 0,
            )  # fmt: skip
        except (ValueError, dispatcher.InvalidRecordError):
            r = "error"
        watched = [(q.qid, q.watch, bytes(q.buf or b""), q.next) for q in qs.values()]
        results.append((r, [q.qid for q in grown], watched, bytes(filt.buf or b""), filt.next))
    return results


@pytest.mark.twin("lightqueue._cindex.index_batch")
@SETTINGS
@given(
    st.lists(message, min_size=1, max_size=30),
    st.integers(0, 2**40),
    st.integers(0, 40),
    st.integers(0, 40),
    st.integers(0, 35),
    st.booleans(),
    st.lists(st.sampled_from([None, b"", b"a", b"ab", b"b"]), min_size=30, max_size=30),
)
def test_index_batch_same_entries(
    msgs: list[MqttMessage],
    base: int,
    c: int,
    span: int,
    budget: int,
    gated: bool,
    keys: list[bytes | None],
) -> None:
    """Runs of one key (the compiled loop hands a run to its queues at once), keyless records
    (a Kafka producer's) and an empty key; headers as an MQTT message's."""
    recs = [(1, k, m.payload, headers_for(m)) for m, k in zip(msgs, keys, strict=False)]
    data = bytes(build_batch(recs, base))
    py, cy = _index_both(data, base, base + c, base + c + span, budget, gated)
    assert py == cy


def _spec_reads_like_aiokafka(batch: bytes) -> bool:
    """False where aiokafka's reader (the twin's, via `records_of`) and the spec part ways on a
    garbled batch: it reads a record's unused int8 attributes as a varint, so a byte >= 0x80
    there shifts every field after it; the compiled loop and store.record_batch read one byte
    (found by hypothesis: cut=62, junk=b"\\x80"). Real batches carry 0 there."""
    from aiokafka.record._crecords import DefaultRecordBatch

    from store.record_batch import HEADER, HEADER_SIZE, _records_py

    def decode(read: Any) -> Any:
        try:
            return [(r.offset, r.key) for r in read()]
        except Exception:
            return None

    count = HEADER.unpack_from(batch)[-1]  # record_count, the header's last field
    ours = decode(lambda: _records_py(batch, HEADER_SIZE, len(batch), count, 0, 0, -1))
    theirs = decode(lambda: DefaultRecordBatch(batch))
    return ours is None or theirs is None or ours == theirs


@SETTINGS
@given(st.integers(61, 400), st.binary(min_size=1, max_size=8))
@example(62, b"\x80")  # the first record's attributes byte (see above)
def test_index_batch_garbled(cut: int, junk: bytes) -> None:
    """Bytes overwritten under the header: where both decode, the same entries (a batch the
    store accepted uncompressed passed aiokafka's reader at append, so only agreement on what
    both read matters); the dispatcher test pins that an undecodable batch is skipped."""
    msgs = [MqttMessage(f"g/{i}", b"v" * i, 0, "c") for i in range(5)]
    good = bytes(
        mqtt_batches._build_records_py(msgs, list(range(5)), 0, [b"g"] * 5, 1, {}, 1 << 30)[0]
    )
    cut = min(cut, len(good) - 1)
    bad = (good[:cut] + junk + good[cut + len(junk) :])[: len(good)]
    py, cy = _index_both(bad, 0, 0, 100, 100, False)
    if py[0] != "error" and cy[0] != "error" and _spec_reads_like_aiokafka(bad):
        assert py == cy
    tail = good[:-8] + b"\xff" * 8  # tests/kafka_helpers.garble_records: no reader decodes it
    py, cy = _index_both(tail, 0, 0, 100, 100, False)
    assert py[0] == cy[0] == "error" and py[1] == cy[1] == []


@pytest.mark.twin("mqtt_proxy.codec._cparser.walk")
@SETTINGS
@given(
    st.sampled_from([None, 3, 4, 5]),
    st.lists(st.binary(max_size=40), max_size=6),
    st.binary(max_size=200),
)
def test_parser_walk_same_packets_and_errors(
    version: int | None, pieces: list[bytes], tail: bytes
) -> None:
    """Random and semi-valid streams, fed in pieces: same packets, same error, same tail."""
    _, cp = compiled()
    import mqtt_proxy.codec.parser as parser

    stream = b"".join([bytes([0x30, len(p) + 4, 0, 2]) + b"t/" + p[:120] for p in pieces]) + tail
    out: list[Any] = []
    for walk in (Parser._walk, cp.walk):
        old = parser._walk
        parser._walk = walk
        try:
            p = Parser(version=version)
            got: list[Any] = []
            try:
                for i in range(0, len(stream), 37):
                    got += p.feed(stream[i : i + 37])
                got.append(("tail", p.buffered))
            except RemoteProtocolError as e:
                got += e.packets
                got.append(("error", str(e), e.reason_code))
        finally:
            parser._walk = old
        out.append(got)
    assert out[0] == out[1]


def test_clean_removes_built_modules() -> None:
    """`make clean` deletes what `pip install -e .` builds into the source tree: each compiled
    module's C file and shared object, wherever its package sits."""
    text = (ROOT / "Makefile").read_text()
    clean = text[text.index("\nclean:") :]
    clean = clean[: clean.index("\n\n")] if "\n\n" in clean else clean
    globs = [w for w in clean.replace("\\", " ").split() if "/" in w]
    sources = re.findall(r'"([\w/]+)\.pyx"', (ROOT / "setup.py").read_text())
    assert sources
    for src in sources:
        folder = src.rpartition("/")[0]
        assert any(PurePosixPath(src + ".c").match(g) for g in globs), src + ".c"
        assert any(PurePosixPath(folder + "/x.so").match(g) for g in globs), folder + "/*.so"
    # Nor does git see them: every source's C file and shared object matches an ignore pattern.
    patterns = [
        line.strip().lstrip("/")
        for line in (ROOT / ".gitignore").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "!"))
    ]
    for src in sources:
        for built in (src + ".c", src + ".cpython-311-x86_64-linux-gnu.so"):
            assert any(PurePosixPath(built).match(p) for p in patterns), built


@pytest.mark.twin("store._cmapping.untrack")
def test_hot_objects_are_not_tracked_by_the_gc() -> None:
    """What fan-in makes per message holds no object that could close a reference cycle, so the
    compiled paths take it off the cyclic GC's lists (before: ~10 % of a fan-in run's CPU in
    young and middle collections): the parsed PUBLISH, the message, the pushed entry."""
    import gc

    sp, _ = compiled()
    from store.mapping import untrack_messages

    pkts = Parser(version=4).feed(b"\x30\x07\x00\x03a/b" + b"xy")
    assert len(pkts) == 1 and not gc.is_tracked(pkts[0])
    msgs = [MqttMessage("a/b", b"xy", 0, "c"), MqttMessage("a/b", b"z", 1, "c")]
    assert all(gc.is_tracked(m) for m in msgs)
    untrack_messages(msgs)
    assert not any(gc.is_tracked(m) for m in msgs)
    from store.mapping import _keep_tracked  # the pure twin: same messages, left to the GC

    kept = [MqttMessage("a/b", b"xy", 0, "c"), MqttMessage("a/b", b"z", 1, "c")]
    _keep_tracked(kept)
    assert kept == msgs and all(gc.is_tracked(m) for m in kept)
    # The pushed entries: (topic, partition, offset) tuples appended to a watched queue.
    q = Queue("f", 1, 1, 0, 0)
    q.watch = []
    data = bytes(build_batch([(1, b"k", b"v", [])] * 3, 40))
    compiled_index().index_batch(data, 0, len(data), 40, 0, 100, 0, 10, {}, lambda k: (q,), entry_head(1, 0),
                   1, [], None, "t", 0)  # fmt: skip
    assert q.watch == [("t", 0, 40), ("t", 0, 41), ("t", 0, 42)]
    assert not any(gc.is_tracked(e) for e in q.watch)


_word = st.text(alphabet="abcé /+", max_size=6)  # valid MQTT strings: packets parse back
_dprops = st.one_of(
    st.none(),
    st.builds(
        MqttProperties,
        payload_format=st.sampled_from([None, 0, 1]),
        message_expiry=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
        content_type=st.one_of(st.none(), _word),
        user_properties=st.lists(st.tuples(_word, _word), max_size=3).map(tuple),
    ),
)
_mfields = dict(
    topic=st.sampled_from(
        ["a", "a/b", "sensors/é/t", "x" * 300, "__lightgate_x", "__lightgate_probe/1"]
    ),
    payload=st.binary(max_size=300),
    qos=st.integers(0, 2),
    client_id=st.text(max_size=4),
    retain=st.booleans(),
    properties=_dprops,
    timestamp_ms=st.sampled_from([0, 1000, 1001, 2**40]),
)
_cached = st.one_of(  # as the proxy appended it (MqttMessage) or as read back (StoredMessage)
    st.none(),
    st.builds(MqttMessage, **_mfields),
    st.builds(StoredMessage, **_mfields, log_topic=st.just("mqtt"), partition=st.integers(0, 3),
              offset=st.integers(0, 2**40)),
)  # fmt: skip


@pytest.mark.twin(
    "mqtt_proxy.delivery._cqueue_cache.fill_cache", "mqtt_proxy.delivery._ccohorts.qos0_run"
)
@SETTINGS
@example(  # found by this test: a message stamped after `now` kept its whole expiry, and more
    [MqttMessage("a", b"", 0, "", False, MqttProperties(message_expiry=3_195_455_668), 2**40)],
    0, True, (), False, 1, False, True,
)  # fmt: skip
@given(
    st.lists(_cached, max_size=30),
    st.integers(0, 2**41),
    st.booleans(),
    st.sampled_from([(), (7,), (300, 5)]),
    st.booleans(),
    st.integers(1, 3),
    st.booleans(),
    st.booleans(),
)
def test_delivery_cache_and_qos0_run_same_as_twins(
    msgs: list[MqttMessage | None],
    now_ms: int,
    v5: bool,
    sub_ids: tuple[int, ...],
    rap: bool,
    nsubs: int,
    warm: bool,
    raw: bool,
) -> None:
    """The compiled cache fill and cohort run give the fields, the packet bytes and the latency
    observations of their twins (expired messages, retain-as-published, properties,
    subscription ids, internal topics, v5; `warm`: packets some other reader built first;
    `raw`: messages without properties cached as they are, made CachedMsgs where needed)."""
    import gc

    cd = compiled_delivery()
    from mqtt_proxy.delivery.cohorts import qos0_run_py
    from mqtt_proxy.delivery.queue_cache import RAW_TYPES, CachedMsg, cached, fill_cache_py

    raw_types = RAW_TYPES if raw else ()
    caches: list[dict[int, Any]] = [{}, {}]
    fill_cache_py(CachedMsg, msgs, caches[0], 5, "__lightgate", "__lightgate_probe/", raw_types)
    cd.fill_cache(CachedMsg, msgs, caches[1], 5, "__lightgate", "__lightgate_probe/", raw_types)
    fields = ("topic", "payload", "qos", "retain", "client_id", "props", "ts_ms", "expire_at_ms")
    for m, a, b in zip(msgs, caches[0].values(), caches[1].values(), strict=True):
        assert (a is None) == (b is None)
        if b is None:
            continue
        if raw and m is not None and m.properties is None:
            assert a is b is m  # kept as it is
        else:
            assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
            assert type(b) is CachedMsg and not gc.is_tracked(b)
    if warm:
        for cache in caches:
            for m in cache.values():
                if isinstance(m, CachedMsg):
                    m.qos0(False, False, (), now_ms)
    out = []
    for run, cache in ((qos0_run_py, caches[0]), (cd.qos0_run, caches[1])):
        seen: list[tuple[int, int]] = []
        res = run(cache, 5, 5 + len(msgs), now_ms, v5, sub_ids, rap,
                  lambda lat, k, seen=seen: seen.append((lat, k)), nsubs, cached)  # fmt: skip
        out.append((res, seen))
    assert out[0] == out[1]
    # the raw messages a run had to make CachedMsgs (subscription ids) became them in both
    assert [type(m) for m in caches[0].values()] == [type(m) for m in caches[1].values()]
    data, n = out[1][0]
    if n:  # whole packets, as the codec reads them
        got = Parser(version=5 if v5 else 4).feed(data)
        assert len(got) == n


@pytest.mark.twin("mqtt_proxy.delivery._cqueue_cache.CachedBase")
@SETTINGS
@given(st.builds(MqttMessage, **_mfields))
def test_cached_base_same_fields_as_twin(m: MqttMessage) -> None:
    """The compiled base of CachedMsg starts with the fields of its pure twin (the expiry too)."""
    from mqtt_proxy.delivery.queue_cache import _CachedFields

    cd = compiled_delivery()
    args = (m.topic, m.payload, m.qos, m.retain, m.client_id, m.properties, m.timestamp_ms)
    a, b = _CachedFields(*args), cd.CachedBase(*args)
    assert [getattr(a, f) for f in _CachedFields.__slots__] == [
        getattr(b, f) for f in _CachedFields.__slots__
    ]


@pytest.mark.twin("store._fsync.FsyncPool")
def test_fsync_pool_same_as_python_threads(tmp_path: Path) -> None:
    """SyncWorkers on the compiled pool and on its Python threads: a file and its directory
    synced (done(None)), an fd that cannot be synced (a pipe) failing with the same errno."""
    require_extensions()
    import asyncio

    import store.commit as commit
    from store.twins import use_pure

    async def run(workers: Any) -> list[int | None]:
        loop = asyncio.get_running_loop()
        r, w = os.pipe()
        path = tmp_path / "f"
        path.write_bytes(b"x")
        fd = os.open(path, os.O_RDWR)
        try:
            out: list[int | None] = []
            for fds, directory in (([fd], tmp_path), ([r], None)):
                fut = loop.create_future()
                workers.submit(loop, fds, directory, fut.set_result)
                err = await asyncio.wait_for(fut, 10)
                out.append(None if err is None else err.errno)
            return out
        finally:
            os.close(fd)
            os.close(r)
            os.close(w)

    got = []
    for pure in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            if pure:
                use_pure(mp.setattr, ["store._fsync.FsyncPool"])
            workers = commit.SyncWorkers(2, "twin-test")
            assert (workers._pool is None) is pure
            try:
                got.append(asyncio.run(run(workers)))
            finally:
                workers.shutdown()
    assert got[0] == got[1] and got[0][0] is None and got[0][1] is not None


@pytest.mark.twin("mqtt_proxy.delivery._cqos1_run.qos1_run")
@SETTINGS
@given(
    st.lists(_cached, max_size=30),
    st.integers(0, 2**41),
    st.sets(st.integers(0, 29)),
    st.sets(st.integers(1, 12)),
    st.integers(0, 12),
    st.sampled_from([1, 2, 65534, 65535]),
    st.integers(1, 2),
    st.booleans(),
    st.booleans(),
)
def test_qos1_run_same_as_twin(
    msgs: list[MqttMessage | None],
    now_ms: int,
    pending_at: set[int],
    pids_in_flight: set[int],
    room: int,
    pid: int,
    sub_qos: int,
    rap: bool,
    raw: bool,
) -> None:
    """A 3.1.1 QoS 1 reader's run, compiled and pure, from CachedMsgs or (`raw`) messages
    cached as they are: the same packets (each parses back as a
    QoS 1 PUBLISH with the packet id recorded for it), the same in-flight records and pending
    sequences, the same stop (a message for the general path, or blocked) and the same latency
    observations, whatever is already pending or in flight; in-flight records built in place
    are left off the cyclic GC's lists."""
    import gc

    cd = compiled_delivery()
    from mqtt_proxy.delivery.qos1_run import qos1_run_py
    from mqtt_proxy.delivery.queue_cache import RAW_TYPES, CachedMsg, fill_cache_py
    from mqtt_proxy.sessions.state import Inflight

    cache: dict[int, Any] = {}
    raw_types = RAW_TYPES if raw else ()
    fill_cache_py(CachedMsg, msgs, cache, 5, "__lightgate", "__lightgate_probe/", raw_types)
    results = []
    for run in (qos1_run_py, cd.qos1_run):
        pending = {5 + i: 100 + i for i in pending_at}
        inflight = {p: Inflight("q", 0, 1, b"old", False, "f") for p in pids_in_flight}
        seen: list[tuple[int, int]] = []
        out: list[bytes] = [b"before"]
        res = run(cache, 5, 5 + len(msgs), pending, inflight, room, pid, now_ms, "q", "f/+",
                  Inflight, lambda lat, k, seen=seen: seen.append((lat, k)), out, sub_qos,
                  rap)  # fmt: skip
        results.append((res, out, pending, inflight, seen))
    assert results[0] == results[1]
    (seq, next_pid, nbytes, blocked), out, pending, inflight, seen = results[1]
    assert 5 <= seq <= 5 + len(msgs) and nbytes == sum(len(d) for d in out[1:])
    sent = [p for p in inflight if p not in pids_in_flight]
    assert len(sent) == len(out) - 1 <= room
    if blocked:
        assert len(sent) == room and seq < 5 + len(msgs)
    elif seq < 5 + len(msgs):  # stopped at a message for the general path
        m = cache[seq]
        assert min(m.qos, sub_qos) != 1 or (rap and m.retain)
    for data, p in zip(out[1:], sent, strict=True):
        (pkt,) = Parser(version=4).feed(data)
        assert pkt.qos == 1 and pkt.packet_id == p and not pkt.retain and not pkt.dup
        inf = inflight[p]
        assert inf.data == data and pending[inf.seq] == p and inf.filter_raw == "f/+"
        assert (pkt.topic, pkt.payload) == (cache[inf.seq].topic, cache[inf.seq].payload)
        assert not gc.is_tracked(inf)
    assert sum(k for _, k in seen) == len(sent)


# As the parser makes them (tuple.__new__, no checks: packet id 0 at QoS 0).
_publish = st.builds(
    lambda topic, payload, qos, retain, pid, props: tuple.__new__(
        Publish, (topic, payload, qos, retain, False, pid if qos else 0, props)
    ),
    st.sampled_from(["a", "a/b", "$SYS/x", "sensors/é/t", "x" * 300]),
    st.binary(max_size=100),
    st.integers(0, 2),
    st.booleans(),
    st.integers(1, 65535),
    st.sampled_from([EMPTY_PROPERTIES, Properties(content_type="t")]),
)


@pytest.mark.twin("mqtt_proxy.delivery._coutbound.acks")
@SETTINGS
@given(st.sampled_from([4, 5]), st.lists(st.integers(1, 0xFFFF), max_size=300))
@example(4, [1, 0xFF, 0x100, 0xFFFF])
def test_acks_same_as_twin(ptype: int, pids: list[int]) -> None:
    """One fsync's PUBACKs / PUBRECs of a connection: the compiled writer's bytes are its twin's,
    each parsed back as the ack of its packet id, in order; an id out of range is refused."""
    from mqtt_proxy.codec import Puback, Pubrec
    from mqtt_proxy.delivery.outbound import acks_py

    cd = compiled_delivery()
    got = cd.acks(ptype, pids)
    assert got == acks_py(ptype, pids)
    parsed = Parser(version=4).feed(got) if pids else []
    assert [type(a) for a in parsed] == [Puback if ptype == 4 else Pubrec] * len(pids)
    assert [a.packet_id for a in parsed] == pids
    for bad in (0x10000, -1):
        with pytest.raises(ValueError):
            cd.acks(ptype, [*pids, bad])


@pytest.mark.twin("mqtt_proxy.connection._chandlers.publish_messages")
@SETTINGS
@given(st.lists(_publish, max_size=30), st.integers(0, 30), st.integers(0, 2**41))
def test_publish_messages_same_as_twin(packets: list[Any], i: int, now_ms: int) -> None:
    """The compiled chunk-to-messages loop stops where its twin stops (QoS 2, retained,
    properties, `$`) and builds equal messages with the same packet ids, left untracked by the
    cyclic GC and usable as the dataclass (hash, replace)."""
    import dataclasses
    import gc

    cd = compiled_delivery()
    from mqtt_proxy.connection.handlers import publish_messages_py

    i = min(i, len(packets))
    want = publish_messages_py(packets, i, "dev-1", now_ms, EMPTY_PROPERTIES, MqttMessage)
    got = cd.publish_messages(packets, i, "dev-1", now_ms, EMPTY_PROPERTIES, MqttMessage)
    assert got == want
    stop = want[2]
    assert stop == len(packets) or (
        packets[stop].qos == 2 or packets[stop].retain
        or packets[stop].properties is not EMPTY_PROPERTIES or packets[stop].topic[0] == "$"
    )  # fmt: skip
    assert want[1] == [p.packet_id for p in packets[i:stop] if p.qos]
    for m, w in zip(got[0], want[0], strict=True):
        assert type(m) is MqttMessage and not gc.is_tracked(m)
        assert hash(m) == hash(w) and dataclasses.replace(m, qos=0) == dataclasses.replace(w, qos=0)


@pytest.mark.twin("mqtt_proxy.backends._cbackend.from_recent")
@SETTINGS
@given(
    st.dictionaries(
        st.tuples(st.sampled_from(["mqtt", "other"]), st.integers(0, 1)),
        st.lists(st.tuples(st.integers(0, 8), st.integers(0, 6)), min_size=1, max_size=4),
        max_size=3,
    ),
    st.lists(
        st.one_of(st.none(), st.tuples(st.sampled_from(["mqtt", "other", "x"]),
                                       st.integers(0, 2), st.integers(0, 60))),
        max_size=40,
    ),
)  # fmt: skip
def test_from_recent_same_as_twin(
    layout: dict[tuple[str, int], list[tuple[int, int]]], entries: list[Any]
) -> None:
    """Entries resolved from the recent-append runs, compiled and pure: the same messages and
    the same indexes left to read from the store (gaps between runs, a run's end, unknown
    partitions, void entries); each found message is the one at its offset."""
    from mqtt_proxy.backends.backend import from_recent_py

    cd = compiled_delivery()
    parts: dict[tuple[str, int], tuple[list[int], list[list[Any]]]] = {}
    for (t, p), runs in layout.items():
        bases, rs, base = [], [], 0
        for gap, n in runs:  # ascending bases, a gap (or none) between runs
            base += gap
            bases.append(base)
            rs.append([f"{t}-{p}-{base + j}" for j in range(n)])
            base += n
        parts[(t, p)] = (bases, rs)
    outs: list[list[Any]] = [[None] * len(entries), [None] * len(entries)]
    missing = [from_recent_py(entries, parts, outs[0]), cd.from_recent(entries, parts, outs[1])]
    assert missing[0] == missing[1] and outs[0] == outs[1]
    for i, e in enumerate(entries):
        if outs[1][i] is not None:
            assert outs[1][i] == f"{e[0]}-{e[1]}-{e[2]}"
        else:
            assert e is None or i in missing[1]
