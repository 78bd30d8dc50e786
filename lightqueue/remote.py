"""Light queues over the core link: `LightQueueService` in the core, `RemoteLightQueues` in a proxy.

LevelDB allows one process per database, so the process that owns the store and the dispatcher
also owns the light queues, sessions and retained messages, and a proxy in another process reads
them through these calls (store.rpc framing, methods 32-63). Reads are pulled on notify events
as in-process; the service answers in the order the link carries requests, so an entry in a READ
reply always belongs to an append whose reply the proxy already has.

Holds: `acquire` holds a filter queue for the calling link (`LightQueues.acquire_filter`); when a
link goes away every hold it took is released, so a crashed proxy cannot keep queues alive.

Wire bodies (str = u16 length + UTF-8; `codec` = lightqueue.codec, used for the cold calls)::

    READ      str queue | i64 from | u32 max → i64 start | i64 next | i64 first | topics | entries
    RESOLVE   topics | entries → u32 n | n × message
    ACQUIRE   codec [[filter, since_ms | None], ...] → codec [[queue, start_seq] | error str, ...]
    RELEASE   str queue                                   (one-way)
    RETAIN    codec [topic, payload, qos, client id, props, ts, [log topic, partition, offset]]
              → empty, once written (a retained PUBLISH is acknowledged after this answer)
    RETAINED  str filter → u32 n | n × message
    SESSIONS  → codec [state, ...];  PUT_SESSIONS codec [[client id, state], ...] (call or one-way)
    DEL_SESSION str client id                             (one-way)
    INDEXED   (core → proxy, one-way) i64 records the dispatcher has indexed since it opened
    WATCH / UNWATCH  str queue                            (one-way; counted per link)
    ENTRIES   (core → proxy, one-way) u16 n | n × (str queue | i64 first seq | topics | entries)
              a watched queue's new entries after each dispatch round, sent before the notify
              events of that round, so a proxy delivers them without a READ round trip

    topics  = u16 n | n × str                   (log topic names the entries refer to)
    entries = u32 n | n × (u16 topic index, u32 partition, i64 offset)   index 0xFFFF = void
    message = u8 flags (1 present, 2 retain) | u8 qos | i64 ts | str topic | u32 len | payload |
              str client id | str log topic | u32 partition | i64 offset | u32 len | codec props
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections import Counter
from typing import Any

from lightqueue import codec
from lightqueue.model import ReadResult, StoredMessage, props_from_obj, props_to_obj
from store.rpc import BAD_REQUEST, Handler, RpcError, RpcPeer, get_str, put_str

log = logging.getLogger("lightgate.lightqueue.remote")

READ, RESOLVE, ACQUIRE, RELEASE, RETAIN, RETAINED = 32, 33, 34, 35, 36, 37
SESSIONS, PUT_SESSIONS, DEL_SESSION, INDEXED = 38, 39, 40, 41
WATCH, UNWATCH, ENTRIES = 42, 43, 44

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_READ_REQ = struct.Struct(">qI")
_READ_HEAD = struct.Struct(">qqq")
_ENTRY = struct.Struct(">HIq")
_MSG_HEAD = struct.Struct(">BBq")
_POS = struct.Struct(">Iq")
_VOID = 0xFFFF


# -- entries and messages ------------------------------------------------------------------------
def encode_entries(out: list[bytes], entries: list[Any]) -> None:
    """Append `topics | entries` for `entries` (Entry-like tuples or None)."""
    index: dict[str, int] = {}
    packed = []
    pack = _ENTRY.pack
    for e in entries:
        if e is None:
            packed.append(pack(_VOID, 0, 0))
            continue
        t = index.get(e[0])
        if t is None:
            t = index[e[0]] = len(index)
        packed.append(pack(t, e[1], e[2]))
    out.append(_U16.pack(len(index)))
    for name in index:
        put_str(out, name)
    out.append(_U32.pack(len(packed)))
    out += packed


def decode_entries(body: bytes, pos: int) -> tuple[list[Any], int]:
    (nt,) = _U16.unpack_from(body, pos)
    pos += 2
    names = []
    for _ in range(nt):
        name, pos = get_str(body, pos)
        names.append(name)
    (n,) = _U32.unpack_from(body, pos)
    pos += 4
    end = pos + n * _ENTRY.size
    if end > len(body):
        raise RpcError(BAD_REQUEST, "truncated entries")
    # Plain tuples: they compare and hash as Entry does, at half the cost to build.
    out: list[Any] = [
        None if t == _VOID else (names[t], p, o) for t, p, o in _ENTRY.iter_unpack(body[pos:end])
    ]
    return out, end


def encode_message(out: list[bytes], m: StoredMessage | None) -> None:
    if m is None:
        out.append(_MSG_HEAD.pack(0, 0, 0))
        return
    out.append(_MSG_HEAD.pack(1 | (2 if m.retain else 0), m.qos, m.timestamp_ms))
    put_str(out, m.topic)
    out.append(_U32.pack(len(m.payload)))
    out.append(m.payload)
    put_str(out, m.client_id)
    put_str(out, m.log_topic)
    out.append(_POS.pack(m.partition & 0xFFFFFFFF, m.offset))
    props = b"" if m.properties is None else codec.encode(props_to_obj(m.properties))
    out.append(_U32.pack(len(props)))
    out.append(props)


def decode_message(body: bytes, pos: int) -> tuple[StoredMessage | None, int]:
    flags, qos, ts = _MSG_HEAD.unpack_from(body, pos)
    pos += _MSG_HEAD.size
    if not flags & 1:
        return None, pos
    topic, pos = get_str(body, pos)
    (n,) = _U32.unpack_from(body, pos)
    payload = body[pos + 4 : pos + 4 + n]
    pos += 4 + n
    cid, pos = get_str(body, pos)
    lt, pos = get_str(body, pos)
    part, off = _POS.unpack_from(body, pos)
    pos += _POS.size
    (n,) = _U32.unpack_from(body, pos)
    props = props_from_obj(codec.decode(body[pos + 4 : pos + 4 + n])) if n else None
    pos += 4 + n
    if part == 0xFFFFFFFF:
        part = -1
    return StoredMessage(topic, payload, qos, cid, bool(flags & 2), props, ts, lt, part, off), pos


def encode_messages(msgs: list[StoredMessage | None]) -> bytes:
    out = [_U32.pack(len(msgs))]
    for m in msgs:
        encode_message(out, m)
    return b"".join(out)


def decode_messages(body: bytes) -> list[StoredMessage | None]:
    (n,) = _U32.unpack_from(body, 0)
    pos = 4
    out = []
    for _ in range(n):
        m, pos = decode_message(body, pos)
        out.append(m)
    return out


# -- the core side -------------------------------------------------------------------------------
class LightQueueService:
    """Serves one `LightQueues` to every link; call `on_round` after each dispatch round."""

    def __init__(self, queues: Any) -> None:
        self.queues = queues
        self.peers: set[RpcPeer] = set()
        self._push_scheduled = False
        self._watchers: dict[str, set[RpcPeer]] = {}
        queues.set_watch_sink(self.on_entries)

    def methods(self) -> dict[int, Handler]:
        return {
            WATCH: self._watch,
            UNWATCH: self._unwatch,
            READ: self._read,
            RESOLVE: self._resolve,
            ACQUIRE: self._acquire,
            RELEASE: self._release,
            RETAIN: self._retain,
            RETAINED: self._retained,
            SESSIONS: self._sessions,
            PUT_SESSIONS: self._put_sessions,
            DEL_SESSION: self._del_session,
        }

    def peer_connected(self, peer: RpcPeer) -> None:
        peer.state["holds"] = Counter()
        self.peers.add(peer)
        peer.send(INDEXED, _I64.pack(int(self.queues.dispatcher.records)))

    def peer_lost(self, peer: RpcPeer) -> None:
        """Release every hold and watch the link took (a proxy that went away holds nothing)."""
        self.peers.discard(peer)
        holds: Counter[str] = peer.state.pop("holds", Counter())
        for queue, n in holds.items():
            for _ in range(n):
                self.queues.release_filter(queue)
        for queue in peer.state.pop("watching", set()):
            self._drop_watch(peer, queue)

    def _watch(self, peer: RpcPeer, body: bytes) -> None:
        queue, _ = get_str(body, 0)
        watching: set[str] = peer.state.setdefault("watching", set())
        if queue in watching or not self.queues.watch(queue):
            return
        watching.add(queue)
        self._watchers.setdefault(queue, set()).add(peer)

    def _unwatch(self, peer: RpcPeer, body: bytes) -> None:
        queue, _ = get_str(body, 0)
        watching: set[str] = peer.state.setdefault("watching", set())
        if queue in watching:
            watching.discard(queue)
            self._drop_watch(peer, queue)

    def _drop_watch(self, peer: RpcPeer, queue: str) -> None:
        self.queues.unwatch(queue)
        peers = self._watchers.get(queue)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                del self._watchers[queue]

    def on_entries(self, pushed: list[tuple[str, int, list[Any]]]) -> None:
        """The dispatcher's watch sink: one ENTRIES frame per watching link."""
        frames: dict[RpcPeer, list[bytes]] = {}
        counts: dict[RpcPeer, int] = {}
        for queue, first, entries in pushed:
            for peer in self._watchers.get(queue, ()):
                if peer.paused:
                    # The proxy is not reading as fast as we push: skip, it reads these later
                    # (a gap in its pushed runs makes it READ), so our buffer stays bounded.
                    continue
                out = frames.get(peer)
                if out is None:
                    out = frames[peer] = [b""]
                    counts[peer] = 0
                put_str(out, queue)
                out.append(_I64.pack(first))
                encode_entries(out, entries)
                counts[peer] += 1
        for peer, out in frames.items():
            out[0] = _U16.pack(counts[peer])
            peer.send(ENTRIES, b"".join(out))

    def on_round(self) -> None:
        """A dispatch round finished: tell the links how far indexing got (once per tick)."""
        if self.peers and not self._push_scheduled:
            self._push_scheduled = True
            asyncio.get_running_loop().call_soon(self._push_indexed)

    def _push_indexed(self) -> None:
        self._push_scheduled = False
        body = _I64.pack(int(self.queues.dispatcher.records))
        for peer in self.peers:
            peer.send(INDEXED, body)

    def _read(self, peer: RpcPeer, body: bytes) -> bytes:
        queue, pos = get_str(body, 0)
        from_seq, max_n = _READ_REQ.unpack_from(body, pos)
        r = self.queues.read(queue, from_seq, max_n)
        out = [_READ_HEAD.pack(r.start_seq, r.next_seq, r.first_seq)]
        encode_entries(out, r.entries)
        return b"".join(out)

    def _resolve(self, peer: RpcPeer, body: bytes) -> bytes:
        entries, _ = decode_entries(body, 0)
        return encode_messages(self.queues.resolve(entries))

    def _acquire(self, peer: RpcPeer, body: bytes) -> bytes:
        holds: Counter[str] = peer.state.setdefault("holds", Counter())
        out: list[Any] = []
        for filt, since_ms in codec.decode(body):
            try:
                a = self.queues.acquire_filter(filt, since_ms)
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
                continue
            holds[a.queue] += 1
            out.append([a.queue, a.start_seq])
        return codec.encode(out)

    def _release(self, peer: RpcPeer, body: bytes) -> None:
        queue, _ = get_str(body, 0)
        holds: Counter[str] = peer.state.setdefault("holds", Counter())
        if holds[queue] > 0:
            holds[queue] -= 1
            if not holds[queue]:
                del holds[queue]
        self.queues.release_filter(queue)

    def _retain(self, peer: RpcPeer, body: bytes) -> bytes:
        topic, payload, qos, cid, props, ts, position = codec.decode(body)
        self.queues.retained.set(
            topic, payload, qos, cid, props_from_obj(props), ts, tuple(position)
        )
        return b""

    def _retained(self, peer: RpcPeer, body: bytes) -> bytes:
        filt, _ = get_str(body, 0)
        return encode_messages(self.queues.retained.match(filt))

    def _sessions(self, peer: RpcPeer, body: bytes) -> bytes:
        return codec.encode(self.queues.sessions.load_all())

    def _put_sessions(self, peer: RpcPeer, body: bytes) -> bytes:
        items = codec.decode(body)
        self.queues.sessions.put_many([(cid, state) for cid, state in items])
        return b""

    def _del_session(self, peer: RpcPeer, body: bytes) -> None:
        cid, _ = get_str(body, 0)
        self.queues.sessions.delete(cid)


