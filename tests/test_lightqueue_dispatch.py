"""Dispatch on the real store: exact and filter queues against a brute-force matcher."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightqueue_helpers import flushed, msg, open_all

from lightqueue.dispatcher import HOLD_S, SYNC_RECORDS, Dispatcher
from lightqueue.keys import checkpoint_key, entry_prefix
from lightqueue.topic_trie import topic_matches
from notify import InProcessNotifier
from store.record_batch import iter_batches


async def test_exact_and_filter_queues(tmp_path: Path) -> None:
    store, lq = await open_all(tmp_path, partitions=2)
    await lq.start()
    store.append_mqtt([msg("a/b/c"), msg("a/x/c"), msg("b/1")])
    await flushed(store)
    lq.dispatcher.catch_up()
    assert lq.info("a/b/c")[1:] == (0, 1)  # type: ignore[index]
    # A new filter queue starts at the current end: earlier records are not in it.
    acq = lq.acquire_filter("a/+/c")
    assert acq == ("a/+/c", 0)
    store.append_mqtt([msg("a/b/c", b"2"), msg("a/y/c", b"3"), msg("a/y/d")])
    await flushed(store)
    lq.dispatcher.catch_up()
    res = lq.read("a/+/c", 0, 10)
    assert (res.start_seq, res.next_seq, res.first_seq) == (0, 2, 0)
    msgs = lq.resolve(res.entries)
    assert sorted((m.topic, m.payload) for m in msgs if m) == [("a/b/c", b"2"), ("a/y/c", b"3")]
    m = lq.resolve(lq.read("a/b/c", 1, 1).entries)[0]
    assert m is not None and (m.topic, m.payload, m.qos, m.client_id) == ("a/b/c", b"2", 1, "c")
    assert m.log_topic == "a" and m.offset >= 0
    await lq.close()
    await store.close()


async def test_events_are_coalesced_per_queue_and_routed(tmp_path: Path) -> None:
    notifier = InProcessNotifier(resync_interval=None)
    store, lq = await open_all(tmp_path, sink=notifier.publish)
    notifier.register("p1", ["s/+/t"])
    notifier.register("p2", ["s/1/t"])
    await lq.start()
    lq.acquire_filter("s/+/t")
    store.append_mqtt([msg(f"s/{i % 3}/t") for i in range(100)])
    await flushed(store)
    lq.dispatcher.catch_up()
    box1, box2 = notifier.routes.mailbox("p1"), notifier.routes.mailbox("p2")
    assert box1.take() == {"s/+/t": 99}  # one event for 100 messages
    assert box2.take() == {"s/1/t": 32}  # 33 messages: seqs 0..32
    await lq.close()
    await store.close()


async def test_live_dispatch_wakes_on_append(tmp_path: Path) -> None:
    got: list[tuple[str, int]] = []
    store, lq = await open_all(tmp_path, sink=got.extend)
    await lq.start()
    lq.acquire_filter("#")
    store.append_mqtt([msg("x/y")])
    for _ in range(100):
        if ("#", 0) in got:
            break
        await asyncio.sleep(0.01)
    assert ("x/y", 0) in got and ("#", 0) in got
    await lq.close()
    await store.close()


async def test_kafka_records_map_per_interfaces(tmp_path: Path) -> None:
    """A Kafka-produced record: its key if it maps back to the log topic, else the topic name."""
    from store.record_batch import build_batch

    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.acquire_filter("orders/#")
    store.ensure_topic("orders", 1)
    batch = build_batch([
        (1000, b"orders/eu/1", b"v1", [("mqtt.qos", b"0")]),
        (1001, b"other/x", b"v2", []),  # first level maps elsewhere: seen on `orders`
        (1002, None, b"v3", [("h", b"1")]),
    ])  # fmt: skip
    store.append_batch("orders", 0, bytes(batch))
    store.ensure_topic("__lightgate_internal", 1)
    store.append_batch("__lightgate_internal", 0, bytes(build_batch([(1, b"k", b"v", [])])))
    await flushed(store)
    lq.dispatcher.catch_up()
    assert lq.info("orders/eu/1")[2] == 1  # type: ignore[index]
    assert lq.info("orders")[2] == 2  # type: ignore[index]
    ms = lq.resolve(lq.read("orders/#", 0, 10).entries)
    assert [(m.topic, m.payload, m.qos) for m in ms if m] == [
        ("orders/eu/1", b"v1", 0), ("orders", b"v2", 1), ("orders", b"v3", 1)
    ]  # fmt: skip
    assert ms[2] is not None and ms[2].properties is not None
    assert ms[2].properties.user_properties == (("h", "1"),)
    assert not any(n.startswith("__") or n == "k" for n in lq.queue_names())
    await lq.close()
    await store.close()


LEVEL = st.sampled_from(["a", "b", "c", ""])
TOPIC = (
    st.lists(LEVEL, min_size=1, max_size=4).map("/".join).filter(lambda t: bool(t) and t[0] != "/")
)


@st.composite
def a_filter(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from(["a", "b", "+", ""]), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "#"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("pub"), st.lists(TOPIC, min_size=1, max_size=20)),
            st.tuples(st.just("sub"), a_filter()),
        ),
        min_size=1,
        max_size=12,
    ),
    partitions=st.sampled_from([1, 3]),
)
def test_dispatch_matches_brute_force(tmp_path_factory, steps, partitions) -> None:  # type: ignore[no-untyped-def]
    asyncio.run(_dispatch_vs_brute_force(tmp_path_factory.mktemp("d"), steps, partitions))


async def _dispatch_vs_brute_force(data: Path, steps: list, partitions: int) -> None:  # type: ignore[type-arg]
    store, lq = await open_all(data, partitions=partitions)
    await lq.start()
    published: list[tuple[str, bytes]] = []  # in append order
    created_at: dict[str, int] = {}
    rnd = random.Random(1)
    for kind, arg in steps:
        if kind == "pub":
            batch = [(t, str(rnd.random()).encode()) for t in arg]
            store.append_mqtt([msg(t, p) for t, p in batch])
            published += batch
            await flushed(store)
            if rnd.random() < 0.5:
                lq.dispatcher.catch_up()
        else:
            lq.dispatcher.catch_up()
            if arg not in created_at and ("+" in arg or "#" in arg):
                created_at.setdefault(arg, len(published))
                lq.acquire_filter(arg)
    lq.dispatcher.catch_up()
    # Exact queues: every message of the topic, in order.
    for topic in {t for t, _ in published}:
        res = lq.read(topic, 0, 10_000)
        got = [m.payload for m in lq.resolve(res.entries) if m]
        assert got == [p for t, p in published if t == topic]
        assert res.next_seq == len(got)
    # Filter queues: exactly the matching messages published after creation, each once, with
    # the per-topic order kept (topics of different partitions may interleave differently).
    for filt, at in created_at.items():
        res = lq.read(filt, 0, 10_000)
        got = [(m.topic, m.payload) for m in lq.resolve(res.entries) if m]
        want = [(t, p) for t, p in published[at:] if topic_matches(filt, t)]
        assert sorted(got) == sorted(want)
        for topic in {t for t, _ in want}:
            assert [x for x in got if x[0] == topic] == [x for x in want if x[0] == topic]
        assert res.next_seq == len(want) and len(res.entries) == len(want)
    await lq.close()
    await store.close()


async def test_resolve_equals_mqtt_view_and_batches_reads(tmp_path: Path) -> None:
    """The resolver's fast path gives what store.mapping.mqtt_view gives, for every header shape;
    and one read of many entries costs a few Store.reads, not one per entry."""
    from store.mapping import mqtt_view
    from store.record_batch import build_batch, iter_records

    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.acquire_filter("v/#")
    shapes = [
        [("mqtt.qos", b"0"), ("mqtt.client_id", b"c1")],
        [("mqtt.qos", b"2"), ("mqtt.client_id", b"\xff\xfe")],  # not UTF-8
        [("mqtt.qos", b"7"), ("mqtt.client_id", b"c")],  # bad qos: default
        [("mqtt.client_id", b"c"), ("mqtt.qos", b"1")],  # other order
        [("mqtt.qos", b"1"), ("mqtt.client_id", None)],
        [("mqtt.qos", b"1"), ("mqtt.client_id", b"c"), ("mqtt.retain", b"1")],
        [("mqtt.qos", b"1"), ("x", b"y")],
        [],
    ]
    store.ensure_topic("v", 1)
    recs = [(NOW_MS + i, f"v/{i % 3}".encode(), b"p%d" % i, shapes[i % len(shapes)])
            for i in range(400)]  # fmt: skip
    store.append_batch("v", 0, bytes(build_batch(recs)))
    store.append_mqtt([msg("v/x", b"mqtt%d" % i) for i in range(100)])
    await flushed(store)
    lq.dispatcher.catch_up()
    res = lq.read("v/#", 0, 1000)
    lq.resolver.reads = 0
    got = lq.resolve(res.entries)
    assert lq.resolver.reads <= 3
    ref = []
    for off in range(2):
        data = store.read("v", 0, 0 if off == 0 else 400, 1 << 20)
        from store.record_batch import iter_batches

        for pos, size in iter_batches(data):
            for r in iter_records(memoryview(data)[pos : pos + size]):
                if len(ref) == r.offset:
                    v = mqtt_view("v", r.key, r.headers)
                    ref.append((v.topic, r.value, v.qos, v.client_id, v.retain, v.properties,
                                r.timestamp, r.offset))  # fmt: skip
    assert len(got) == len(ref) == 500
    for m, want in zip(got, ref, strict=True):
        assert m is not None
        assert (m.topic, m.payload, m.qos, m.client_id, m.retain, m.properties,
                m.timestamp_ms, m.offset) == want  # fmt: skip
    await lq.close()
    await store.close()


NOW_MS = 1_764_000_000_000


async def test_a_reader_far_behind_gets_exactly_its_window_of_a_big_batch(tmp_path: Path) -> None:
    """A cold read of a queue's window (a reader far behind: nothing decoded here yet), which
    decodes only that window's offsets of batches of over a thousand records, gets exactly its
    messages, also where another topic's records sit between them in the same partition."""
    store, lq = await open_all(tmp_path)
    await lq.start()
    store.append_mqtt([msg(f"w/{'ab'[i % 2]}", b"%d" % i) for i in range(3000)])
    await flushed(store)
    lq.dispatcher.catch_up()
    assert len(list(iter_batches(store.read("w", 0, 0, 1 << 22)))) <= 3  # > 1,000 records each
    for queue, first, n in (("w/a", 500, 256), ("w/b", 0, 1), ("w/b", 1490, 100)):
        lq.resolver.clear()
        got = lq.resolve(lq.read(queue, first, n).entries)
        parity = "ab".index(queue[-1])
        want = [b"%d" % (2 * s + parity) for s in range(first, min(first + n, 1500))]
        assert [m.payload for m in got if m is not None] == want
        assert all(m is not None and m.topic == queue for m in got)
    await lq.close()
    await store.close()


