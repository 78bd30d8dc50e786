"""Key layout of the light-queue LevelDB (`DATA/lightqueue`), one prefix byte per kind.

Derived data (rebuilt from the commitlog by `rebuild_queues`, never trusted as truth):
  q | qid u32 | seq u64            → a block of entries from `seq` on, one per sequence: log-topic
                                     id u32, partition u32 (the entry's "head"), offset u64; topic
                                     id 0xFFFFFFFF marks a void entry (its record was lost, see
                                     dispatcher.repair). At most BLOCK_MAX entries, stored compact
                                     (layout 3, "Block values" below).
  m | queue name (UTF-8)           → queue meta: format u8, qid u32, kind u8, start, next (uvarints)
  c | topic id u32 | partition u32 → dispatcher checkpoint: next offset to index (u64)
  t | log topic name               → log topic id (u32)
  g | name                         → global counters (next queue id, next topic id, layout version)

State (not derived; kept by `rebuild_queues`):
  f | queue name                   → filter / replay record (codec.encode'd dict, see queues.py)
  s | client id                    → MQTT session (codec.encode'd dict, see session_store.py)
  r | topic, levels joined by NUL  → retained message (see retained.py)

Fixed-width big-endian ids and sequences keep one queue's entries contiguous and in sequence
order, so a read is one iterator seek (back to the block holding the first sequence). A dispatch
round writes one block per queue it grew rather than one key per entry: LevelDB's cost is per
key (a memtable insert each, ~0.6 us), so fan-in's two entries per message cost two keys per
round instead (layout 2; layout 1, one key per entry, is converted at open).

Block values (layout 3): uvarint count, then one item per entry. A block keeps a table of the heads
it has used, in order of first use, and each head's last offset (-1 before its first entry); an
entry stores its head's index and z = zigzag(offset - that head's last offset - 1):
  uvarint(z << 3 | h)                                 h < 7: table index h (z < 2**57)
  uvarint(7), uvarint(x), [8-byte head], uvarint(z)   any index x; x == table size: a new head,
                                                      its 8 bytes follow
So a run of consecutive offsets of one partition costs one byte per entry (fan-in's common case),
a sparse per-topic queue two or three: layout 2 stored 16 bytes per entry and left the rest to
LevelDB's snappy, which cost a fifth of the gateway's CPU in fan-in (docs/performance-history.md).
The encoder looks a head up among the table's first HEAD_SCAN entries and the previous entry's;
one it does not find there is added again (a table may repeat a head), so encoding stays linear.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

P_ENTRY = b"q"
P_META = b"m"
P_CHECKPOINT = b"c"
P_TOPIC = b"t"
P_GLOBAL = b"g"
P_FILTER = b"f"
P_SESSION = b"s"
P_RETAINED = b"r"
P_BRIDGE = b"b"

LAYOUT_VERSION = 3
G_LAYOUT = P_GLOBAL + b"layout"
G_NEXT_QID = P_GLOBAL + b"next_qid"
G_NEXT_TID = P_GLOBAL + b"next_tid"

KIND_EXACT = 0  # one MQTT topic
KIND_FILTER = 1  # a wildcard filter, live from its creation point
KIND_REPLAY = 2  # `$replay/<ms>/<filter>`: history from a time, then live
KIND_DROPPED = 3  # tombstone of a dropped filter queue: keeps its sequence numbers unique

_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_U32U32 = struct.Struct(">II")
_ENTRY = struct.Struct(">IIQ")
ENTRY_SIZE = 16
VOID_TID = 0xFFFFFFFF
VOID_ENTRY = _ENTRY.pack(VOID_TID, 0, 0)
BLOCK_MAX = 1024  # entries per block key
HEAD_SCAN = 16  # table entries the encoder searches for a head (see "Block values")
_META_HEAD = struct.Struct(">BIB")
META_FORMAT = 1

pack_u32 = _U32.pack
pack_u64 = _U64.pack
unpack_u32 = _U32.unpack_from
unpack_u64 = _U64.unpack_from


def entry_prefix(qid: int) -> bytes:
    return P_ENTRY + _U32.pack(qid)


def entry_key(qid: int, seq: int) -> bytes:
    return P_ENTRY + _U32.pack(qid) + _U64.pack(seq)


def entry_key_seq(key: bytes) -> int:
    return _U64.unpack_from(key, 5)[0]


def checkpoint_key(tid: int, partition: int) -> bytes:
    return P_CHECKPOINT + _U32U32.pack(tid, partition)


def parse_checkpoint_key(key: bytes) -> tuple[int, int]:
    tid, part = _U32U32.unpack_from(key, 1)
    return tid, part


# --- entries --------------------------------------------------------------------------------

_UV = [bytes((i,)) for i in range(128)]


def uvarint(v: int) -> bytes:
    if v < 128:
        return _UV[v]
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def entry_head(tid: int, partition: int) -> bytes:
    """The first 8 bytes of every entry of one partition (the dispatcher appends the offset)."""
    return _U32U32.pack(tid, partition)


def pack_entry(tid: int, partition: int, offset: int) -> bytes:
    return _ENTRY.pack(tid, partition, offset)


def layout_1_block(v: bytes) -> bytes:
    """A layout-1 entry value (uvarint topic id, uvarint partition, minimal big-endian offset;
    b"" void) as one 16-byte layout-2 entry, which QueueDB then encodes as a one-entry block."""
    if not v:
        return VOID_ENTRY
    tid, pos = _get_uvarint(v, 0)
    part, pos = _get_uvarint(v, pos)
    return _ENTRY.pack(tid, part, int.from_bytes(v[pos:], "big"))


def block_count(v: bytes) -> int:
    """Entries in a block value."""
    return _get_uvarint(v, 0)[0]


def encode_block_py(raw: bytes | bytearray | memoryview) -> bytes:
    """Layout-2 entries (16 bytes each, as the dispatcher gathers them) as a layout-3 block value.
    The pure twin of `lightqueue._cblocks.encode_block`, byte for byte."""
    n = len(raw) // ENTRY_SIZE
    out = bytearray(uvarint(n))
    heads: list[bytes] = []
    last: list[int] = []
    prev = -1
    for i in range(n):
        e = bytes(raw[i * ENTRY_SIZE : (i + 1) * ENTRY_SIZE])
        head, off = e[:8], _U64.unpack_from(e, 8)[0]
        if prev >= 0 and heads[prev] == head:
            x = prev
        else:
            x = next((j for j in range(min(HEAD_SCAN, len(heads))) if heads[j] == head), -1)
        new = x < 0
        if new:
            x = len(heads)
            heads.append(head)
            last.append(-1)
        d = off - last[x] - 1
        z = d * 2 if d >= 0 else -d * 2 - 1
        if x < 7 and not new and z < 1 << 57:
            out += uvarint(z << 3 | x)
        else:
            out += uvarint(7) + uvarint(x) + (head if new else b"") + uvarint(z)
        last[x] = off
        prev = x
    return bytes(out)


def decode_block_py(v: bytes) -> bytes:
    """A layout-3 block value back to 16-byte entries; ValueError if it is not one. The pure twin
    of `lightqueue._cblocks.decode_block`."""
    try:
        n, pos = _get_uvarint(v, 0)
        out = bytearray()
        heads: list[bytes] = []
        last: list[int] = []
        for _ in range(n):
            tag, pos = _get_uvarint(v, pos)
            x = tag & 7
            if x == 7:
                if tag != 7:
                    raise ValueError("bad escape")
                x, pos = _get_uvarint(v, pos)
                if x == len(heads):
                    if pos + 8 > len(v):
                        raise ValueError("truncated head")
                    heads.append(bytes(v[pos : pos + 8]))
                    last.append(-1)
                    pos += 8
                z, pos = _get_uvarint(v, pos)
            else:
                z = tag >> 3
            if x >= len(heads):
                raise ValueError("head index out of range")
            off = last[x] + 1 + (z >> 1 if not z & 1 else -((z + 1) >> 1))
            if not 0 <= off < 1 << 63:
                raise ValueError("offset out of range")
            last[x] = off
            out += heads[x] + _U64.pack(off)
    except IndexError:
        raise ValueError("truncated block") from None
    if pos != len(v):
        raise ValueError("trailing bytes after the block's entries")
    return bytes(out)


def block_entries(v: bytes) -> list[tuple[int, int, int] | None]:
    """(topic id, partition, offset) per entry of a block, None for a void entry."""
    return [None if e[0] == VOID_TID else e for e in _ENTRY.iter_unpack(decode_block_py(v))]


def put_blocks_py(queues: list[Any], put: Any, block_max: int) -> None:
    """Write the entries each queue gathered this round (`q.buf`, 16 bytes each, ending at
    `q.next`) as blocks of at most `block_max`, and forget them. The pure twin of
    `lightqueue._cblocks.put_blocks` (lightqueue.index_batch picks one)."""
    for q in queues:
        buf = q.buf
        if buf is None:
            continue
        q.buf = None
        n = len(buf) // ENTRY_SIZE
        first = q.next - n
        kp = q.kpfx
        for i in range(0, n, block_max):
            put(
                kp + _U64.pack(first + i),
                encode_block_py(buf[i * ENTRY_SIZE : (i + block_max) * ENTRY_SIZE]),
            )


def block_start(db: Any, qid: int, seq: int) -> bytes:
    """The key to start iterating `qid`'s blocks at for sequence `seq`: the block holding it
    (the last key at or before `seq`), or `seq`'s own key when none is before it."""
    k = entry_key(qid, seq)
    prev = next(db.iterator(start=entry_prefix(qid), stop=k + b"\x00", reverse=True,
                            include_value=False), None)  # fmt: skip
    return k if prev is None else prev  # type: ignore[no-any-return]


