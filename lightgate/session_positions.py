"""A stored MQTT session in terms every node understands: log positions, not queue sequences.

Light queues are derived per node: the same message has a different sequence on every node, so
a session that moves to another node cannot carry `pos` as it is. `portable` rewrites a stored
state (mqtt_proxy.sessions.state) before it leaves this node:

- each queue-backed subscription gets `at`: per relevant log partition, the first offset its
  reader has not finished. That is the offset of the partition's first entry at or after the
  subscription's acknowledged position in this node's queue, else (no such entry) the
  dispatcher's position in that partition: everything it indexed there lies behind the reader.
- each in-flight message gets `at`: the (log topic, partition, offset) its queue entry points at.

`localize` does the reverse on the node that takes the session over: the subscription reads a
replay queue started at exactly those offsets (`LightQueues.acquire_filter(offsets=...)`:
history, then live, no gap and no duplicate), and each in-flight message is found again in
that queue by its log position, so it is pending there (its DUP resend is the only copy). A
message acknowledged out of order, behind an unacknowledged one of the same partition, is read
again (a QoS 1 repeat); with in-order acknowledgements (what clients do) nothing repeats.

`$share` members carry no position (a group's position is per node): they read live there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from lightqueue.backfill import relevant_topics

log = logging.getLogger("lightgate.cluster_sessions")

READ_CHUNK = 4096
READ_MAX = 1_000_000  # entries scanned per subscription for its positions (a far-behind reader)
LIVE_WAIT_S = 2.0
TOPICS_WAIT_S = 3.0  # a log topic made elsewhere is known here within a metadata refresh (1 s)  # how long the new queue may backfill before in-flight messages are matched


def portable(state: dict[str, Any], queues: Any, store: Any) -> dict[str, Any]:
    """`state` (this node's sequences) with the log positions another node can map."""
    out = dict(state)
    subs = []
    for d in state.get("subs", ()):
        d = dict(d)
        if not d.get("local") and not d.get("group"):
            d["at"] = _frontier(queues, store, d)
        subs.append(d)
    out["subs"] = subs
    moved = []
    for pid, queue, seq, qos, data, released, fraw in state.get("inflight", ()):
        at = None
        if seq >= 0:
            r = queues.read(queue, seq, 1)
            if r.entries and r.first_seq == seq and r.entries[0] is not None:
                at = list(r.entries[0])
        moved.append([pid, queue, seq, qos, data, released, fraw, at])
    out["inflight"] = moved
    return out


def _frontier(queues: Any, store: Any, d: dict[str, Any]) -> list[list[Any]]:
    first: dict[tuple[str, int], int] = {}
    seq = int(d.get("pos", 0))
    q = d.get("queue") or d["filter"]
    scanned = 0
    while scanned < READ_MAX:
        r = queues.read(q, seq, READ_CHUNK)
        for e in r.entries:
            if e is not None and (e[0], e[1]) not in first:
                first[(e[0], e[1])] = e[2]
        scanned += len(r.entries)
        seq = r.first_seq + len(r.entries)
        if not r.entries or seq >= r.next_seq:
            break
    position = queues.dispatcher.position
    counts = store.topics()
    out = []
    for t in relevant_topics(store, d["filter"]):
        for p in range(counts.get(t, 0)):
            o = first.get((t, p))
            out.append([t, p, o if o is not None else position(t, p)])
    return out


async def localize(state: dict[str, Any], queues: Any) -> tuple[dict[str, Any], list[str]]:
    """A portable state as this node's: (state, the queues acquired for it, one hold each)."""
    await _topics_known(queues.store, state)
    out = dict(state)
    subs = []
    held: list[str] = []
    for d in state.get("subs", ()):
        d = dict(d)
        at = d.pop("at", None)
        if d.get("local"):
            subs.append(d)
            continue
        try:
            if at is not None:
                a = queues.acquire_filter(d["filter"], offsets={(t, p): o for t, p, o in at})
            else:
                a = queues.acquire_filter(d["filter"], d.get("since"))
        except Exception as exc:
            log.warning("session %r: cannot hold %r: %s", state.get("client_id"), d["raw"], exc)
            continue
        held.append(a.queue)
        d["queue"], d["pos"] = a.queue, a.start_seq
        subs.append(d)
    out["subs"] = subs
    by_queue = {d["raw"]: d["queue"] for d in subs if not d.get("local")}
    where: dict[str, dict[tuple[str, int, int], int]] = {}
    inflight = []
    for pid, _queue, _seq, qos, data, released, fraw, at in state.get("inflight", ()):
        queue = by_queue.get(fraw, "")
        seq = -1
        if at is not None and queue:
            if queue not in where:
                where[queue] = await _entries(queues, queue)
            seq = where[queue].get((at[0], at[1], at[2]), -1)
        inflight.append([pid, queue, seq, qos, data, released, fraw])
    out["inflight"] = inflight
    return out, held


async def _topics_known(store: Any, state: dict[str, Any]) -> None:
    """Wait (bounded) until this node knows every log partition the positions name. A replay
    queue made before would miss a topic this node has not seen yet (its metadata is refreshed
    every second): found later, that topic would be indexed into it from its log start."""
    want = {(t, p) for d in state.get("subs", ()) for t, p, _o in d.get("at") or ()}
    deadline = time.monotonic() + TOPICS_WAIT_S
    while True:
        counts = store.topics()
        missing = [tp for tp in want if counts.get(tp[0], 0) <= tp[1]]
        if not missing:
            return
        if time.monotonic() >= deadline:
            log.warning("session %r: log partitions %s still unknown here; moving it anyway",
                        state.get("client_id"), sorted(missing))  # fmt: skip
            return
        await asyncio.sleep(0.02)


async def _entries(queues: Any, queue: str) -> dict[tuple[str, int, int], int]:
    """Log position -> sequence of the first entries of a new replay queue (its in-flight
    messages are among the first of their partitions)."""
    try:
        await asyncio.wait_for(queues.wait_live(queue), LIVE_WAIT_S)
    except TimeoutError:
        log.warning("replay queue %r still backfilling; in-flight messages not matched", queue)
    out: dict[tuple[str, int, int], int] = {}
    r = queues.read(queue, 0, READ_CHUNK)
    for i, e in enumerate(r.entries):
        if e is not None:
            out[(e[0], e[1], e[2])] = r.first_seq + i
    return out