async def test_a_batch_that_does_not_decode_is_skipped_not_fatal(tmp_path: Path) -> None:
    """Stored bytes a reader cannot decode (garbled records under a valid CRC, as a compressed
    batch could hold, since those are stored unread): the dispatcher logs and skips that batch
    and keeps indexing what comes after it; it must not stop for good."""
    from kafka_helpers import garble_records

    from store.record_batch import build_batch

    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.acquire_filter("g/#")
    store.ensure_topic("g", 1)
    store.append_batch("g", 0, garble_records(build_batch([(1, b"g/a", b"hello", [])])))
    store.append_mqtt([msg("g/b", b"after")])
    for _ in range(200):
        if lq.last_seq("g/#") == 0:
            break
        await asyncio.sleep(0.01)
    (m,) = lq.resolve(lq.read("g/#", 0, 10).entries)
    assert m is not None and m.payload == b"after"
    assert lq.dispatcher.corrupt_batches == 1 and lq.dispatcher.behind() == 0
    await lq.close()
    await store.close()


async def _idle(d: Dispatcher) -> None:
    """Until the dispatch task waits for the next append (its start-up rounds are over)."""
    for _ in range(100):
        if d.idle:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the dispatch task never went idle")


async def test_a_small_inline_write_is_indexed_inside_it(tmp_path: Path) -> None:
    """`write_inline` (the MQTT proxy's write of its tick): a small append is indexed and
    announced inside that call, no loop pass later; other writes, and big ones, wake the
    dispatch task instead; a backlog bigger than a round's budget is worked off by the task."""
    got: list[tuple[str, int]] = []
    store, lq = await open_all(tmp_path, sink=got.extend, dispatch_batch_records=100)
    await lq.start()
    d = lq.dispatcher
    await _idle(d)  # the start-up round is over, the task waits

    def inline_write(n: int) -> None:
        store.append_mqtt([msg("x/y")] * n)
        d.write_inline(store.write_now)

    inline_write(1)
    assert got == [("x/y", 0)]  # indexed within the call
    store.append_mqtt([msg("x/y")])
    store.write_now()  # written now, but not inline: the task indexes it
    assert got == [("x/y", 0)] and d.behind() == 1
    inline_write(SYNC_RECORDS + 1)  # too big to index inline
    assert got == [("x/y", 0)]

    async def indexed(last: int) -> None:
        for _ in range(200):
            if got and got[-1] == ("x/y", last):
                return
            await asyncio.sleep(0.01)
        raise AssertionError(got)

    await indexed(SYNC_RECORDS + 2)  # 1 + 1 + 65 records: the last is seq 66
    assert d.behind() == 0
    got.clear()
    inline_write(1000)  # four rounds (256 records each at least): the task goes on
    await indexed(SYNC_RECORDS + 1002)
    assert d.behind() == 0 and len(got) >= 4
    await lq.close()
    await store.close()


