"""The light queues' methods on the core link: numbers and request/reply bodies, pure (no I/O).

LevelDB allows one process per database, so the process that owns the store and the dispatcher
also owns the light queues, sessions and retained messages, and a proxy in another process reads
them through these methods (transport `notify.link`, methods 32-63; service half
`lightgate.link_services.LightQueueService`, client half `mqtt_proxy.backends.remote_queues`). Both halves
encode and decode through here only.

Wire bodies (str = u16 length + UTF-8; `codec` = lightqueue.codec, used for the cold calls)::

    READ      str queue | i64 from | u32 max → i64 start | i64 next | i64 first | topics | entries
    RESOLVE   topics | entries → u32 n | n × message
    ACQUIRE   codec [[filter, since_ms | None], ...] → codec [[queue, start_seq] | error str, ...]
    RELEASE   str queue                                   (one-way)
    RETAIN    codec [topic, payload, qos, client id, props, ts, [log topic, partition, offset]]
              → empty, once written (a retained PUBLISH is acknowledged after this answer)
    RETAINED  str filter | u32 limit | u8 has cursor | [u32 len | cursor] → u8 has cursor |
              [u32 len | cursor] | u32 n | n × message   (one page; no cursor: the last page)
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

A malformed body raises `store.wire.WireError` (the link answers BAD_REQUEST).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from lightqueue import codec
from lightqueue.model import Position, ReadResult, StoredMessage, props_from_obj, props_to_obj
from store.mapping import MqttProperties
from store.wire import WireError, get_str, put_str
from store.wire import decode_str_body as decode_str_body  # the one-str bodies (RELEASE,
from store.wire import str_body as str_body  # WATCH, UNWATCH, DEL_SESSION)

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
def encode_entries(out: list[bytes], entries: Sequence[Position | None]) -> None:
    """Append `topics | entries` for `entries` (Position tuples or None)."""
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


def decode_entries(body: bytes, pos: int) -> tuple[list[Position | None], int]:
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
        raise WireError("truncated entries")
    # Plain tuples, as a local read makes them.
    out: list[Position | None] = [
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


def _put_cursor(out: list[bytes], cursor: bytes | None) -> None:
    if cursor is None:
        out.append(b"\x00")
    else:
        out.append(b"\x01" + _U32.pack(len(cursor)) + cursor)


def _get_cursor(body: bytes, pos: int) -> tuple[bytes | None, int]:
    if body[pos] == 0:
        return None, pos + 1
    (n,) = _U32.unpack_from(body, pos + 1)
    end = pos + 5 + n
    if end > len(body):
        raise WireError("truncated cursor")
    return body[pos + 5 : end], end


def encode_retained_req(filt: str, after: bytes | None, limit: int) -> bytes:
    out: list[bytes] = []
    put_str(out, filt)
    out.append(_U32.pack(limit))
    _put_cursor(out, after)
    return b"".join(out)


def decode_retained_req(body: bytes) -> tuple[str, bytes | None, int]:
    try:
        filt, pos = get_str(body, 0)
        (limit,) = _U32.unpack_from(body, pos)
        after, _ = _get_cursor(body, pos + 4)
    except (struct.error, IndexError) as e:
        raise WireError(f"bad RETAINED request: {e}") from e
    return filt, after, limit


def encode_retained_page(msgs: Sequence[StoredMessage], cursor: bytes | None) -> bytes:
    out: list[bytes] = []
    _put_cursor(out, cursor)
    return b"".join(out) + encode_messages(msgs)


def decode_retained_page(body: bytes) -> tuple[list[StoredMessage], bytes | None]:
    try:
        cursor, pos = _get_cursor(body, 0)
        msgs = decode_messages(body[pos:])
    except (struct.error, IndexError) as e:
        raise WireError(f"bad RETAINED page: {e}") from e
    return [m for m in msgs if m is not None], cursor


def encode_messages(msgs: Sequence[StoredMessage | None]) -> bytes:
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


# -- READ, RESOLVE ---------------------------------------------------------------------------------
def encode_read(queue: str, from_seq: int, max_n: int) -> bytes:
    return str_body(queue) + _READ_REQ.pack(from_seq, max_n)


def decode_read(body: bytes) -> tuple[str, int, int]:
    """(queue, from sequence, max entries)."""
    queue, pos = get_str(body, 0)
    from_seq, max_n = _READ_REQ.unpack_from(body, pos)
    return queue, from_seq, max_n


def encode_read_reply(r: ReadResult) -> bytes:
    out = [_READ_HEAD.pack(r.start_seq, r.next_seq, r.first_seq)]
    encode_entries(out, r.entries)
    return b"".join(out)


def decode_read_reply(body: bytes) -> ReadResult:
    start, nxt, first = _READ_HEAD.unpack_from(body, 0)
    entries, _ = decode_entries(body, _READ_HEAD.size)
    return ReadResult(entries, start, nxt, first)


def encode_resolve(entries: Sequence[Position | None]) -> bytes:
    out: list[bytes] = []
    encode_entries(out, entries)
    return b"".join(out)


def decode_resolve(body: bytes) -> list[Position | None]:
    return decode_entries(body, 0)[0]


# -- ACQUIRE, RETAIN, sessions ---------------------------------------------------------------------
def encode_acquire(items: list[tuple[str, int | None]]) -> bytes:
    """(filter, since_ms or None) per hold asked for."""
    return codec.encode([[f, s] for f, s in items])


def decode_acquire(body: bytes) -> list[tuple[str, int | None]]:
    return [(f, s) for f, s in codec.decode(body)]


def encode_acquire_reply(results: list[tuple[str, int] | str]) -> bytes:
    """Per item (queue, start sequence), or the error text when it was refused."""
    return codec.encode([x if isinstance(x, str) else [x[0], x[1]] for x in results])


def decode_acquire_reply(body: bytes) -> list[tuple[str, int] | str]:
    return [x if isinstance(x, str) else (x[0], x[1]) for x in codec.decode(body)]


def encode_retain(
    topic: str,
    payload: bytes,
    qos: int,
    client_id: str,
    properties: MqttProperties | None,
    timestamp_ms: int,
    position: tuple[str, int, int],
) -> bytes:
    return codec.encode(
        [topic, bytes(payload), qos, client_id, props_to_obj(properties), timestamp_ms,
         list(position)]
    )  # fmt: skip


def decode_retain(
    body: bytes,
) -> tuple[str, bytes, int, str, MqttProperties | None, int, Position]:
    """(topic, payload, qos, client id, MqttProperties or None, timestamp ms, log position)."""
    topic, payload, qos, cid, props, ts, position = codec.decode(body)
    return topic, payload, qos, cid, props_from_obj(props), ts, tuple(position)


def encode_sessions(states: list[dict[str, Any]]) -> bytes:
    return codec.encode(states)


def decode_sessions(body: bytes) -> list[dict[str, Any]]:
    return [s for s in codec.decode(body) if isinstance(s, dict)]


def encode_put_sessions(items: list[tuple[str, dict[str, Any]]]) -> bytes:
    return codec.encode([[cid, state] for cid, state in items])


def decode_put_sessions(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    return [(cid, state) for cid, state in codec.decode(body)]


# -- INDEXED, ENTRIES (pushed by the core) ---------------------------------------------------------
def encode_indexed(records: int) -> bytes:
    return _I64.pack(records)


def decode_indexed(body: bytes) -> int:
    return int(_I64.unpack_from(body, 0)[0])


def encode_pushed(pushed: Sequence[tuple[str, int, Sequence[Position | None]]]) -> bytes:
    """An ENTRIES body: (queue, first sequence, entries) per watched queue that grew."""
    out = [_U16.pack(len(pushed))]
    for queue, first, entries in pushed:
        put_str(out, queue)
        out.append(_I64.pack(first))
        encode_entries(out, entries)
    return b"".join(out)


def decode_pushed(body: bytes) -> list[tuple[str, int, list[Position | None]]]:
    (n,) = _U16.unpack_from(body, 0)
    pos = 2
    out = []
    for _ in range(n):
        queue, pos = get_str(body, pos)
        (first,) = _I64.unpack_from(body, pos)
        entries, pos = decode_entries(body, pos + 8)
        out.append((queue, first, entries))
    return out
