"""Entries → messages through the store: batched reads, a cache of decoded records.

Entries of one read usually sit close together in few partitions, so they are grouped by
partition, sorted, and each run of nearby offsets is fetched with one `Store.read` sized to the
run (estimated from the partition's observed record size). Every record of the fetched batches is
kept (oldest decoded evicted first) as the tuple `lightqueue._cresolve.decode_records` makes of it
(compiled: one pass over the batch, the two headers of a plain PUBLISH read in place, no header
list; its pure-Python twin `_decode_records_py` goes through aiokafka's reader); the MQTT view
(topic, headers → properties) is built only for records someone asks for, then cached in its
place, so a message read through its topic queue and a filter queue is decoded once. A read none
of whose ends is cached (a reader far behind) skips the cache: `Resolver._resolve_cold`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightqueue.dispatch_rules import mqtt_topic_of
from lightqueue.model import Position, StoredMessage
from store import OffsetOutOfRangeError, UnknownTopicOrPartitionError
from store.backend import FetchPending, LogBackend
from store.mapping import H_CLIENT_ID, H_QOS, mqtt_view
from store.record_batch import (
    BH_ATTRIBUTES,
    BH_BASE_OFFSET,
    BH_LAST_OFFSET_DELTA,
    BH_MAX_TIMESTAMP,
    COMPRESSION_MASK,
    HEADER,
    TIMESTAMP_TYPE_MASK,
    BatchWalk,
    iter_batches,
    iter_records,
)
from store.twins import twin

try:  # see dispatcher.py: the Cython reader, without the per-record NamedTuple re-wrap
    from aiokafka.record._crecords import DefaultRecordBatch as _CReader
except ImportError:  # pragma: no cover
    _CReader = None

_QOS = {b"0": 0, b"1": 1, b"2": 2}

_MIN_READ = 4 << 10
_MAX_READ = 1 << 20
_NO_END = (1 << 63) - 1


class Resolver:
    """Event-loop-only; `Store.read` is synchronous page-cache I/O."""

    def __init__(self, store: LogBackend, cache_records: int = 100_000) -> None:
        self.store = store
        # Decoded records by (log topic, partition, offset), oldest first: evicted in the order
        # they were decoded (a reader behind reads forward, so what it decoded last is hot).
        self._cache: dict[tuple[str, int, int], Any] = {}
        # Its keys in the order they were decoded: eviction pops from here. Iterating the dict
        # from its front instead skipped the holes deletions leave there until the next resize
        # (measured: 316 ns per evicted key for the `islice` alone at 100,000 records).
        self._order: deque[tuple[str, int, int]] = deque()
        self._max = cache_records
        self._avg: dict[tuple[str, int], float] = {}
        self._topics: dict[tuple[str, bytes | None], str] = {}
        self.reads = 0  # Store.read calls (tests check batching)

    def forget(self, topic: str) -> None:
        """A deleted log topic: its cached records must not answer for a new topic's offsets."""
        for k in [k for k in self._cache if k[0] == topic]:
            del self._cache[k]
        self._order = deque(k for k in self._order if k[0] != topic)
        for tp in [tp for tp in self._avg if tp[0] == topic]:
            del self._avg[tp]

    def uncached(self, entries: Sequence[Position | None]) -> list[Position]:
        """Entries whose records are not decoded here yet (what a cluster log must fetch)."""
        cache = self._cache
        return [e for e in entries if e is not None and (e[0], e[1], e[2]) not in cache]

    def resolve(self, entries: Sequence[Position | None]) -> list[StoredMessage | None]:
        """One message per entry (None: void entry, or its record is gone from the log)."""
        cache = self._cache
        if type(entries) is not list:
            entries = list(entries)
        if _cold(entries, cache):
            return self._resolve_cold(entries)
        out, missing = _resolve_cached(entries, cache, self._topics, StoredMessage, self._message)
        if missing:
            for (t, p), offs in missing.items():
                self._fetch(t, p, sorted(set(offs)))
            out, _ = _resolve_cached(entries, cache, self._topics, StoredMessage, self._message)
        if len(cache) > self._max:  # evict only once the answer is built (oldest decoded first)
            _evict(cache, self._order, self._max)
        return out

    def _resolve_cold(self, entries: list[Position | None]) -> list[StoredMessage | None]:
        """A read none of whose ends is decoded here (a reader far behind): each partition's
        offsets read and decoded straight into messages, nothing cached. A lagging QoS 1 reader
        of a fan-in read this way costs ~7 % of the loop less than through the cache (lookups,
        caching and evicting records read once)."""
        recs = {tp: self._read_records(tp[0], tp[1], offs)
                for tp, offs in _group_offsets(entries).items()}  # fmt: skip
        return _resolve_records(entries, recs, self._topics, StoredMessage, self._message)

    def _read_records(self, t: str, p: int, offs: list[int]) -> list[RecordTuple]:
        """The records holding `offs` (ascending after sorting), in offset order."""
        offs.sort()
        out: list[RecordTuple] = []
        i, n = 0, len(offs)
        while i < n:
            o = offs[i]
            data = self._read_run(t, p, offs, i, 256)
            # From `o` on: every offset before it is in `out` already, or gone.
            recs = _records_of(data, o, offs[-1]) if data else []
            if not recs:
                i += 1  # `o` is gone (retention, lost tail): resolves to None
                continue
            self._avg[(t, p)] = max(16.0, len(data) / _span(data))
            out.extend(recs)
            i = bisect_right(offs, recs[-1][0], i)
        return out

    def clear(self) -> None:
        """Forget every decoded record (benchmarks: a cold read)."""
        self._cache.clear()
        self._order.clear()

    def _message(self, t: str, p: int, r: RecordTuple) -> StoredMessage:
        """The MQTT view of a record. Fast path for the two headers every plain MQTT PUBLISH
        carries (qos, client id; found by the decoder): the same result as `mqtt_view` (a test
        checks), with the topic mapping cached per key; measured 1.1 us vs 4.6 us per message."""
        off, key, value, ts, qos, cid, hs = r
        if hs is None:
            k = (t, key)
            topic = self._topics.get(k)
            if topic is None:
                if len(self._topics) > 100_000:
                    self._topics.clear()
                topic = self._topics[k] = mqtt_topic_of(t, key)
            return StoredMessage(topic, value or b"", qos, cid.decode("utf-8", "replace"),  # type: ignore[union-attr]
                                 False, None, ts, t, p, off)  # fmt: skip
        view = mqtt_view(t, key, hs)
        return StoredMessage(view.topic, value or b"", view.qos, view.client_id, view.retain,
                             view.properties, ts, t, p, off)  # fmt: skip

    def _fetch(self, t: str, p: int, offs: list[int]) -> None:
        cache = self._cache
        i, n = 0, len(offs)
        while i < n:
            if (t, p, offs[i]) in cache:  # decoded by an earlier fetch of this call
                i += 1
                continue
            data = self._read_run(t, p, offs, i, 64)
            got = self._decode(t, p, data) if data else 0
            if got:
                self._avg[(t, p)] = max(16.0, len(data) / got)
            i += 1  # `offs[i]` is now cached, or gone (retention, lost tail): resolves to None

    def _read_run(self, t: str, p: int, offs: list[int], i: int, ahead: int) -> bytes:
        """One `Store.read` from offs[i], sized to the run of wanted offsets after it (up to
        `ahead` of them, within _MAX_READ) from the partition's observed record size."""
        avg = self._avg.get((t, p), 200.0)
        o = offs[i]
        j = min(i + ahead - 1, len(offs) - 1)
        while j > i and (offs[j] - o) * avg > _MAX_READ:
            j = (i + j) // 2
        want = int(min(_MAX_READ, max(_MIN_READ, (offs[j] - o + 1) * avg * 1.2)))
        self.reads += 1
        try:
            return self.store.read(t, p, o, want)
        except (OffsetOutOfRangeError, UnknownTopicOrPartitionError, FetchPending):
            return b""  # FetchPending: a caller that did not `prefetch` (cluster log)

    def _decode(self, t: str, p: int, data: bytes) -> int:
        return _cache_records(_records_of(data), self._cache, self._order, t, p)


