"""The link's framing, sans-IO: frames in and out of bytes, the error body, addresses.

Wire format (the asyncio half is notify.link)::

    frame  = length u32 (bytes after this field) | kind u8 | call id u32 | method u16 | body
    CALL   the peer answers with exactly one REPLY or ERROR carrying the same call id
    SEND   one-way; call id 0
    REPLY  body = the method's answer
    ERROR  body = code u16 | UTF-8 message
    PING   empty; sent every `heartbeat` s while idle, a peer silent for 3 intervals is dropped
    AUTH   the handshake (notify.link_auth), step in the method field; before it completes only
           AUTH, PING and an ERROR with call id 0 (the core refusing the link) are accepted
"""

from __future__ import annotations

import struct
from typing import Any

CALL, SEND, REPLY, ERROR, PING, AUTH = 1, 2, 3, 4, 5, 6
HEAD = struct.Struct(">IBIH")  # length, kind, call id, method
HEAD_SIZE = HEAD.size  # 11
_LEN = struct.Struct(">I")
_ERR = struct.Struct(">H")
MAX_FRAME = 256 << 20

# ERROR codes (u16). Methods may define their own from 100 up.
INTERNAL, NO_SUCH_METHOD, BAD_REQUEST, CLOSED, AUTH_FAILED = 1, 2, 3, 4, 5
AUTH_TIMEOUT = 10.0  # s for a new link to complete its handshake
PRE_AUTH_MAX_FRAME = 1024  # the handshake's frames are under 100 bytes


class RpcError(Exception):
    """A call failed on the peer (or the link went away before its answer)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class FrameError(ValueError):
    """The peer broke the framing: the link is closed."""


def rpc_error_of(exc: BaseException) -> RpcError | None:
    """The answer a handler's exception carries: an RpcError, or an exception with an int
    `rpc_code` (the body codecs below the link, store.wire and lightqueue.wire, cannot import
    RpcError, so a malformed body raises their own `WireError`, whose code is BAD_REQUEST)."""
    if isinstance(exc, RpcError):
        return exc
    code = getattr(exc, "rpc_code", None)
    return RpcError(code, str(exc)) if isinstance(code, int) else None


def encode_frame(kind: int, call_id: int, method: int, body: bytes = b"") -> bytes:
    return HEAD.pack(len(body) + 7, kind, call_id, method) + body


def error_body(code: int, message: str) -> bytes:
    return _ERR.pack(code) + message.encode("utf-8", "replace")


def parse_error(body: bytes) -> RpcError:
    if len(body) < 2:
        return RpcError(INTERNAL, "malformed error frame")
    return RpcError(_ERR.unpack_from(body)[0], body[2:].decode("utf-8", "replace"))


class FrameDecoder:
    """Bytes in, `(kind, call id, method, body)` out. Keeps only the unparsed tail."""

    __slots__ = ("_buf", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buf = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple[int, int, int, bytes]]:
        # Whole frames inside one chunk (the common case) are sliced from `data` itself; only a
        # partial tail is kept, in a bytearray that grows in place (no quadratic re-joining of a
        # multi-megabyte frame that arrives in many chunks).
        tail = self._buf
        if tail:
            tail += data
            buf: Any = tail
        else:
            buf = data
        out = []
        pos, n = 0, len(buf)
        unpack = HEAD.unpack_from
        while n - pos >= HEAD_SIZE:
            length, kind, call_id, method = unpack(buf, pos)
            if length < 7 or length > self.max_frame:
                raise FrameError(f"frame length {length} outside 7..{self.max_frame}")
            if not CALL <= kind <= AUTH:
                raise FrameError(f"unknown frame kind {kind}")
            end = pos + 4 + length
            if end > n:
                break
            out.append((kind, call_id, method, bytes(buf[pos + HEAD_SIZE : end])))
            pos = end
        if buf is tail:
            del tail[:pos]
        elif pos < n:
            self._buf = bytearray(buf[pos:])
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def parse_address(address: str) -> tuple[str, str | int]:
    """`unix:/path` → ("unix", path); `host:port` → (host, port)."""
    if address.startswith("unix:"):
        return "unix", address[5:]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address {address!r}: expected unix:/path or host:port")
    return host or "127.0.0.1", int(port)
