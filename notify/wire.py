"""Notify's methods on the core link: numbers and bodies, pure (no I/O).

The proxy registers interest in queues and the core routes the dispatcher's events to it
(`RouteTable`), coalesced per queue in the proxy's mailbox and drained into one EVENTS frame per
loop tick. Service half: `lightgate.link_services.NotifyService`; client half:
`mqtt_proxy.backends.remote_notify.LinkNotifier`; transport `notify.link`.

Wire bodies (str = u16 length + UTF-8)::

    REGISTER    (proxy → core, one-way) u32 n | n × str queue   the core answers each new queue
                                                                with its current last sequence
    UNREGISTER  (proxy → core, one-way) u32 n | n × str queue
    EVENTS      (core → proxy, one-way) u32 n | n × (str queue, i64 last_seq)

The bytes are those of the bodies of the TCP notify transport that preceded the link.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

REGISTER, UNREGISTER, EVENTS = 66, 67, 68

_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
_I64 = struct.Struct(">q")


class WireError(ValueError):
    """A body that does not parse (the link answers a CALL that raises it with BAD_REQUEST)."""

    rpc_code = 3  # notify.link.BAD_REQUEST


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _U16.pack(len(b)) + b


def _read_str(body: bytes, pos: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(body, pos)
    pos += 2
    if pos + n > len(body):
        raise WireError("string runs past the body")
    return body[pos : pos + n].decode("utf-8"), pos + n


def encode_queues(queues: Iterable[str]) -> bytes:
    """A REGISTER / UNREGISTER body."""
    qs = list(queues)
    return _U32.pack(len(qs)) + b"".join(_str(q) for q in qs)


def decode_queues(body: bytes) -> list[str]:
    try:
        (n,) = _U32.unpack_from(body, 0)
        pos, qs = 4, []
        for _ in range(n):
            q, pos = _read_str(body, pos)
            qs.append(q)
        return qs
    except (struct.error, UnicodeDecodeError) as e:
        raise WireError(f"malformed queue list: {e}") from e


def encode_events(events: Iterable[tuple[str, int]]) -> bytes:
    """An EVENTS body: (queue, last_seq) pairs."""
    parts = []
    for q, seq in events:
        parts.append(_str(q))
        parts.append(_I64.pack(seq))
    return _U32.pack(len(parts) // 2) + b"".join(parts)


def decode_events(body: bytes) -> list[tuple[str, int]]:
    try:
        (n,) = _U32.unpack_from(body, 0)
        pos, evs = 4, []
        for _ in range(n):
            q, pos = _read_str(body, pos)
            evs.append((q, _I64.unpack_from(body, pos)[0]))
            pos += 8
        return evs
    except (struct.error, UnicodeDecodeError) as e:
        raise WireError(f"malformed events: {e}") from e