async def test_index_write_hands_its_round_to_the_caller(tmp_path: Path) -> None:
    """`index_write` (the one-process PUBLISH round, LocalBackend.publish): the round's new
    entries of watched queues and its events come back to the caller, not through the sinks,
    so the caller delivers and announces them in its own order; a big write returns None and
    the task's round uses the sinks as before."""
    got: list[tuple[str, int]] = []
    pushed_by_sink: list[object] = []
    store, lq = await open_all(tmp_path, sink=got.extend)
    lq.set_watch_sink(pushed_by_sink.append)
    await lq.start()
    d = lq.dispatcher
    await _idle(d)
    lq.acquire_filter("r/#")
    assert lq.watch("r/#")
    store.append_mqtt([msg("r/1"), msg("r/2")])
    rnd = d.index_write(store.write_now)
    assert rnd is not None and got == [] and pushed_by_sink == []
    assert sorted(rnd.events) == [("r/#", 1), ("r/1", 0), ("r/2", 0)]
    [(queue, first, entries)] = rnd.pushed
    assert (queue, first, [e[2] for e in entries]) == ("r/#", 0, [0, 1])
    d.round_done()
    store.append_mqtt([msg("r/1")] * (SYNC_RECORDS + 1))
    assert d.index_write(store.write_now) is None  # too big: the task indexes it
    for _ in range(200):
        if pushed_by_sink:
            break
        await asyncio.sleep(0.01)
    assert ("r/#", SYNC_RECORDS + 2) in got and pushed_by_sink
    await lq.close()
    await store.close()


