"""The store's methods on the core link: numbers and request/reply bodies, pure (no I/O).

The transport is `notify.link`; the service half is `lightgate.link_services.StoreService`, the
client half `mqtt_proxy.backends.remote_store.RemoteStore`. Both encode and decode through here only, so
the bytes of each method are written down once.

A proxy builds its MQTT RecordBatches itself (`store.mqtt_batches`, the same bytes the in-process
store writes) and ships them per loop tick in one APPEND; the core appends them exactly as it
appends a Kafka producer's batches (`Store.append_batch`). Under `always`, acknowledgement is
two-phase: the reply carries the offsets at once, and a DURABLE message follows when the fsync
covering the append is done.

Wire bodies (str = u16 length + UTF-8)::

    TOPICS       → JSON {topic: partitions}
    ENSURE_TOPIC str topic | u8 force → u32 partitions   (creates it if auto-create is on, or forced)
    APPEND       u32 token | u8 sync | u16 n | n × (str topic, u32 partition, u32 size, bytes)
                 → n × (i64 base offset | str error)               base -1 when that batch failed
    DURABLE      (core → proxy, one-way) u32 token | str error     "" = durable
    READ         str topic | u32 partition | i64 offset | u32 max bytes → whole batches
    OFFSETS      str topic | u32 partition → i64 log start | i64 high watermark
    TOPIC_CHANGED (core → proxy, one-way) str topic   deleted or grown: forget its partition count

ERROR codes of these methods: OFFSET_OUT_OF_RANGE, UNKNOWN_TOPIC, STORE_ERROR (`error_code`
maps a store exception to one, `store_error` maps it back).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable

from store.config import StoreError, UnknownTopicOrPartitionError
from store.log import OffsetOutOfRangeError

TOPICS, ENSURE_TOPIC, APPEND, DURABLE, READ, OFFSETS, TOPIC_CHANGED = 1, 2, 3, 4, 5, 6, 7
OFFSET_OUT_OF_RANGE, UNKNOWN_TOPIC, STORE_ERROR = 100, 101, 102

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
APPEND_HEAD = struct.Struct(">IBH")  # token, sync, n
_PART = struct.Struct(">II")  # partition, size
_READ = struct.Struct(">IqI")  # partition, offset, max bytes
_OFFSETS = struct.Struct(">qq")
_NO_ERROR = _U16.pack(0)  # an empty str


class WireError(ValueError):
    """A body that does not parse. The link answers a CALL that raises it with `rpc_code`, its
    BAD_REQUEST (this module is below the link and cannot import its RpcError)."""

    rpc_code = 3  # notify.link.BAD_REQUEST


# -- strings, shared with lightqueue.wire ----------------------------------------------------------
def put_str(out: list[bytes], s: str) -> None:
    b = s.encode("utf-8")
    out.append(_U16.pack(len(b)))
    out.append(b)


def get_str(buf: bytes, pos: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(buf, pos)
    end = pos + 2 + n
    if end > len(buf):
        raise WireError("truncated string")
    return buf[pos + 2 : end].decode("utf-8"), end


def str_body(s: str) -> bytes:
    """A body that is one str (TOPIC_CHANGED; light-queue RELEASE, WATCH...)."""
    b = s.encode("utf-8")
    return _U16.pack(len(b)) + b


# -- errors ---------------------------------------------------------------------------------------
def error_code(exc: Exception) -> int:
    """The ERROR code a store exception travels as."""
    if isinstance(exc, OffsetOutOfRangeError):
        return OFFSET_OUT_OF_RANGE
    if isinstance(exc, UnknownTopicOrPartitionError):
        return UNKNOWN_TOPIC
    return STORE_ERROR


def store_error(
    code: int, message: str, topic: str = "", partition: int = -1, offset: int = -1
) -> Exception:
    """The store exception an ERROR code stands for, as the in-process store would raise it."""
    if code == OFFSET_OUT_OF_RANGE:
        return OffsetOutOfRangeError(topic, partition, offset, -1, -1)
    if code == UNKNOWN_TOPIC:
        return UnknownTopicOrPartitionError(message)
    return StoreError(message)


# -- TOPICS, ENSURE_TOPIC -------------------------------------------------------------------------
def encode_topics(topics: dict[str, int]) -> bytes:
    return json.dumps(topics).encode()


def decode_topics(body: bytes) -> dict[str, int]:
    out: dict[str, int] = json.loads(body)
    return out


def encode_ensure_topic(name: str, force: bool) -> bytes:
    return str_body(name) + (b"\x01" if force else b"\x00")


def decode_ensure_topic(body: bytes) -> tuple[str, bool]:
    name, pos = get_str(body, 0)
    return name, body[pos : pos + 1] == b"\x01"


def encode_count(n: int) -> bytes:
    return _U32.pack(n)


def decode_count(body: bytes) -> int:
    return int(_U32.unpack(body)[0])


# -- APPEND, DURABLE ------------------------------------------------------------------------------
def encode_append(
    token: int, sync: bool, items: Iterable[tuple[str, int, bytes | bytearray]]
) -> bytes:
    """`items`: (log topic, partition, batch bytes), `len(items)` < 65536."""
    items = list(items)
    out = [APPEND_HEAD.pack(token, 1 if sync else 0, len(items))]
    for topic, part, buf in items:
        put_str(out, topic)
        out.append(_PART.pack(part, len(buf)))
        out.append(bytes(buf))
    return b"".join(out)


def decode_append(body: bytes) -> tuple[int, bool, list[tuple[str, int, bytes]]]:
    """(token, sync, [(log topic, partition, batch bytes)])."""
    token, sync, n = APPEND_HEAD.unpack_from(body, 0)
    pos = APPEND_HEAD.size
    items = []
    for _ in range(n):
        topic, pos = get_str(body, pos)
        part, size = _PART.unpack_from(body, pos)
        pos += _PART.size
        batch = body[pos : pos + size]
        pos += size
        if len(batch) != size:
            raise WireError("truncated APPEND")
        items.append((topic, part, batch))
    return token, bool(sync), items


def append_ok(out: list[bytes], base_offset: int) -> None:
    """One batch's answer in an APPEND reply: appended at `base_offset`."""
    out.append(_I64.pack(base_offset))
    out.append(_NO_ERROR)