def read_entries_py(
    it: Iterable[tuple[bytes, bytes]], first: int, end: int, names: list[str]
) -> list[tuple[str, int, int] | None]:
    """A light queue's entries [first, end) from a LevelDB iterator of its blocks (starting at
    the block that holds `first`, or after it): the (log topic, partition, offset) tuple per
    sequence, None for a void entry, a retired topic id ("" in `names`) or a sequence no block
    holds (entries are dense; stay aligned). The pure twin of `lightqueue._cblocks.read_entries`."""
    out: list[tuple[str, int, int] | None] = []
    expect = first
    for k, v in it:
        seq = entry_key_seq(k)
        raw = decode_block_py(v)
        for i, e in enumerate(_ENTRY.iter_unpack(raw)):
            s = seq + i
            if s < expect:
                continue
            if s >= end:
                break
            while expect < s:
                out.append(None)
                expect += 1
            expect += 1
            ok = e[0] != VOID_TID and e[0] < len(names) and names[e[0]]
            out.append((names[e[0]], e[1], e[2]) if ok else None)
        if seq + len(raw) // ENTRY_SIZE >= end:
            break
    out += [None] * (end - expect)
    return out


def _get_uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v, pos
        shift += 7


# --- queue metadata -------------------------------------------------------------------------


def meta_key(name: str) -> bytes:
    return P_META + name.encode("utf-8")


def encode_meta(qid: int, kind: int, start: int, nxt: int) -> bytes:
    return _META_HEAD.pack(META_FORMAT, qid, kind) + uvarint(start) + uvarint(nxt)


def decode_meta(v: bytes) -> tuple[int, int, int, int]:
    """(qid, kind, start, next)."""
    fmt, qid, kind = _META_HEAD.unpack_from(v, 0)
    if fmt != META_FORMAT:
        raise ValueError(f"unknown queue meta format {fmt}")
    start, pos = _get_uvarint(v, _META_HEAD.size)
    nxt, _ = _get_uvarint(v, pos)
    return qid, kind, start, nxt


# --- retained -------------------------------------------------------------------------------


def retained_key(topic: str) -> bytes:
    """Levels joined by NUL (never in an MQTT topic), so `a/b` sorts with its own subtree only."""
    return P_RETAINED + topic.replace("/", "\x00").encode("utf-8")


def retained_topic(key: bytes) -> str:
    return key[1:].decode("utf-8").replace("\x00", "/")


def prefix_end(prefix: bytes) -> bytes:
    """Smallest key greater than every key starting with `prefix` (for iterator stops)."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        raise ValueError("no end for an all-0xff prefix")
    p[-1] += 1
    return bytes(p)
