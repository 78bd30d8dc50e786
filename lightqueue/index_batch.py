"""One record batch into light-queue entries: the pure-Python twin of the compiled
`lightqueue._cindex.index_batch`, and the record reader the dispatcher and backfill share.

The dispatcher (dispatcher.py) calls `_index_batch` (the compiled one when built) per batch of a
round; the twin also takes the batches the compiled path does not (compressed ones, and records
whose retained state is derived from them: log = "kafka")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from lightqueue.db import Queue
from lightqueue.keys import BLOCK_MAX, pack_u64, put_blocks_py
from store.mapping import H_RETAIN
from store.record_batch import (
    BH_ATTRIBUTES,
    COMPRESSION_MASK,
    HEADER,
    InvalidRecordError,
    iter_records,
)
from store.twins import twin

try:  # the Cython reader behind store.record_batch; 0.25 us/record vs ~3 for pure Python
    from aiokafka.record._crecords import DefaultRecordBatch as _CReader
except ImportError:  # pragma: no cover
    _CReader = None


def records_of(data: Any, pos: int, size: int) -> Iterable[Any]:
    """(offset, key) carriers of one batch: Cython records or store Records (both have both)."""
    h = HEADER.unpack_from(data, pos)
    if not (h[BH_ATTRIBUTES] & COMPRESSION_MASK) and _CReader is not None:
        return _CReader(bytes(data[pos : pos + size]))  # type: ignore[no-any-return]
    return iter_records(memoryview(data)[pos : pos + size])


def _index_batch_py(
    data: Any,
    pos: int,
    size: int,
    base: int,
    c: int,
    end: int,
    n: int,
    budget: int,
    tcache: dict[bytes | None, tuple[Queue, ...]],
    targets_for: Callable[[bytes | None], tuple[Queue, ...]],
    ehead: bytes,
    stamp: int,
    grown: list[Queue],
    gate_key: tuple[int, int] | None,
    t: str,
    p: int,
    derive: Callable[[Any], None] | None = None,
) -> tuple[int, int]:
    """Index the records of the batch at `data[pos:pos+size]` that lie in [c, end): one entry
    per target queue of the record's key, `ehead` (topic id, partition) + the offset, appended to
    the queue's round buffer (`Queue.buf`; the dispatcher writes it as a block). Returns (the
    offset where `budget` ran out, or -1; records indexed so far, `n` included). Decodes every
    record before indexing any (a batch that does not decode raises, untouched). Twin of `lightqueue._cindex.index_batch`, which has no
    `derive`: the records carrying MQTT's retain header are handed to it (log = "kafka")."""
    try:
        recs = list(records_of(data, pos, size))
    except InvalidRecordError:
        raise
    except Exception as e:  # aiokafka's reader: CorruptRecordException, struct errors
        raise InvalidRecordError(str(e)) from e
    pack = pack_u64
    for r in recs:
        off = r.offset
        if off < c:
            continue
        if off >= end:
            break
        if n >= budget:
            return off, n
        key = r.key
        if derive is not None and r.headers:
            for hd in r.headers:
                if hd[0] == H_RETAIN:
                    derive(r)
                    break
        targets = tcache.get(key)
        if targets is None:
            targets = tcache[key] = targets_for(key)
        val = ehead + pack(off)
        for q in targets:
            if gate_key is not None and q.gate is not None and off < q.gate.get(gate_key, 0):
                continue
            if q.buf is None:
                q.buf = bytearray(val)
            else:
                q.buf += val
            w = q.watch
            if w is not None:
                w.append((t, p, off))
            q.next += 1
            if q.touched != stamp:
                q.touched = stamp
                grown.append(q)
        n += 1
    return -1, n


_index_batch = twin(
    _index_batch_py,
    "lightqueue._cindex",
    "index_batch",
    what="the dispatcher's per-record loop (entries into each queue's round buffer; a run of records with one key goes to its queues at once)",
)
_put_blocks = twin(
    put_blocks_py,
    "lightqueue._cblocks",
    "put_blocks",
    what="a round's entries as one LevelDB key (block) per queue",
)


def put_blocks(queues: list[Queue], wb: Any) -> None:
    """The round's entries of `queues` into `wb`, one block per queue (BLOCK_MAX at most)."""
    _put_blocks(queues, wb.put, BLOCK_MAX)