def append_failed(out: list[bytes], error: str) -> None:
    """One batch's answer in an APPEND reply: refused, and why."""
    out.append(_I64.pack(-1))
    put_str(out, error)


def decode_append_reply(body: bytes, n: int) -> list[tuple[int, str]]:
    """(base offset, error) per batch; base -1 with the error when that batch failed."""
    out = []
    pos = 0
    for _ in range(n):
        (base,) = _I64.unpack_from(body, pos)
        err, pos = get_str(body, pos + 8)
        out.append((base, err))
    return out


def encode_durable(token: int, error: str = "") -> bytes:
    out = [_U32.pack(token)]
    put_str(out, error)
    return b"".join(out)


def decode_durable(body: bytes) -> tuple[int, str]:
    (token,) = _U32.unpack_from(body, 0)
    err, _ = get_str(body, 4)
    return token, err


# -- READ, OFFSETS, TOPIC_CHANGED -----------------------------------------------------------------
def encode_read(topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
    return str_body(topic) + _READ.pack(partition, offset, max_bytes)


def decode_read(body: bytes) -> tuple[str, int, int, int]:
    """(log topic, partition, offset, max bytes)."""
    topic, pos = get_str(body, 0)
    part, offset, max_bytes = _READ.unpack_from(body, pos)
    return topic, part, offset, max_bytes


def encode_offsets_request(topic: str, partition: int) -> bytes:
    return str_body(topic) + _U32.pack(partition)


def decode_offsets_request(body: bytes) -> tuple[str, int]:
    topic, pos = get_str(body, 0)
    (part,) = _U32.unpack_from(body, pos)
    return topic, part


def encode_offsets(log_start: int, high_watermark: int) -> bytes:
    return _OFFSETS.pack(log_start, high_watermark)


def decode_offsets(body: bytes) -> tuple[int, int]:
    """(log start offset, high watermark)."""
    start, hwm = _OFFSETS.unpack(body)
    return int(start), int(hwm)


def decode_str_body(body: bytes) -> str:
    """The one str of a TOPIC_CHANGED body (and the light queues' one-str bodies)."""
    return get_str(body, 0)[0]
