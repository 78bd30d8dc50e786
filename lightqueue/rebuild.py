"""`rebuild_queues`: recreate every light queue from the commitlog (`lightgate rebuild-queues`).

Light queues are derived data; this is how they are derived from scratch. State that is not
derived (sessions, retained messages, filter records, log-topic ids) is copied over unchanged.

Sequence numbers are preserved where the log allows: stored session positions stay valid.
1. Counting pass (no writes): dispatch the log from its start up to the *old* checkpoint, filter
   queues gated at their creation vector (`from` in the filter record), counting each queue's
   entries. A queue's first rebuilt entry then gets `old next - count`, so the entry for a given
   record gets the same sequence as before, even after retention trimmed the queue's head.
2. Writing pass: dispatch the whole log (start → high watermark) into a fresh DB with those bases.
Queues fed by one partition (every exact topic written over MQTT) come out identical, entry for
entry. A filter queue spanning partitions holds the same entries, in the same order per
partition, but partitions may interleave differently than live dispatch did (that order depended
on timing); positions in such queues can shift by up to one dispatch batch. Replay queues come
out complete and live.

Crash safety: the new DB is built in `lightqueue.rebuild/`, marked complete with a `REBUILT`
file, then swapped in. If we crash...
1. while building: `lightqueue/` is untouched; the next rebuild (or open) deletes the partial dir.
2. after `lightqueue/` → `lightqueue.old/`, before the new dir is renamed: `recover_dirs` finishes
   the swap (the complete marker says the new one is good).
3. after the swap, before `lightqueue.old/` is deleted: `recover_dirs` deletes it.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from lightqueue import codec
from lightqueue.db import LIGHTQUEUE_DIR, Queue, QueueDB
from lightqueue.dispatcher import Dispatcher
from lightqueue.keys import (
    KIND_DROPPED,
    P_BRIDGE,
    P_FILTER,
    P_GLOBAL,
    P_RETAINED,
    P_SESSION,
    P_TOPIC,
    encode_meta,
    meta_key,
)
from lightqueue.topic_trie import FilterTrie

if TYPE_CHECKING:
    from store.backend import LogBackend

log = logging.getLogger("lightgate.lightqueue.rebuild")

REBUILD_DIR = LIGHTQUEUE_DIR + ".rebuild"
OLD_DIR = LIGHTQUEUE_DIR + ".old"
COMPLETE_MARKER = "REBUILT"


class NullBatch:
    """A WriteBatch that writes nothing (the counting pass)."""

    def put(self, key: bytes, value: bytes) -> None:
        pass

    def delete(self, key: bytes) -> None:
        pass

    def write(self) -> None:
        pass


class RebuildProgress(NamedTuple):
    phase: str  # "count" or "index"
    records_done: int
    records_total: int


class RebuildStats(NamedTuple):
    queues: int
    entries: int
    records: int
    seconds: float


def recover_dirs(data_dir: Path) -> None:
    """Finish or discard an interrupted rebuild (see the module docstring's crash list)."""
    data_dir = Path(data_dir)
    cur, new, old = data_dir / LIGHTQUEUE_DIR, data_dir / REBUILD_DIR, data_dir / OLD_DIR
    if new.exists():
        if (new / COMPLETE_MARKER).exists() and not cur.exists():
            new.rename(cur)
        else:
            shutil.rmtree(new)
    if old.exists() and cur.exists():
        shutil.rmtree(old)
    elif old.exists():
        old.rename(cur)
    marker = cur / COMPLETE_MARKER
    if marker.exists():
        marker.unlink()


def _copy_state(src: Any, dst: Any) -> None:
    for prefix in (P_TOPIC, P_GLOBAL, P_FILTER, P_SESSION, P_RETAINED, P_BRIDGE):
        wb = dst.write_batch()
        for n, (k, v) in enumerate(src.iterator(prefix=prefix), 1):
            wb.put(k, v)
            if n % 10_000 == 0:
                wb.write()
                wb = dst.write_batch()
        wb.write()


def _gate_filters(qdb: QueueDB, trie: FilterTrie[Queue]) -> None:
    """Filter and replay queues live from their creation vector (rebuild mode)."""
    for name, rec in qdb.filters.items():
        q = qdb.queues[name]
        q.gate = {(tid, p): o for tid, p, o in rec["from"]}
        q.live = True
        trie.add(rec["filter"], q)


def _spans(
    store: LogBackend, limit: dict[tuple[str, int], int] | None
) -> dict[tuple[str, int], tuple[int, int]]:
    """(log start, end) of every partition this pass reads."""
    out = {}
    for t, parts in store.topics().items():
        for p in range(parts):
            end = store.high_watermark(t, p) if limit is None else limit.get((t, p), 0)
            start = store.log_start_offset(t, p)
            out[(t, p)] = (start, max(start, end))
    return out


def _run(disp: Dispatcher, phase: str, limit: dict[tuple[str, int], int] | None,
         progress: Callable[[RebuildProgress], None] | None, counting: bool) -> int:  # fmt: skip
    """One pass over the log. Progress counts log offsets passed, not records indexed: offsets
    that index nothing (device events, control batches) still move it, so it ends at 100 %."""
    disp.refresh()
    disp.gated = True
    spans = _spans(disp.store, limit)
    total = sum(e - s for s, e in spans.values())
    start = disp.records
    while True:
        n = disp.dispatch_round(limit=limit, wb=NullBatch() if counting else None)
        if progress is not None:
            done = sum(min(max(disp.position(t, p), s), e) - s for (t, p), (s, e) in spans.items())
            progress(RebuildProgress(phase, done if n else total, total))
        if not n:
            return disp.records - start


def _write_metas(qdb: QueueDB, old_meta: dict[str, tuple[int, int, int, int]],
                 bases: dict[str, int]) -> None:  # fmt: skip
    """Every old queue at its base (start = next), tombstones as they were, filters live."""
    wb = qdb.db.write_batch()
    for name, (qid, kind, start, nxt) in old_meta.items():
        if kind == KIND_DROPPED:
            wb.put(meta_key(name), encode_meta(qid, kind, start, nxt))
        else:
            b = bases.get(name, 0)
            wb.put(meta_key(name), encode_meta(qid, kind, b, b))
    for k, v in qdb.db.iterator(prefix=P_FILTER):
        rec = codec.decode(v)
        if rec.get("state") != "live":
            rec["state"] = "live"
            wb.put(k, codec.encode(rec))
    wb.write()


def rebuild_sync(data_dir: Path, store: LogBackend,
                 progress: Callable[[RebuildProgress], None] | None = None,
                 batch_records: int = 100_000) -> RebuildStats:  # fmt: skip
    """The rebuild on an open store (event-loop thread, nothing else dispatching)."""
    t0 = time.monotonic()
    data_dir = Path(data_dir)
    recover_dirs(data_dir)
    cur, new_dir = data_dir / LIGHTQUEUE_DIR, data_dir / REBUILD_DIR
    old = QueueDB(cur)
    old_meta = {n: (q.qid, q.kind, q.start, q.next) for n, q in old.queues.items()}
    old_ckpt = dict(old.checkpoints)
    new = QueueDB(new_dir)
    _copy_state(old.db, new.db)
    old.close()
    _write_metas(new, old_meta, {})
    new.close()
    # Pass 1: count what the old state had indexed (up to its checkpoints), nothing written.
    counts: dict[str, int] = {}
    if old_ckpt:
        scratch = QueueDB(new_dir)
        trie: FilterTrie[Queue] = FilterTrie()
        _gate_filters(scratch, trie)
        disp = Dispatcher(scratch, store, trie, None, batch_records)
        limit = {tp: min(c, store.high_watermark(*tp)) for tp, c in old_ckpt.items()}
        _run(disp, "count", limit, progress, counting=True)
        counts = {n: q.next for n, q in scratch.queues.items()}
        scratch.close()
    # Pass 2: queues at their bases, then index the whole log for real.
    new = QueueDB(new_dir)
    bases = {n: max(0, m[3] - counts.get(n, 0)) for n, m in old_meta.items()}
    _write_metas(new, old_meta, bases)
    new.close()
    new = QueueDB(new_dir)
    trie = FilterTrie()
    _gate_filters(new, trie)
    disp = Dispatcher(new, store, trie, None, batch_records)
    records = _run(disp, "index", None, progress, counting=False)
    live = [q for q in new.queues.values() if q.kind != KIND_DROPPED]
    entries = sum(q.next - q.start for q in live)
    new.close()
    (new_dir / COMPLETE_MARKER).write_text("ok\n")
    # Swap (crash points 2 and 3 in the module docstring).
    old_dir = data_dir / OLD_DIR
    cur.rename(old_dir)
    new_dir.rename(cur)
    shutil.rmtree(old_dir)
    (cur / COMPLETE_MARKER).unlink()
    stats = RebuildStats(len(live), entries, records, time.monotonic() - t0)
    log.info("rebuilt %d light queues (%d entries) from %d records in %.1fs", *stats)
    return stats


async def rebuild_queues(data_dir: Path,
                         progress: Callable[[RebuildProgress], None] | None = None,
                         store: Any = None, store_config: Any = None,
                         batch_records: int = 100_000) -> RebuildStats:  # fmt: skip
    """Rebuild DATA/lightqueue from DATA/log. Opens (and locks) the store unless one is given,
    so it cannot run while `lightgate serve` holds the data dir."""
    from store import Store

    own = store is None
    if own:
        store = await Store.open(Path(data_dir), store_config)
    try:
        if getattr(store, "remote_reads", False):
            # A cluster log (store.cluster.kafka_log) fetches on its event loop: the rebuild runs in a
            # thread, where its reads wait for their fetches.
            return await asyncio.to_thread(
                rebuild_sync, Path(data_dir), store, progress, batch_records
            )
        return rebuild_sync(Path(data_dir), store, progress, batch_records)
    finally:
        if own:
            await store.close()