# -- the proxy side ------------------------------------------------------------------------------
class RemoteLightQueues:
    """What a proxy uses of `LightQueues`, over the core link; calls return futures.

    Construct, put `methods()` into the link's method table, then `attach(peer)`.
    """

    def __init__(self) -> None:
        self.peer: RpcPeer | None = None
        self.indexed = 0  # the core dispatcher's record count, pushed after its rounds
        # Where pushed entries of watched queues go: (queue, first sequence, entries).
        self.entries_sink: Any = None

    def methods(self) -> dict[int, Handler]:
        return {INDEXED: self._on_indexed, ENTRIES: self._on_entries}

    def _on_entries(self, peer: RpcPeer, body: bytes) -> None:
        (n,) = _U16.unpack_from(body, 0)
        pos = 2
        sink = self.entries_sink
        for _ in range(n):
            queue, pos = get_str(body, pos)
            (first,) = _I64.unpack_from(body, pos)
            entries, pos = decode_entries(body, pos + 8)
            if sink is not None:
                sink(queue, first, entries)

    def watch(self, queue: str, on: bool) -> None:
        """Have the core push `queue`'s new entries (ENTRIES), or stop."""
        assert self.peer is not None
        out: list[bytes] = []
        put_str(out, queue)
        self.peer.send(WATCH if on else UNWATCH, b"".join(out))

    def attach(self, peer: RpcPeer) -> None:
        self.peer = peer

    def _on_indexed(self, peer: RpcPeer, body: bytes) -> None:
        (self.indexed,) = _I64.unpack_from(body, 0)

    def _call(self, method: int, body: bytes) -> asyncio.Future[bytes]:
        assert self.peer is not None
        return self.peer.call(method, body)

    def read(self, queue: str, from_seq: int, max_n: int) -> asyncio.Future[ReadResult]:
        out: list[bytes] = []
        put_str(out, queue)
        out.append(_READ_REQ.pack(from_seq, max_n))
        return _then(self._call(READ, b"".join(out)), _decode_read)

    def resolve(self, entries: list[Any]) -> asyncio.Future[list[StoredMessage | None]]:
        out: list[bytes] = []
        encode_entries(out, entries)
        return _then(self._call(RESOLVE, b"".join(out)), decode_messages)

    def acquire_many(
        self, items: list[tuple[str, int | None]]
    ) -> asyncio.Future[list[tuple[str, int] | str]]:
        """Per item (queue, start sequence), or the error text when it was refused."""
        body = codec.encode([[f, s] for f, s in items])

        def decode(b: bytes) -> list[tuple[str, int] | str]:
            return [x if isinstance(x, str) else (x[0], x[1]) for x in codec.decode(b)]

        return _then(self._call(ACQUIRE, body), decode)

    def release(self, queue: str) -> None:
        assert self.peer is not None
        out: list[bytes] = []
        put_str(out, queue)
        self.peer.send(RELEASE, b"".join(out))

    def retain(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        client_id: str,
        properties: Any,
        timestamp_ms: int,
        position: tuple[str, int, int],
    ) -> asyncio.Future[bytes]:
        """Set (empty payload: clear) a retained message; the answer comes once it is written."""
        assert self.peer is not None
        body = codec.encode(
            [topic, bytes(payload), qos, client_id, props_to_obj(properties), timestamp_ms,
             list(position)]
        )  # fmt: skip
        return self.peer.call(RETAIN, body)

    def retained_match(self, filt: str) -> asyncio.Future[list[StoredMessage | None]]:
        out: list[bytes] = []
        put_str(out, filt)
        return _then(self._call(RETAINED, b"".join(out)), decode_messages)

    async def load_sessions(self) -> list[dict[str, Any]]:
        states = codec.decode(await self._call(SESSIONS, b""))
        return [s for s in states if isinstance(s, dict)]

    def put_sessions(
        self, items: list[tuple[str, dict[str, Any]]], wait: bool = False
    ) -> asyncio.Future[bytes] | None:
        """Write sessions in the core; with `wait`, a future that resolves once written."""
        assert self.peer is not None
        body = codec.encode([[cid, state] for cid, state in items])
        if wait:
            return self.peer.call(PUT_SESSIONS, body)
        self.peer.send(PUT_SESSIONS, body)
        return None

    def delete_session(self, client_id: str) -> None:
        assert self.peer is not None
        out: list[bytes] = []
        put_str(out, client_id)
        self.peer.send(DEL_SESSION, b"".join(out))


def _decode_read(body: bytes) -> ReadResult:
    start, nxt, first = _READ_HEAD.unpack_from(body, 0)
    entries, _ = decode_entries(body, _READ_HEAD.size)
    return ReadResult(entries, start, nxt, first)


def _then(fut: asyncio.Future[bytes], decode: Any) -> asyncio.Future[Any]:
    """A future of `decode(reply)` (decoding errors and RpcErrors land in it)."""
    out: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future[bytes]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif f.exception() is not None:
            out.set_exception(f.exception())  # type: ignore[arg-type]
        else:
            try:
                out.set_result(decode(f.result()))
            except Exception as exc:
                out.set_exception(exc)

    fut.add_done_callback(done)
    return out
