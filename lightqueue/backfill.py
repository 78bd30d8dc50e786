"""Replay queues: history from a time (or offsets), then live, with no gap and no duplicate.

A replay queue `$replay/<since>/<filter>` is created *not live*: the dispatcher does not feed it.
Its start vector S (per relevant partition: the first offset with timestamp ≥ since, clamped to
the log start; or explicit offsets) is fixed at creation, and a cursor per partition starts at S.
`Backfill.run` then repeats, one WriteBatch per step (entries + queue meta + cursor in the filter
record, so a crash resumes exactly):

1. For each relevant partition, with D = the dispatcher's position there: index the matching
   records in [cursor, min(D, cursor + share)) and advance the cursor. Records at ≥ D are left
   alone: the dispatcher has not indexed them yet.
2. If cursor == D for every relevant partition — checked synchronously, with no await between the
   check and the flip, so no dispatch round can run in between — the queue goes *live*: into the
   trie, so the next round appends from exactly D. History covered [S, D), live covers [D, ∞).
3. Otherwise wait (yield, or for the next dispatch round when the dispatcher is behind the
   cursor) and repeat. Backfill reads faster than the log grows, so it converges.

Subscribers read the queue from its start while it fills; each step announces the new last_seq.
"Relevant" partitions: those of the filter's log topic when its first level is literal (plus a
log topic of that very name, for records whose MQTT topic is the log topic's own name), all
non-system topics otherwise; partitions created later start at their log start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from lightqueue import codec
from lightqueue.dispatch_rules import aborted_check, is_system_topic, mqtt_topic_of
from lightqueue.index_batch import put_blocks, records_of
from lightqueue.keys import P_FILTER, entry_head, pack_u64
from lightqueue.topic_trie import topic_matches
from store import OffsetOutOfRangeError
from store.backend import FetchPending, LogBackend
from store.mapping import escape_level
from store.record_batch import BatchWalk

if TYPE_CHECKING:
    from lightqueue.db import Queue
    from lightqueue.queues import LightQueues

log = logging.getLogger("lightgate.lightqueue.backfill")


def relevant_topics(store: LogBackend, filt: str) -> list[str]:
    first = filt.split("/", 1)[0]
    topics = [t for t in store.topics() if not is_system_topic(t)]
    if first in ("+", "#"):
        return sorted(topics)
    names = {escape_level(first), first}
    return sorted(t for t in topics if t in names)


def start_vector(store: LogBackend, filt: str, since_ms: int) -> dict[tuple[str, int], int]:
    """Per relevant partition: first offset with timestamp ≥ since_ms (≥ log start)."""
    out = {}
    for t in relevant_topics(store, filt):
        for p in range(store.topics()[t]):
            o = store.offset_for_timestamp(t, p, since_ms)
            if o is None:
                o = store.high_watermark(t, p)
            out[(t, p)] = max(o, store.log_start_offset(t, p))
    return out


class Backfill:
    """Fills one replay queue from its cursor up to the dispatcher, then makes it live."""

    def __init__(self, lq: LightQueues, q: Queue, rec: dict[str, Any]) -> None:
        self.lq = lq
        self.q = q
        self.rec = rec
        names = lq.qdb.topic_names
        self.cursor: dict[tuple[str, int], int] = {
            (names[tid], p): o for tid, p, o in rec["cursor"]
        }
        self.step_records = lq.config.backfill_step_records
        self.done = asyncio.Event()
        self._match: dict[tuple[str, bytes | None], bool] = {}

    async def run(self) -> None:
        try:
            while not self.step():
                if self._waiting:  # the dispatcher is behind our start vector: let it run
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.lq.dispatcher.wait_round(), 0.1)
                else:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("backfill of %s failed", self.q.name)
            raise
        finally:
            self.done.set()

    _waiting = False

    def step(self) -> bool:
        """One WriteBatch of history; returns True once the queue is live."""
        lq, q = self.lq, self.q
        if q.live or q.name not in lq.qdb.queues or lq.qdb.queues[q.name] is not q:
            return True  # went live already, or dropped meanwhile
        disp = lq.dispatcher
        store = lq.store
        filt = self.rec["filter"]
        parts = [(t, p) for t in relevant_topics(store, filt) for p in range(store.topics()[t])]
        wb = lq.qdb.db.write_batch()
        start_next = q.next
        share = max(self.step_records // max(len(parts), 1), 256)
        waiting = False
        for t, p in parts:
            d = disp.position(t, p)
            c = self.cursor.get((t, p))
            if c is None:
                c = self.cursor[(t, p)] = store.log_start_offset(t, p)
            if c > d:
                waiting = True  # the dispatcher is behind our start: wait for it
                continue
            n = 0
            while c < d and n < share:
                try:
                    data = store.read(t, p, c, disp.read_bytes)
                except OffsetOutOfRangeError:
                    c = max(c, store.log_start_offset(t, p))
                    continue
                except FetchPending:
                    waiting = True  # cluster log: fetched meanwhile, the next step reads it
                    break
                if not data:
                    break
                c, k = self._index(t, p, data, c, d, share - n, wb)
                n += k + 1
            self.cursor[(t, p)] = c
        live = all(self.cursor[tp] == disp.position(*tp) for tp in parts)
        ids = lq.qdb.topic_ids
        self.rec["cursor"] = [
            [ids[t] if t in ids else lq.qdb.topic_id(t, wb), p, o]
            for (t, p), o in sorted(self.cursor.items())
        ]
        if live:
            self.rec["state"] = "live"
        put_blocks([q], wb)
        wb.put(P_FILTER + q.name.encode("utf-8"), codec.encode(self.rec))
        wb.put(q.mkey, q.meta())
        wb.write()
        if live:
            lq._make_live(q)
            log.info("replay queue %s live after %d history entries", q.name, q.next)
        if q.next != start_next and lq.sink is not None:
            lq.sink([(q.name, q.next - 1)])
        self._waiting = waiting
        return live

    def _index(
        self, t: str, p: int, data: bytes, c: int, end: int, budget: int, wb: Any
    ) -> tuple[int, int]:
        q = self.q
        filt = self.rec["filter"]
        tid = self.lq.qdb.topic_id(t, wb)
        ehead = entry_head(tid, p)
        match = self._match
        if len(match) > 100_000:
            match.clear()
        n = 0
        aborted = aborted_check(self.lq.store)
        # Markers and aborted transactions are not delivered (the dispatcher's rule).
        walk = BatchWalk(
            data, c, end, skip_control=True, aborted=lambda pid, o: aborted(t, p, pid, o)
        )
        for _h, pos, size in walk:
            for r in records_of(data, pos, size):
                off = r.offset
                if off < c:
                    continue
                if off >= end:
                    break
                if n >= budget:
                    return off, n
                key = r.key
                m = match.get((t, key))
                if m is None:
                    m = match[(t, key)] = topic_matches(filt, mqtt_topic_of(t, key))
                if m:
                    if q.buf is None:
                        q.buf = bytearray()
                    q.buf += ehead + pack_u64(off)
                    q.next += 1
                n += 1
        return walk.next_offset, n
