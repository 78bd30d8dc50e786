"""Offsets by time on the Kafka cluster (KafkaLog's `offset_for_timestamp`, `prefetch_times`).

`$replay/<since_ms>/...` needs the first offset at or after a time in every relevant partition,
synchronously (the replay queue's start vector is fixed when it is created). The cluster's
answer is asynchronous, so `LightQueues.prepare_acquire` awaits `prefetch_times` first and the
answers wait here. ListOffsets by time gives where to start; the batches' timestamps from there
give the answer, because Tansu answers every timestamp with offset 0 (docs/deployment.md): on
Kafka that costs one fetch, on Tansu a scan from the log start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from store.cluster.reader import (
    EMPTY_RETRIES,
    FETCH_BYTES,
    READER_WAIT_MS,
    by_leader,
    connect,
    fetch_raw,
    list_offsets,
)
from store.config import StoreError
from store.record_batch import (
    BH_ATTRIBUTES,
    BH_BASE_OFFSET,
    BH_LAST_OFFSET_DELTA,
    BH_MAX_TIMESTAMP,
    HEADER,
    TIMESTAMP_TYPE_MASK,
    iter_batches,
    iter_records,
)


def first_at_time(data: bytes, o: int, ts: int) -> tuple[int | None, int]:
    """In fetched batches: (the first offset >= o whose timestamp >= ts, or None; the offset
    to fetch next). Whole batches are skipped by their max timestamp."""
    for pos, size in iter_batches(data):
        h = HEADER.unpack_from(data, pos)
        base, last, max_ts = (
            h[BH_BASE_OFFSET],
            h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA],
            h[BH_MAX_TIMESTAMP],
        )
        if last < o:
            continue
        if max_ts >= ts:
            if (
                h[BH_ATTRIBUTES] & TIMESTAMP_TYPE_MASK
            ):  # LogAppendTime: one time for the whole batch
                return max(base, o), last + 1
            for r in iter_records(memoryview(data)[pos : pos + size]):
                if r.offset >= o and r.timestamp >= ts:
                    return int(r.offset), last + 1
        o = last + 1
    return None, o


def offsets_for_time(bootstrap: str, spans: dict[tuple[str, int], tuple[int, int]], ts: int,
                     kwargs: dict[str, Any] | None = None) -> dict[tuple[str, int], int | None]:  # fmt: skip
    """For readers outside the gateway (Spark's `startingTimestamp`): per partition with its
    [log start, end) span, the first offset below end whose timestamp >= ts (None: none).
    ListOffsets by time says where to start, the batches' timestamps give the answer."""

    async def run() -> dict[tuple[str, int], int | None]:
        client = await connect(bootstrap, kwargs)
        try:
            answers = await list_offsets(client, list(spans), ts)
            out: dict[tuple[str, int], int | None] = {}
            for tp, (lo, end) in spans.items():
                o, empty, found = answers.get(tp, lo), 0, None
                if o < 0:
                    out[tp] = None  # Kafka: every record is older
                    continue
                o = max(o, lo)
                while o < end:
                    data = b""
                    for node in by_leader(client, [tp]):
                        _v, parts = await fetch_raw(
                            client, node, {tp: o}, FETCH_BYTES, READER_WAIT_MS, isolation=1
                        )
                        for _t, part in parts:
                            if part[0] == tp[1] and not part[1]:
                                data = part[-1] or b""
                    found, nxt = first_at_time(data, o, ts)
                    if found is not None:
                        break
                    empty = 0 if nxt > o else empty + 1
                    if empty > EMPTY_RETRIES:
                        raise StoreError(f"{tp[0]}-{tp[1]}: no records at offset {o}")
                    o = nxt
                out[tp] = found if found is not None and found < end else None
            return out
        finally:
            await client.close()

    return asyncio.run(run())


class OffsetsByTime:
    """KafkaLog's offsets by time (theory: the module docstring). It keeps the answers; it
    shares the log's high watermarks and log starts (dicts the log mutates in place) and asks
    the log for its last stable offset, ListOffsets and single-partition fetches."""

    def __init__(
        self,
        hwm: dict[tuple[str, int], int],
        start: dict[tuple[str, int], int],
        last_stable_offset: Callable[[str, int], int],
        list_offsets: Callable[[list[tuple[str, int]], int], Awaitable[dict[tuple[str, int], int]]],
        fetch_one: Callable[[tuple[str, int], int, bool], Awaitable[bytes]],
    ) -> None:
        self._hwm = hwm
        self._start = start
        self._last_stable_offset = last_stable_offset
        self._list_offsets = list_offsets
        self._fetch_one = fetch_one
        self._times: dict[tuple[str, int, int], int | None] = {}  # prefetch_times' answers

    def offset_for_timestamp(self, tp: tuple[str, int], ts_ms: int) -> int | None:
        """The cluster's answer as `prefetch_times` found it; without one (a caller that did
        not ask first), the log start (None for a time in the future). `tp` is known."""
        key = (tp[0], tp[1], ts_ms)
        if key in self._times:
            return self._times[key]
        return None if ts_ms > int(time.time() * 1000) else self._start[tp]

    async def prefetch_times(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Find the first offset at/after each (topic, partition, ts_ms) on the cluster, for
        `offset_for_timestamp`: ListOffsets by time, then the batches' timestamps from there
        (Tansu answers every timestamp with offset 0, so the answer is only where to start)."""
        if len(self._times) > 10_000:
            self._times.clear()
        todo: dict[int, list[tuple[str, int]]] = {}
        for t, p, ts in wants:
            if (t, p) in self._hwm and (t, p, ts) not in self._times:
                todo.setdefault(ts, []).append((t, p))
        for ts, tps in todo.items():
            answers = await self._list_offsets(tps, ts)
            found = await asyncio.gather(
                *(self._scan_time(tp, answers.get(tp, self._start[tp]), ts) for tp in tps)
            )
            for tp, o in zip(tps, found, strict=True):
                self._times[(tp[0], tp[1], ts)] = o

    async def _scan_time(self, tp: tuple[str, int], o: int, ts: int) -> int | None:
        """The first offset >= o whose timestamp >= ts (None: every record is older)."""
        if o < 0:
            return None  # Kafka: every record is older
        o, empty = max(o, self._start[tp]), 0
        while o < self._last_stable_offset(*tp):  # read_committed: nothing above it
            found, nxt = first_at_time(await self._fetch_one(tp, o, False), o, ts)
            if found is not None:
                return found
            empty = 0 if nxt > o else empty + 1  # none: a slow broker's empty answer
            if empty > EMPTY_RETRIES:
                raise StoreError(f"{tp[0]}-{tp[1]}: no records at offset {o}")
            o = nxt
        return None
