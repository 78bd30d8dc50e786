"""The core link (notify.link) and the store / light-queue services over it.

Framing is tested sans-IO (bytes in, frames out, split at every byte, fuzzed); the services over
a real Unix socket and TCP, with a real Store and real LevelDB on both ends of the link, checked
against what the same calls give in-process.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lightqueue_helpers import flushed, msg

from lightgate.link_registry import DuplicateMethodError, MethodRegistry
from lightgate.link_services import LightQueueService, StoreService
from lightqueue.queues import LightQueueConfig, LightQueues
from mqtt_proxy.backends.remote_queues import RemoteLightQueues
from mqtt_proxy.backends.remote_store import RemoteStore
from notify.link import RpcPeer, RpcServer, connect
from notify.link_frames import (
    AUTH,
    CALL,
    ERROR,
    NO_SUCH_METHOD,
    PING,
    REPLY,
    SEND,
    FrameDecoder,
    FrameError,
    RpcError,
    encode_frame,
    error_body,
)
from store import MqttMessage, MqttProperties, Store, StoreConfig, TopicMappingError
from store import segment_reader as sr

# -- framing, sans-IO ----------------------------------------------------------------------------


def test_frames_round_trip_whole_and_byte_by_byte() -> None:
    frames = [
        (CALL, 1, 3, b"hello"),
        (SEND, 0, 40, b""),
        (REPLY, 1, 3, bytes(range(256)) * 300),
        (ERROR, 7, 0, error_body(2, "no method 9")),
        (PING, 0, 0, b""),
    ]
    wire = b"".join(encode_frame(*f) for f in frames)
    assert FrameDecoder().feed(wire) == frames
    dec = FrameDecoder()
    got = []
    for i in range(len(wire)):
        got += dec.feed(wire[i : i + 1])
    assert got == frames and dec.buffered == 0


def test_frame_errors() -> None:
    with pytest.raises(FrameError):
        FrameDecoder().feed(b"\x00\x00\x00\x03" + b"\x01" * 10)  # shorter than its header
    with pytest.raises(FrameError):
        FrameDecoder(max_frame=100).feed(encode_frame(CALL, 1, 1, b"x" * 200))
    with pytest.raises(FrameError):
        FrameDecoder().feed(b"\x00\x00\x00\x07\x09" + b"\x00" * 6)  # unknown kind 9


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(1, 50))
def test_decoder_fuzz_only_frame_errors_escape(data: bytes, step: int) -> None:
    dec = FrameDecoder(max_frame=1 << 16)
    try:
        for i in range(0, len(data), step):
            for kind, _cid, _m, _body in dec.feed(data[i : i + step]):
                assert CALL <= kind <= AUTH
    except FrameError:
        pass


# -- the link ------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["unix", "tcp"])
async def test_calls_sends_errors_and_link_loss(tmp_path: Path, transport: str) -> None:
    got: list[bytes] = []
    slow: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    def fail(peer: RpcPeer, body: bytes) -> bytes:
        raise RpcError(123, "refused " + body.decode())

    server_methods: dict[int, Any] = {
        1: lambda peer, body: body[::-1],
        2: lambda peer, body: got.append(body),
        3: fail,
        4: lambda peer, body: slow,
        5: lambda peer, body: 1 / 0,
    }
    server = RpcServer(server_methods)
    addr = await server.start(f"unix:{tmp_path}/s.sock" if transport == "unix" else "127.0.0.1:0")
    client = await connect(addr, {9: lambda peer, body: b"client:" + body})
    assert await client.call(1, b"abc") == b"cba"
    assert client.send(2, b"one-way")
    with pytest.raises(RpcError) as e:
        await client.call(3, b"x")
    assert e.value.code == 123 and str(e.value) == "refused x"
    with pytest.raises(RpcError) as e:
        await client.call(77)
    assert e.value.code == NO_SUCH_METHOD
    with pytest.raises(RpcError, match="ZeroDivisionError"):
        await client.call(5)
    # The server calls the client on the same link.
    (speer,) = server.peers
    assert await speer.call(9, b"hi") == b"client:hi"
    assert got == [b"one-way"]
    # A future-returning method answers later; the link keeps serving meanwhile.
    pending = client.call(4)
    assert await client.call(1, b"xy") == b"yx"
    slow.set_result(b"late")
    assert await pending == b"late"
    # Link loss fails what is outstanding.
    never = client.call(4, b"")
    hang: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
    server.methods[4] = lambda peer, body: hang
    await server.close()
    with pytest.raises(RpcError):
        await asyncio.wait_for(never, 5)
    await asyncio.wait_for(client.closed, 5)
    with pytest.raises(RpcError):
        await client.call(1, b"after")


async def test_a_bad_frame_closes_only_that_link(tmp_path: Path) -> None:
    server = RpcServer({1: lambda peer, body: body})
    addr = await server.start("127.0.0.1:0")
    good = await connect(addr, {})
    host, port = addr.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\xff\xff\xff\xff garbage")
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
    assert await good.call(1, b"still fine") == b"still fine"
    writer.close()
    good.close()
    await server.close()


# -- the store over the link ---------------------------------------------------------------------


async def _core(tmp_path: Path, fsync: str = "always", **lq_cfg: Any) -> Any:
    store = await Store.open(tmp_path / "core", StoreConfig(default_partitions=2, fsync=fsync))
    lq = LightQueues.open(tmp_path / "core", store, LightQueueConfig(**lq_cfg))
    service = LightQueueService(lq)
    lq.set_sink(lambda evs: service.on_round())
    await lq.start()
    store_service = StoreService(store)

    def connected(peer: Any) -> None:
        store_service.peer_connected(peer)
        service.peer_connected(peer)

    def lost(peer: Any, exc: Exception | None) -> None:
        store_service.peer_lost(peer)
        service.peer_lost(peer)

    server = RpcServer(
        MethodRegistry().add("store", store_service.methods()).add("lq", service.methods()).table(),
        on_connect=connected,
        on_lost=lost,
    )
    addr = await server.start(f"unix:{tmp_path}/core.sock")
    rs, rq = RemoteStore(), RemoteLightQueues()
    peer = await connect(
        addr, MethodRegistry().add("store", rs.methods()).add("lq", rq.methods()).table()
    )
    rs.attach(peer)
    rq.attach(peer)
    await rs.start()

    async def close() -> None:
        peer.close()
        await server.close()
        await lq.close()
        await store.close()

    close.service = service  # type: ignore[attr-defined]  # the core's side, for tests that need it
    return store, lq, rs, rq, close


async def test_remote_append_writes_what_the_store_writes(tmp_path: Path) -> None:
    store, lq, rs, rq, close = await _core(tmp_path)
    props = MqttProperties(1, 60, "text/plain", "r/t", b"\x01", (("k", "v"),))
    msgs = [
        MqttMessage("dev/1/t", b"a", 0, "c1", timestamp_ms=1000),
        MqttMessage("dev/2/t", b"b", 1, "c2", retain=True, timestamp_ms=1001),
        MqttMessage("fab/x", b"c", 2, "c3", properties=props, timestamp_ms=1002),
    ]
    res = rs.append_mqtt(msgs, sync=True)
    assert res.offsets is None and res.runs is None and res.staged is not None
    await asyncio.wait_for(res.staged, 5)
    offsets = res.offsets
    await asyncio.wait_for(res.durable, 5)
    assert offsets is not None and len(offsets) == 3
    # The same messages through the in-process store, into another log topic family.
    local = store.append_mqtt([MqttMessage("x" + m.topic, *_rest(m)) for m in msgs])
    await local.durable
    for m, (t, p, o), (lt, lp, lo) in zip(msgs, offsets, local.offsets, strict=True):
        rec = next(r for r in sr.iter_records_from(tmp_path / "core", t, p) if r.offset == o)
        ref = next(r for r in sr.iter_records_from(tmp_path / "core", lt, lp) if r.offset == lo)
        assert rec.key == m.topic.encode() and rec.value == m.payload
        assert rec.headers == ref.headers and rec.timestamp == ref.timestamp
    assert rs.topics()["dev"] == 2 and rs.topics()["fab"] == 2  # created on first use
    with pytest.raises(TopicMappingError):
        rs.append_mqtt([msg("$SYS/x")])
    await close()


def _rest(m: MqttMessage) -> tuple[Any, ...]:
    return (m.payload, m.qos, m.client_id, m.retain, m.properties, m.timestamp_ms)


async def test_remote_append_qos0_is_not_held_for_durability(tmp_path: Path) -> None:
    store, lq, rs, rq, close = await _core(tmp_path, fsync="never")
    await rs.ensure_topic("q")
    res = rs.append_mqtt([msg("q/0", qos=0)], sync=False)
    assert res.durable.done()  # nobody waits for a QoS 0 append: no DURABLE round trip
    await res.staged  # type: ignore[misc]
    assert res.offsets[0][:2] == ("q", rs._route("q/0")[0][1])  # type: ignore[index]
    # A producer batch for a known topic (device events use this).
    n = await rs.ensure_topic("events", force=True)
    from store.record_batch import build_batch

    r2 = rs.append_batch("events", n - 1, bytes(build_batch([(5, b"k", b"v", [])] * 3)))
    await r2.staged  # type: ignore[misc]
    assert [o for _t, _p, o in r2.offsets] == [0, 1, 2]  # type: ignore[union-attr]
    await r2.durable
    assert store.high_watermark("events", n - 1) == 3
    await close()


async def test_remote_reads_and_offsets(tmp_path: Path) -> None:
    """READ returns the stored batches as the store does; OFFSETS the log start and the
    high watermark; an offset past the end is OffsetOutOfRangeError, as in-process."""
    from store import OffsetOutOfRangeError

    store, lq, rs, rq, close = await _core(tmp_path)
    res = rs.append_mqtt([msg("rd/x", b"%d" % i) for i in range(5)])
    await res.durable
    (t, p, _o) = res.offsets[0]  # type: ignore[index]
    assert await rs.read(t, p, 0, 1 << 20) == store.read(t, p, 0, 1 << 20)
    assert await rs.offsets(t, p) == (0, 5)
    with pytest.raises(OffsetOutOfRangeError):
        await rs.read(t, p, 99, 1024)
    await close()


async def test_a_deleted_or_grown_topic_is_routed_by_its_new_partition_count(
    tmp_path: Path,
) -> None:
    """The core tells the proxy when a log topic is deleted or grows (Kafka admin APIs): its
    next MQTT append asks for the count again instead of routing by the old one."""
    store, lq, rs, rq, close = await _core(tmp_path)
    await rs.append_mqtt([msg("gr/a", b"1")]).durable
    assert rs.partitions("gr") == 2
    store.create_partitions("gr", 6)
    for _ in range(50):
        if rs.partitions("gr") is None:
            break
        await asyncio.sleep(0.01)
    assert rs.partitions("gr") is None
    res = rs.append_mqtt([msg(f"gr/d{i}", b"x") for i in range(60)])
    await res.durable
    assert rs.partitions("gr") == 6
    assert {p for _t, p, _o in res.offsets} - {0, 1}  # type: ignore[union-attr]
    await store.delete_topic("gr")
    store.create_topic("gr", 1)  # fewer partitions than the proxy had
    for _ in range(50):
        if rs.partitions("gr") is None:
            break
        await asyncio.sleep(0.01)
    res = rs.append_mqtt([msg(f"gr/d{i}", b"y") for i in range(10)])
    await res.durable
    assert store.high_watermark("gr", 0) == 10
    await close()


async def test_remote_append_refused_fails_both_futures(tmp_path: Path) -> None:
    store, lq, rs, rq, close = await _core(tmp_path)
    store.config.auto_create_topics = False
    res = rs.append_mqtt([msg("nosuch/topic")])
    with pytest.raises(Exception, match="does not exist"):
        await asyncio.wait_for(res.staged, 5)  # type: ignore[arg-type]
    with pytest.raises(Exception, match="does not exist"):
        await res.durable
    await close()


# -- light queues over the link -----------------------------------------------------------------


async def test_remote_reads_resolve_retained_sessions(tmp_path: Path) -> None:
    store, lq, rs, rq, close = await _core(tmp_path, filter_grace_s=0.0)
    [(queue, start)] = await rq.acquire_many([("s/+/t", None)])
    assert (queue, start) == ("s/+/t", 0)
    assert lq.held("s/+/t") == 1
    res = rs.append_mqtt([msg(f"s/{i}/t", b"p%d" % i) for i in range(5)] + [msg("s/x/y")])
    await res.durable
    for _ in range(100):
        if lq.last_seq("s/+/t") == 4:
            break
        await asyncio.sleep(0.01)
    remote = await rq.read("s/+/t", 1, 10)
    local = lq.read("s/+/t", 1, 10)
    assert remote == local and len(remote.entries) == 4
    assert await rq.resolve(remote.entries) == lq.resolve(local.entries)
    assert await rq.resolve([None, *remote.entries[:1]]) == [None, *lq.resolve(local.entries[:1])]
    for _ in range(100):
        if rq.indexed == lq.dispatcher.records:
            break
        await asyncio.sleep(0.01)
    assert rq.indexed == lq.dispatcher.records == 6
    errs = await rq.acquire_many([("bad/#/x", None)])
    assert isinstance(errs[0], str) and "FilterError" in errs[0]
    # Retained, set with a log position, matched by filter.
    props = MqttProperties(None, 3600, None, None, None, (("a", "b"),))
    now = int(time.time() * 1000)
    assert await rq.retain("s/1/t", b"keep", 1, "c9", props, now, ("s", 1, 7)) == b""
    [m], cursor = await rq.retained_page("s/+/t", None, 10)
    assert cursor is None  # one page held everything
    assert (m.topic, m.payload, m.qos, m.client_id, m.retain, m.properties, m.timestamp_ms) == (
        "s/1/t", b"keep", 1, "c9", True, props, now,
    )  # fmt: skip
    assert (m.log_topic, m.partition, m.offset) == ("s", 1, 7)
    # Sessions: written with an answer, loaded, deleted one-way.
    state = {"client_id": "dev1", "subs": [{"f": "a/#", "pos": 3}], "blob": b"\x00\x01"}
    await rq.put_sessions([("dev1", state)], wait=True)  # type: ignore[misc]
    assert lq.sessions.get("dev1") == state
    assert await rq.load_sessions() == [state]
    rq.delete_session("dev1")
    assert await rq.load_sessions() == []
    await close()


async def test_holds_of_a_lost_link_are_released(tmp_path: Path) -> None:
    store, lq, rs, rq, close = await _core(tmp_path)
    await rq.acquire_many([("h/#", None), ("h/#", None), ("h/+/x", None)])
    rq.release("h/+/x")
    await flushed(store)
    await rq.acquire_many([])  # a round trip: the release was handled before this answer
    assert (lq.held("h/#"), lq.held("h/+/x")) == (2, 0)
    assert rq.peer is not None
    rq.peer.abort()
    for _ in range(100):
        if lq.held("h/#") == 0:
            break
        await asyncio.sleep(0.01)
    assert lq.held("h/#") == 0
    await close()


async def test_appends_keep_call_order_across_a_new_topic(tmp_path: Path) -> None:
    """The first append to a new log topic waits for its partition count; an append made once
    the count is known, but before that first one left, must not overtake it in the log."""
    store, lq, rs, rq, close = await _core(tmp_path)
    await rs.ensure_topic("old")
    first = rs.append_mqtt([msg("new/t", b"1"), msg("old/t", b"a")])
    while "new" not in rs.topics():
        await asyncio.sleep(0)
    second = rs.append_mqtt([msg("new/t", b"2"), msg("old/t", b"b")])
    third = rs.append_mqtt([msg("new/t", b"3"), msg("old/t", b"c")])
    for r in (first, second, third):
        await asyncio.wait_for(r.durable, 5)
    for topic in ("new", "old"):
        (part,) = {o[1] for r in (first, second, third) for o in r.offsets if o[0] == topic}
        values = [r.value for r in sr.iter_records_from(tmp_path / "core", topic, part)]
        assert values == ([b"1", b"2", b"3"] if topic == "new" else [b"a", b"b", b"c"])
    await close()


async def test_watched_queues_push_their_new_entries(tmp_path: Path) -> None:
    """WATCH: each dispatch round's new entries arrive (ENTRIES) before that round's events;
    a link that is not keeping up gets none (it reads them instead); watches end with the link."""
    store, lq, rs, rq, close = await _core(tmp_path)
    got: list[tuple[str, int, list[Any]]] = []
    rq.entries_sink = lambda q, first, entries: got.append((q, first, entries))
    [(queue, _start)] = await rq.acquire_many([("w/#", None)])
    rq.watch(queue, True)
    await rq.acquire_many([])  # a round trip: the WATCH was handled before this answer
    res = rs.append_mqtt([msg(f"w/{i}") for i in range(3)], sync=False)
    await res.staged  # type: ignore[misc]
    for _ in range(200):
        if sum(len(e) for q, _f, e in got if q == "w/#") == 3:
            break
        await asyncio.sleep(0.01)
    pushed = [e for q, _f, es in got if q == "w/#" for e in es]
    assert [tuple(e) for e in pushed] == [tuple(e) for e in lq.read("w/#", 0, 10).entries]
    assert got[0][1] == 0  # the first pushed sequence
    # A link whose writes back up (simulated): nothing is pushed to it, reads still work.
    (speer,) = close.service.peers
    speer.paused = True
    n = len(got)
    await rs.append_mqtt([msg("w/late")], sync=False).staged  # type: ignore[misc]
    for _ in range(50):
        if lq.last_seq("w/#") == 3:
            break
        await asyncio.sleep(0.01)
    await rq.acquire_many([])
    assert len(got) == n and len((await rq.read("w/#", 3, 10)).entries) == 1
    speer.paused = False
    assert rq.peer is not None
    rq.peer.abort()
    for _ in range(100):
        if lq.qdb.queues["w/#"].watchers == 0:
            break
        await asyncio.sleep(0.01)
    assert lq.qdb.queues["w/#"].watchers == 0 and lq.qdb.queues["w/#"].watch is None
    await close()


# -- the method registry ---------------------------------------------------------------------------


def test_registry_refuses_a_method_number_taken_twice() -> None:
    """A dict merge let the later table win silently; the registry names both owners."""
    reg = MethodRegistry().add("store", {1: lambda p, b: b"", 2: lambda p, b: b""})
    with pytest.raises(DuplicateMethodError, match="method 2 of queues is already taken by store"):
        reg.add("queues", {3: lambda p, b: b"", 2: lambda p, b: b""})
    assert sorted(reg.table()) == [1, 2] and reg.owner(3) is None  # all or nothing
    with pytest.raises(ValueError, match="not a u16"):
        reg.add("bad", {0x10000: lambda p, b: b""})


def test_each_end_of_the_real_link_has_one_handler_per_number() -> None:
    """The numbers of every part, as both ends register them, do not clash (store 1-31, light
    queues 32-63, wiring and notify 64-95)."""
    from lightgate.link_registry import HELLO, STATS
    from lightqueue import wire as lw
    from mqtt_proxy.backends.remote_notify import LinkNotifier
    from notify import wire as nw
    from store import wire as sw

    proxy = (
        MethodRegistry()
        .add("store", RemoteStore().methods())
        .add("light queues", RemoteLightQueues().methods())
        .add("notify", LinkNotifier("p").methods())
        .add("wiring", {STATS: lambda p, b: b""})
    )
    assert sorted(proxy.table()) == sorted(
        [sw.DURABLE, sw.TOPIC_CHANGED, lw.INDEXED, lw.ENTRIES, nw.EVENTS, STATS]
    )
    assert all(0 < n < 32 for n in (sw.TOPICS, sw.TOPIC_CHANGED))
    assert all(32 <= n < 64 for n in (lw.READ, lw.ENTRIES))
    assert all(64 <= n < 96 for n in (HELLO, STATS, nw.REGISTER, nw.EVENTS))
