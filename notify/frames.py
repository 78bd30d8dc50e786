"""Notify wire format, sans-IO: bytes in → frames out, frame → bytes.

    frame    = length u32 (bytes after this field) | type u8 | body
    HELLO      body = str proxy_id                       client → server, first frame
    REGISTER   body = u32 n | n × str queue              client → server
    UNREGISTER body = u32 n | n × str queue              client → server
    EVENTS     body = u32 n | n × (str queue, i64 seq)   both ways (server: routed events and
                                                         resyncs; client: publish to route)
    PING       body = empty                              both ways, every heartbeat interval
    str      = u16 length | UTF-8

A frame longer than MAX_FRAME or an unknown type is a protocol error: the reader drops the
connection (the peer reconnects and re-registers, so nothing is lost but time).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

HELLO, REGISTER, UNREGISTER, EVENTS, PING = 1, 2, 3, 4, 5
MAX_FRAME = 16 << 20

_HEAD = struct.Struct(">IB")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_I64 = struct.Struct(">q")


class FrameError(ValueError):
    """The peer broke the notify protocol."""


def _frame(ftype: int, body: bytes) -> bytes:
    return _HEAD.pack(len(body) + 1, ftype) + body


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _U16.pack(len(b)) + b


def encode_hello(proxy_id: str) -> bytes:
    return _frame(HELLO, _str(proxy_id))


def encode_queues(ftype: int, queues: Iterable[str]) -> bytes:
    qs = list(queues)
    return _frame(ftype, _U32.pack(len(qs)) + b"".join(_str(q) for q in qs))


def encode_events(events: Iterable[tuple[str, int]]) -> bytes:
    parts = []
    for q, seq in events:
        parts.append(_str(q))
        parts.append(_I64.pack(seq))
    return _frame(EVENTS, _U32.pack(len(parts) // 2) + b"".join(parts))


PING_FRAME = _frame(PING, b"")


def events_body(events: Iterable[tuple[str, int]]) -> bytes:
    """An EVENTS body alone, for carrying events in another framing (the core link)."""
    return encode_events(events)[_HEAD.size :]


def queues_body(queues: Iterable[str]) -> bytes:
    """A REGISTER / UNREGISTER body alone (see events_body)."""
    return encode_queues(REGISTER, queues)[_HEAD.size :]


def _read_str(body: bytes, pos: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(body, pos)
    pos += 2
    if pos + n > len(body):
        raise FrameError("string runs past the frame")
    return body[pos : pos + n].decode("utf-8"), pos + n


def decode_body(ftype: int, body: bytes) -> object:
    """HELLO → str, (UN)REGISTER → list[str], EVENTS → list[(str, int)], PING → None."""
    try:
        if ftype == PING:
            return None
        if ftype == HELLO:
            return _read_str(body, 0)[0]
        if ftype in (REGISTER, UNREGISTER):
            (n,) = _U32.unpack_from(body, 0)
            pos, qs = 4, []
            for _ in range(n):
                q, pos = _read_str(body, pos)
                qs.append(q)
            return qs
        if ftype == EVENTS:
            (n,) = _U32.unpack_from(body, 0)
            pos, evs = 4, []
            for _ in range(n):
                q, pos = _read_str(body, pos)
                evs.append((q, _I64.unpack_from(body, pos)[0]))
                pos += 8
            return evs
    except (struct.error, UnicodeDecodeError) as e:
        raise FrameError(f"malformed frame type {ftype}: {e}") from e
    raise FrameError(f"unknown frame type {ftype}")


class FrameDecoder:
    """Feed bytes, get (type, decoded body) tuples; keeps only the unparsed tail."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[int, object]]:
        buf = self._buf
        buf += data
        out = []
        pos, end = 0, len(buf)
        while end - pos >= 5:
            length, ftype = _HEAD.unpack_from(buf, pos)
            if length < 1 or length > MAX_FRAME:
                raise FrameError(f"frame length {length} out of range")
            if end - pos - 4 < length:
                break
            body = bytes(buf[pos + 5 : pos + 4 + length])
            out.append((ftype, decode_body(ftype, body)))
            pos += 4 + length
        if pos:
            del buf[:pos]
        return out
