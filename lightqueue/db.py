"""The light-queue LevelDB and its in-memory mirror: queues, log-topic ids, checkpoints, filters.

Derived data (except the `f`, `s`, `r` prefixes): queue entries, queue metadata and the dispatcher
checkpoint are an index over the commitlog and can be rebuilt from it (`rebuild.py`). They are
written with `sync=False`: a `kill -9` loses nothing LevelDB already accepted, and after an OS
crash LevelDB recovers a prefix of its write batches; since each dispatch batch carries its own
checkpoint, any prefix is a consistent state that re-dispatch continues exactly (see
dispatcher.py and the crash test).

`QueueDB` loads every queue's metadata into memory at open (one small object per queue) so the
dispatcher never reads LevelDB on its hot path. Event-loop-only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import plyvel

from lightqueue import codec
from lightqueue.keys import (
    G_LAYOUT,
    G_NEXT_QID,
    G_NEXT_TID,
    KIND_DROPPED,
    KIND_EXACT,
    LAYOUT_VERSION,
    P_CHECKPOINT,
    P_ENTRY,
    P_FILTER,
    P_GLOBAL,
    P_META,
    P_TOPIC,
    block_count,
    checkpoint_key,
    decode_meta,
    encode_block_py,
    encode_meta,
    entry_key_seq,
    entry_prefix,
    layout_1_block,
    meta_key,
    pack_u32,
    parse_checkpoint_key,
    prefix_end,
    unpack_u32,
    unpack_u64,
)
from store.twins import twin

log = logging.getLogger("lightgate.lightqueue")

_encode_block = twin(
    encode_block_py,
    "lightqueue._cblocks",
    "encode_block",
    what="a block value from a round's entries",
)

LIGHTQUEUE_DIR = "lightqueue"  # under the data dir


CONVERT_CHUNK = 100_000  # keys per WriteBatch when converting an older layout
G_CONVERTED = G_LAYOUT + b".converted"  # the last entry key converted so far (to layout 3)
# Written by a clean close with every queue's exact `m` record; deleted at open. Without it (a
# crash) each queue's end is read from its last entry: one LevelDB seek per queue, ~35 µs, which
# for a million topics (a million retained messages) was most of a restart.
G_CLEAN = P_GLOBAL + b"clean"


class Queue:
    """In-memory state of one light queue (mirrors its `m` record)."""

    __slots__ = (
        "name", "qid", "kind", "start", "next", "kpfx", "mkey", "touched", "refs",
        "released_at", "filter", "gate", "live", "watchers", "watch", "buf",
    )  # fmt: skip

    def __init__(self, name: str, qid: int, kind: int, start: int, nxt: int) -> None:
        self.name = name
        self.qid = qid
        self.kind = kind
        self.start = start  # first valid sequence (older ones trimmed or purged)
        self.next = nxt  # sequence of the next entry
        self.kpfx = entry_prefix(qid)
        self.mkey = meta_key(name)
        self.touched = -1  # dispatch round that last grew it
        self.refs = 0  # subscriptions holding it (filter and replay queues)
        self.released_at = time.monotonic()
        self.filter: str | None = None  # the MQTT filter it indexes (filter and replay queues)
        self.gate: dict[tuple[int, int], int] | None = None  # rebuild: (tid, part) → first offset
        self.live = kind == KIND_EXACT  # filter queues: in the trie (not backfilling)
        self.watchers = 0  # readers that want new entries pushed (LightQueues.watch)
        self.watch: list[tuple[str, int, int]] | None = None  # entries of this round, if watched
        # This round's entries while a round fills it (index_batch.put_blocks writes them).
        self.buf: bytearray | None = None

    def meta(self) -> bytes:
        return encode_meta(self.qid, self.kind, self.start, self.next)

    def __repr__(self) -> str:
        return f"Queue({self.name!r}, qid={self.qid}, kind={self.kind}, {self.start}..{self.next})"


class QueueDB:
    """The open LevelDB plus the in-memory mirror of `m`, `t`, `c`, `g` and `f`."""

    def __init__(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Set while the dispatcher holds a round's WriteBatch back (Dispatcher.HOLD_S): `db`
        # writes it before anyone else reads or writes.
        self.pending_write: Callable[[], None] | None = None
        self.raw = plyvel.DB(
            str(path),
            create_if_missing=True,
            write_buffer_size=16 << 20,
            block_size=16 << 10,
            lru_cache_size=32 << 20,
            bloom_filter_bits=10,
            # Entry blocks are compact already (keys.py, "Block values"); snappy on them cost
            # ~20 % of the CPU per message in fan-in for little (docs/performance-history.md).
            compression=None,
        )
        layout = self.db.get(G_LAYOUT)
        if layout is None:
            self.db.put(G_LAYOUT, pack_u32(LAYOUT_VERSION), sync=True)
        elif unpack_u32(layout)[0] in (1, 2):
            self._convert(unpack_u32(layout)[0])
        elif unpack_u32(layout)[0] != LAYOUT_VERSION:
            raise RuntimeError(f"light-queue DB layout {unpack_u32(layout)[0]} is not supported")
        self.queues: dict[str, Queue] = {}
        self.by_qid: dict[int, Queue] = {}
        self.topic_ids: dict[str, int] = {}
        self.topic_names: list[str] = []
        self.checkpoints: dict[tuple[str, int], int] = {}
        self.filters: dict[str, dict[str, Any]] = {}  # queue name → filter record
        self.next_qid = self._counter(G_NEXT_QID)
        self.next_tid = self._counter(G_NEXT_TID)
        clean = self.db.get(G_CLEAN) is not None
        if clean:  # gone before anything else is written: a crash from now on is not clean
            self.db.delete(G_CLEAN, sync=True)
        self.opened_clean = clean
        self._load(exact_meta=clean)

    @property
    def db(self) -> Any:
        """The LevelDB as every reader and writer other than the dispatcher's rounds must see
        it: with what the dispatcher holds back written first (same order as if it had not)."""
        w = self.pending_write
        if w is not None:
            w()
        return self.raw

    def _counter(self, key: bytes) -> int:
        v = self.db.get(key)
        return unpack_u32(v)[0] if v is not None else 0

    def _load(self, exact_meta: bool) -> None:
        db = self.db
        for k, v in db.iterator(prefix=P_TOPIC):
            tid = unpack_u32(v)[0]
            name = k[1:].decode("utf-8")
            self.topic_ids[name] = tid
            while len(self.topic_names) <= tid:
                self.topic_names.append("")
            self.topic_names[tid] = name
        for k, v in db.iterator(prefix=P_META):
            qid, kind, start, nxt = decode_meta(v)
            # The `m` record's next is a floor: dispatch rounds do not rewrite it (one put less
            # per grown queue per round); the last entry, written atomically with the
            # checkpoint, says where the queue really ends.
            if not exact_meta:
                last = next(db.iterator(prefix=entry_prefix(qid), reverse=True), None)
                if last is not None:
                    nxt = max(nxt, entry_key_seq(last[0]) + block_count(last[1]))
            q = Queue(k[1:].decode("utf-8"), qid, kind, start, nxt)
            self.queues[q.name] = q
            self.by_qid[qid] = q
        for k, v in db.iterator(prefix=P_CHECKPOINT):
            tid, part = parse_checkpoint_key(k)
            self.checkpoints[(self.topic_names[tid], part)] = unpack_u64(v)[0]
        for k, v in db.iterator(prefix=P_FILTER):
            name = k[1:].decode("utf-8")
            rec = codec.decode(v)
            fq = self.queues.get(name)
            if fq is None or fq.kind == KIND_DROPPED:
                log.warning("filter record %r without a live queue: ignored", name)
                continue
            fq.filter = rec["filter"]
            self.filters[name] = rec

    def _convert(self, layout: int) -> None:
        """Rewrite every entry value of an older layout as a layout-3 block, keys unchanged:
        layout 1 kept one key per entry (uvarint topic id, uvarint partition, big-endian offset;
        b"" void), layout 2 blocks of 16-byte entries. In WriteBatches of CONVERT_CHUNK keys,
        each recording the last key it converted (G_CONVERTED), so a conversion cut short
        resumes after it instead of reading a new value as an old one."""
        db = self.db
        done = db.get(G_CONVERTED)
        start = P_ENTRY if done is None else done + b"\x00"
        n = 0
        t0 = time.monotonic()
        wb = db.write_batch(sync=True)
        for k, v in db.iterator(start=start, stop=prefix_end(P_ENTRY)):
            wb.put(k, _encode_block(layout_1_block(v) if layout == 1 else v))
            n += 1
            if n % CONVERT_CHUNK == 0:
                wb.put(G_CONVERTED, k)
                wb.write()
                wb = db.write_batch(sync=True)
                log.info("light-queue DB: %d keys converted from layout %d to %d so far (%.0f s)",
                         n, layout, LAYOUT_VERSION, time.monotonic() - t0)  # fmt: skip
        wb.put(G_LAYOUT, pack_u32(LAYOUT_VERSION))
        wb.delete(G_CONVERTED)
        wb.write()
        log.info("light-queue DB: %d keys converted from layout %d to %d in %.1f s", n, layout,
                 LAYOUT_VERSION, time.monotonic() - t0)  # fmt: skip

    def forget_topic(self, topic: str, wb: Any) -> None:
        """A deleted log topic: retire its id (entries naming it read as void from now on, and a
        topic re-created under the name gets a new id, so no entry can point at its new records)
        and drop its checkpoints."""
        tid = self.topic_ids.pop(topic, None)
        if tid is not None:
            wb.delete(P_TOPIC + topic.encode("utf-8"))
            self.topic_names[tid] = ""
        for t, p in [tp for tp in self.checkpoints if tp[0] == topic]:
            del self.checkpoints[(t, p)]
            if tid is not None:
                wb.delete(checkpoint_key(tid, p))

    # -- allocation (the caller puts the returned records in its WriteBatch) --------------------
    def topic_id(self, topic: str, wb: Any) -> int:
        tid = self.topic_ids.get(topic)
        if tid is None:
            tid = self.next_tid
            self.next_tid += 1
            self.topic_ids[topic] = tid
            self.topic_names.append(topic)
            assert len(self.topic_names) == tid + 1
            wb.put(P_TOPIC + topic.encode("utf-8"), pack_u32(tid))
            wb.put(G_NEXT_TID, pack_u32(self.next_tid))
        return tid

    def new_queue(self, name: str, kind: int, wb: Any, start: int = 0) -> Queue:
        """A fresh queue (or the re-use of a dropped one's id and sequence range)."""
        old = self.queues.get(name)
        if old is not None:
            if old.kind != KIND_DROPPED:
                raise ValueError(f"queue {name!r} exists")
            q = Queue(name, old.qid, kind, old.next, old.next)
        else:
            qid = self.next_qid
            self.next_qid += 1
            wb.put(G_NEXT_QID, pack_u32(self.next_qid))
            q = Queue(name, qid, kind, start, start)
        self.queues[name] = q
        self.by_qid[q.qid] = q
        wb.put(q.mkey, q.meta())
        return q

    def close(self, clean: bool = False) -> None:
        """Close; `clean` (nothing held back, no round half built) first writes every queue's
        exact `m` record and the G_CLEAN mark, so the next open trusts them."""
        if self.raw.closed:
            return
        db = self.db  # writes what a dispatch round holds back
        if clean and not any(q.buf for q in self.queues.values()):
            with db.write_batch(sync=True) as wb:
                for q in self.queues.values():
                    wb.put(q.mkey, q.meta())
                wb.put(G_CLEAN, b"")
        db.close()