def _cold(entries: list[Position | None], cache: dict[tuple[str, int, int], Any]) -> bool:
    """Neither end of the read is decoded here: `Resolver._resolve_cold` serves it."""
    first = last = None
    for first in entries:
        if first is not None:
            break
    for last in reversed(entries):
        if last is not None:
            break
    return first is not None and first not in cache and last not in cache


def _records_of(data: bytes, lo: int = -1, hi: int = _NO_END) -> list[RecordTuple]:
    """The records of the batches in `data` with offsets in [lo, hi], in offset order (control
    batches skipped)."""
    out: list[RecordTuple] = []
    for h, pos, size in BatchWalk(data, lo, hi + 1, skip_control=True):
        attrs = h[BH_ATTRIBUTES]
        lat = h[BH_MAX_TIMESTAMP] if attrs & TIMESTAMP_TYPE_MASK else -1  # LogAppendTime
        if attrs & COMPRESSION_MASK:
            out += _decode_records_py(data, pos, size, lat, lo, hi)
        else:
            out += _decode_records(data, pos, size, lat, lo, hi)
    return out


def _span(data: bytes) -> int:
    """Offsets the batches in `data` cover (records, but for gaps compaction left)."""
    first = last = -1
    for pos, _ in iter_batches(data):
        h = HEADER.unpack_from(data, pos)
        if first < 0:
            first = h[BH_BASE_OFFSET]
        last = h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA]
    return max(1, last - first + 1)