async def test_a_failed_inline_round_leaves_the_write_alone_and_the_task_retries(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The inline round runs inside the MQTT proxy's write of its tick: its failure is logged
    and handed to the dispatch task (woken), never raised into the write, which has already
    happened; a transient failure costs only the inline shortcut."""
    got: list[tuple[str, int]] = []
    store, lq = await open_all(tmp_path, sink=got.extend)
    await lq.start()
    d = lq.dispatcher
    await _idle(d)
    real = d._index
    calls = [0]

    def failing_once(*a: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected")
        return real(*a)

    d._index = failing_once  # type: ignore[method-assign]
    store.append_mqtt([msg("f/1")])
    d.write_inline(store.write_now)  # does not raise
    assert "inline dispatch round failed" in caplog.text and got == []
    for _ in range(200):
        if got:
            break
        await asyncio.sleep(0.01)
    assert got == [("f/1", 0)] and calls[0] == 2 and lq.dispatch_running
    await lq.close()
    await store.close()


async def test_an_inline_write_to_several_partitions_is_one_round(tmp_path: Path) -> None:
    """A tick of many publishers writes several partitions: one round indexes them all (a round
    per partition, as the append listener ran them, cost ~3 rounds and pumps per tick)."""
    got: list[tuple[str, int]] = []
    store, lq = await open_all(tmp_path, partitions=4, sink=got.extend)
    await lq.start()
    d = lq.dispatcher
    await _idle(d)
    topics = [f"p/{i}" for i in range(40)]
    assert len({store._route(t)[1] for t in topics}) == 4  # every partition written
    rounds: list[object] = []
    real = d._round
    d._round = lambda *a: rounds.append(real(*a)) or rounds[-1]  # type: ignore[method-assign,assignment]
    store.append_mqtt([msg(t) for t in topics])
    d.write_inline(store.write_now)
    assert sorted(got) == sorted((t, 0) for t in topics)  # indexed within the call
    assert len(rounds) == 1 and d.behind() == 0
    await lq.close()
    await store.close()


async def test_a_round_looks_only_at_the_partitions_appended_to(tmp_path: Path) -> None:
    """After a restart the dispatcher knows every partition of the log (64 here); a round after
    one append looks at that partition, not at all of them (every round looked at every
    partition: a lone message cost 4-6x more with 256 of them). What was appended while it was
    closed is still indexed, in every partition."""
    store, lq = await open_all(tmp_path, partitions=64)
    topics = [f"w/{i}" for i in range(200)]
    store.append_mqtt([msg(t) for t in topics])
    await flushed(store)
    await lq.close()
    store.append_mqtt([msg(t) for t in topics])  # nobody indexing
    await flushed(store)
    await store.close()

    got: list[tuple[str, int]] = []
    store, lq = await open_all(tmp_path, partitions=64, sink=got.extend)
    d = lq.dispatcher
    await lq.start()
    assert len(d.hwm) == 64
    for _ in range(200):
        if d.idle and d.behind() == 0:
            break
        await asyncio.sleep(0.01)
    assert d.behind() == 0 and sorted(got) == sorted((t, 1) for t in topics)
    looked: list[tuple[str, int]] = []
    real = d.position
    d.position = lambda t, p: looked.append((t, p)) or real(t, p)  # type: ignore[method-assign]
    store.append_mqtt([msg("w/0")])
    d.write_inline(store.write_now)
    assert ("w/0", 2) in got
    part = store._route("w/0")[:2]
    assert set(looked) == {part}  # the partition written, and only it
    await lq.close()
    await store.close()


async def test_inline_rounds_hold_their_batch_until_the_db_is_needed(tmp_path: Path) -> None:
    """Inline rounds (a lone message's) hold their WriteBatch back: entries are announced at
    once but reach LevelDB together, one block per queue and one checkpoint for all of them; any
    other use of the DB (a read here), a round of the task, or the timer writes them first."""
    got: list[tuple[str, int]] = []
    store, lq = await open_all(tmp_path, sink=got.extend)
    await lq.start()
    d, qdb = lq.dispatcher, lq.qdb
    await _idle(d)

    def inline_write(topic: str) -> None:
        store.append_mqtt([msg(topic)])
        d.write_inline(store.write_now)

    def blocks(queue: str) -> list[bytes]:
        return [k for k, _ in qdb.raw.iterator(prefix=entry_prefix(qdb.queues[queue].qid))]

    def stored_checkpoint() -> int | None:
        v = qdb.raw.get(checkpoint_key(qdb.topic_ids["h"], 0))
        return None if v is None else int.from_bytes(v, "big")

    lq.acquire_filter("h/#")
    for _ in range(3):
        inline_write("h/1")
    assert {("h/1", 2), ("h/#", 2)} <= set(got) and d.behind() == 0  # announced at once
    assert qdb.pending_write is not None and blocks("h/1") == [] and stored_checkpoint() is None
    res = lq.read("h/#", 0, 10)  # a reader: the held rounds are written first
    assert [e[2] for e in res.entries if e] == [0, 1, 2] and qdb.pending_write is None
    assert len(blocks("h/1")) == 1 and len(blocks("h/#")) == 1  # one key per queue, 3 rounds
    assert stored_checkpoint() == 3

    inline_write("h/2")  # held again; the dispatch task's next round takes it along
    assert qdb.pending_write is not None
    store.append_mqtt([msg("h/2")])
    store.write_now()  # not inline: wakes the task
    for _ in range(200):
        if d.behind() == 0 and qdb.pending_write is None:
            break
        await asyncio.sleep(0.01)
    assert qdb.pending_write is None and stored_checkpoint() == 5
    assert [e[2] for e in lq.read("h/#", 3, 10).entries if e] == [3, 4]

    inline_write("h/3")  # nobody needs the DB: the timer writes it
    assert qdb.pending_write is not None
    await asyncio.sleep(2 * HOLD_S + 0.05)
    assert qdb.pending_write is None and stored_checkpoint() == 6
    await lq.close()
    await store.close()


async def test_held_rounds_are_indexed_again_after_a_crash(tmp_path: Path) -> None:
    """What a crash loses of the held rounds (never written) the next start indexes again from
    the stored checkpoint, into the same sequence numbers."""
    store, lq = await open_all(tmp_path)
    await lq.start()
    d = lq.dispatcher
    lq.acquire_filter("k/#")
    store.append_mqtt([msg("k/0")])
    await flushed(store)
    d.catch_up()  # seq 0, written
    for i in range(1, 4):
        store.append_mqtt([msg(f"k/{i}")])
        d.write_inline(store.write_now)
    assert lq.qdb.pending_write is not None  # seqs 1..3 only in memory
    d._held, d._held_queues, d._held_ckpts = None, {}, {}  # the crash: the held batch is gone
    lq.qdb.pending_write = None
    if d._held_timer is not None:
        d._held_timer.cancel()
    await flushed(store)
    await lq.close()
    await store.close()
    store, lq = await open_all(tmp_path)
    await lq.start()
    lq.dispatcher.catch_up()
    res = lq.read("k/#", 0, 10)
    assert [m.topic for m in lq.resolve(res.entries) if m] == ["k/0", "k/1", "k/2", "k/3"]
    assert res.next_seq == 4
    await lq.close()
    await store.close()