# (offset, key, value, timestamp, qos, client id, headers): see lightqueue._cresolve.decode_records
RecordTuple = tuple[int, bytes | None, bytes | None, int, int, bytes | None, list[Any] | None]


def _decode_records_py(
    data: Any, pos: int, size: int, lat: int, lo: int = -1, hi: int = _NO_END
) -> list[RecordTuple]:
    """The records of the batch at `data[pos:pos+size]` (any compression) with offsets in
    [lo, hi], as the compiled `lightqueue._cresolve.decode_records` returns them for an uncompressed
    one."""
    if not HEADER.unpack_from(data, pos)[5] & COMPRESSION_MASK and _CReader is not None:
        recs: Any = _CReader(bytes(data[pos : pos + size]))
    else:
        recs = iter_records(memoryview(data)[pos : pos + size])
    out: list[RecordTuple] = []
    for r in recs:
        if r.offset < lo:
            continue
        if r.offset > hi:
            break
        hs = r.headers
        ts = lat if lat >= 0 else r.timestamp
        if len(hs) == 2 and hs[0][0] == H_QOS and hs[1][0] == H_CLIENT_ID:
            qos = _QOS.get(hs[0][1])
            cid = hs[1][1]
            if qos is not None and cid is not None:
                out.append((r.offset, r.key, r.value, ts, qos, cid, None))
                continue
        out.append((r.offset, r.key, r.value, ts, -1, None, [(k, v) for k, v in hs]))
    return out


_decode_records = twin(
    _decode_records_py,
    "lightqueue._cresolve",
    "decode_records",
    what="a batch's records, a plain PUBLISH's headers read in place",
)


def resolve_cached_py(
    entries: list[Position | None],
    cache: dict[tuple[str, int, int], Any],
    topics: dict[tuple[str, bytes | None], str],
    cls: type[StoredMessage],
    message: Callable[[str, int, RecordTuple], StoredMessage],
) -> tuple[list[Any], dict[tuple[str, int], list[int]]]:
    """(messages aligned with `entries`, {(log topic, partition): [offsets not in `cache`]});
    a cached record tuple is replaced in `cache` by its message. The pure twin of
    `lightqueue._cresolve.resolve_cached` (which builds a plain PUBLISH's message itself when
    `topics` knows its topic; `topics` and `cls` are for it)."""
    out: list[Any] = [None] * len(entries)
    missing: dict[tuple[str, int], list[int]] = {}
    tp: tuple[str, int] | None = None  # the partition of the run being grouped
    g: list[int] = []
    get = cache.get
    for i, e in enumerate(entries):
        if e is None:
            continue
        v = get(e)
        if v is None:
            if tp is None or e[0] != tp[0] or e[1] != tp[1]:
                tp = (e[0], e[1])  # a new partition, usually once per read
                g = missing.setdefault(tp, [])
            g.append(e[2])
            continue
        if type(v) is tuple:
            v = cache[e] = message(e[0], e[1], v)
        out[i] = v
    return out, missing


def cache_records_py(
    recs: list[RecordTuple],
    cache: dict[tuple[str, int, int], Any],
    order: deque[tuple[str, int, int]],
    t: str,
    p: int,
) -> int:
    """Each record of `recs` into `cache` under (t, p, offset) unless already there, its key
    appended to `order`. The pure twin of `lightqueue._cresolve.cache_records`."""
    for r in recs:
        k = (t, p, r[0])
        if k not in cache:
            cache[k] = r
            order.append(k)
    return len(recs)


def evict_py(
    cache: dict[tuple[str, int, int], Any], order: deque[tuple[str, int, int]], keep: int
) -> None:
    """Drop the oldest keys of `order` from `cache` until it holds at most `keep` (a key of
    `order` no longer in `cache` is skipped). The pure twin of `lightqueue._cresolve.evict`."""
    pop = cache.pop
    popleft = order.popleft
    while len(cache) > keep and order:
        pop(popleft(), None)


def group_offsets_py(entries: list[Position | None]) -> dict[tuple[str, int], list[int]]:
    """{(log topic, partition): [offsets]} of the entries, in entry order. The pure twin of
    `lightqueue._cresolve.group_offsets`."""
    groups: dict[tuple[str, int], list[int]] = {}
    for e in entries:
        if e is not None:
            groups.setdefault((e[0], e[1]), []).append(e[2])
    return groups


def resolve_records_py(
    entries: list[Position | None],
    recs: dict[tuple[str, int], list[RecordTuple]],
    topics: dict[tuple[str, bytes | None], str],
    cls: type[StoredMessage],
    message: Callable[[str, int, RecordTuple], StoredMessage],
) -> list[Any]:
    """Messages aligned with `entries`, each from the record at its offset in `recs`; None
    where there is none. The pure twin of `lightqueue._cresolve.resolve_records`."""
    by_off = {(tp[0], tp[1], r[0]): r for tp, rs in recs.items() for r in rs}
    out: list[Any] = [None] * len(entries)
    for i, e in enumerate(entries):
        if e is not None:
            r = by_off.get(e)
            if r is not None:
                out[i] = message(e[0], e[1], r)
    return out


_resolve_cached = twin(
    resolve_cached_py,
    "lightqueue._cresolve",
    "resolve_cached",
    what="entries -> messages from the decoded-record cache, a plain PUBLISH's `StoredMessage` filled in place",
)
_cache_records = twin(
    cache_records_py,
    "lightqueue._cresolve",
    "cache_records",
    what="a decoded batch's records into that cache",
)
_evict = twin(
    evict_py, "lightqueue._cresolve", "evict", what="the decoded-record cache held to its size"
)
_group_offsets = twin(
    group_offsets_py,
    "lightqueue._cresolve",
    "group_offsets",
    what="a cold read: the offsets to read per partition",
)
_resolve_records = twin(
    resolve_records_py,
    "lightqueue._cresolve",
    "resolve_records",
    what="a cold read: entries -> messages straight from the records read, by a cursor per partition",
)
