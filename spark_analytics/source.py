"""The `lightgate` PySpark data source: batch and micro-batch streaming over the commitlog.

Planning (driver) lists partitions and their high watermarks; each `LogRange` (one topic-partition,
one offset range) is one Spark task that reads segment files directly and yields Arrow batches.
Streaming offsets are `{"topic": {"partition": next_offset}}`, like Spark's Kafka source, so a
checkpointed query restarts exactly where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from spark_analytics.arrow_decode import SCHEMA, ChunkBuilder, to_record_batch
from spark_analytics.logdir import (
    Batch,
    LogDirError,
    PartitionTail,
    iter_batches,
    list_topics,
    log_dir,
    offset_for_timestamp,
)
from spark_analytics.mqtt import (
    filter_plan,
    level_for_log_topic,
    topics_for_filter,
    wildcard_first,
)
from spark_analytics.options import (
    EARLIEST,
    LATEST,
    OptionError,
    ReadOptions,
    offset_for,
    parse_options,
)
from store.cluster import offsets_by_time
from store.cluster import reader as cluster_reader
from store.record_batch import (
    BH_ATTRIBUTES,
    BH_BASE_OFFSET,
    BH_FIRST_TIMESTAMP,
    BH_LAST_OFFSET_DELTA,
    BH_MAX_TIMESTAMP,
    BH_RECORD_COUNT,
    HEADER,
)

CHUNK_RECORDS = 131_072  # records per Arrow batch handed to the JVM
CHUNK_BYTES = 16 << 20
INTERNAL_PREFIX = "__"  # system topics (e.g. __lightgate_device_events) are read only by name


class LogRange(InputPartition):
    """One task: offsets [start, end) of one topic-partition, plus a seek hint."""

    def __init__(
        self, topic: str, partition: int, start: int, end: int, hint: tuple[int, int] | None,
        aborted: tuple[tuple[int, int, int], ...] = (),
    ) -> None:  # fmt: skip
        super().__init__((topic, partition, start, end))
        self.aborted = aborted  # Kafka transactions aborted in the range: records skipped
        self.topic = topic
        self.partition = partition
        self.start = start
        self.end = end
        self.hint = hint

    def __repr__(self) -> str:
        return f"LogRange({self.topic}-{self.partition} [{self.start}, {self.end}))"


def _select_topics(log: Path, opts: ReadOptions, strict: bool) -> list[tuple[str, int]]:
    """(topic, partition count) to read: `topics`, else all but system topics; MQTT-pruned."""
    known = list_topics(log)
    if opts.topics is not None:
        missing = [t for t in opts.topics if t not in known]
        if missing and strict:
            raise LogDirError(
                f"topic(s) {missing} not found in {log.parent}; known: {sorted(known)}"
            )
        names = [t for t in opts.topics if t in known]
    else:
        names = sorted(t for t in known if not t.startswith(INTERNAL_PREFIX))
    if opts.mqtt_filter is not None:
        names = topics_for_filter(opts.mqtt_filter, names)
    return [(t, known[t]) for t in names]


def cluster_ranges(opts: ReadOptions) -> dict[tuple[str, int], tuple[int, int]]:
    """(topic, partition) -> (log start, high watermark) on the cluster, MQTT-pruned."""
    assert opts.bootstrap is not None and opts.topics is not None
    names = list(opts.topics)
    if opts.mqtt_filter is not None:
        names = topics_for_filter(opts.mqtt_filter, names)
    return cluster_reader.partition_spans(opts.bootstrap, names)


def _cluster_times(
    opts: ReadOptions, spans: dict[tuple[str, int], tuple[int, int]]
) -> dict[tuple[str, int], int | None] | None:
    """`startingTimestamp` on the cluster: each partition's first offset at/after it."""
    if opts.starting_timestamp is None or opts.bootstrap is None:
        return None
    return offsets_by_time.offsets_for_time(opts.bootstrap, spans, opts.starting_timestamp)


def _cluster_batches(opts: ReadOptions, r: LogRange) -> Iterator[Batch]:
    assert opts.bootstrap is not None
    for mv in cluster_reader.iter_range(opts.bootstrap, r.topic, r.partition, r.start, r.end):
        h = HEADER.unpack_from(mv, 0)
        yield Batch(
            h[BH_BASE_OFFSET],
            h[BH_BASE_OFFSET] + h[BH_LAST_OFFSET_DELTA],
            h[BH_ATTRIBUTES],
            h[BH_FIRST_TIMESTAMP],
            h[BH_MAX_TIMESTAMP],
            h[BH_RECORD_COUNT],
            -1,
            mv,
        )


def read_range(opts: ReadOptions, r: InputPartition) -> Iterator[pa.RecordBatch]:
    """Executor side: decode one LogRange into Arrow batches of at most ~64k records."""
    if not isinstance(r, LogRange):
        return
    log = Path(opts.data_dir) / "log"
    first_level = level_for_log_topic(r.topic)
    plan = filter_plan(opts.mqtt_filter) if opts.mqtt_filter else None
    skip_dollar = bool(opts.mqtt_filter) and wildcard_first(opts.mqtt_filter or "")
    chunk = ChunkBuilder(r.aborted)

    def emit() -> pa.RecordBatch | None:
        dec = chunk.decode(r.topic, r.partition, first_level)
        if dec is None:
            return None
        rb = to_record_batch(dec, r.start, r.end, plan, skip_dollar)
        return rb if rb.num_rows else None

    if opts.bootstrap:
        batches = _cluster_batches(opts, r)
    else:
        batches = iter_batches(log, r.topic, r.partition, r.start, r.end, r.hint)
    for batch in batches:
        chunk.add(batch)
        if chunk.records >= CHUNK_RECORDS or len(chunk.buf) >= CHUNK_BYTES:
            rb = emit()
            if rb is not None:
                yield rb
            chunk = ChunkBuilder(r.aborted)
    rb = emit()
    if rb is not None:
        yield rb


class LightgateBatchReader(DataSourceReader):
    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts

    def partitions(self) -> list[InputPartition]:
        opts = self.opts
        ranges: list[tuple[str, int, int, int]] = []
        tails: dict[tuple[str, int], PartitionTail] = {}
        if opts.bootstrap:
            spans = cluster_ranges(opts)
            at_time = _cluster_times(opts, spans)
            for (topic, p), (lo, hwm) in sorted(spans.items()):
                if at_time is not None:
                    found = at_time.get((topic, p))
                    start = hwm if found is None else found
                else:
                    start = offset_for(opts.starting, topic, p, EARLIEST)
                start = max(lo, {EARLIEST: lo, LATEST: hwm}.get(start, start))
                end = offset_for(opts.ending, topic, p, LATEST)
                end = hwm if end == LATEST else min(end, hwm)
                if start < end:
                    ranges.append((topic, p, start, end))
            return _split(ranges, opts, {})
        log = log_dir(opts.data_dir)
        for topic, count in _select_topics(log, opts, strict=True):
            for p in range(count):
                tail = tails[(topic, p)] = PartitionTail(log, topic, p)
                tail.advance()
                hwm = tail.stable()  # open Kafka transactions: not yet
                lo = tail.start_offset
                if opts.starting_timestamp is not None:
                    found = offset_for_timestamp(log, topic, p, opts.starting_timestamp)
                    start = hwm if found is None else found
                else:
                    start = offset_for(opts.starting, topic, p, EARLIEST)
                    start = {EARLIEST: lo, LATEST: hwm}.get(start, start)
                end = offset_for(opts.ending, topic, p, LATEST)
                end = hwm if end == LATEST else min(end, hwm)
                start = max(start, lo)
                if start < end:
                    ranges.append((topic, p, start, end))
        return _split(ranges, opts, tails)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)


def _split(ranges: list[tuple[str, int, int, int]], opts: ReadOptions,
           tails: dict[tuple[str, int], PartitionTail]) -> list[InputPartition]:  # fmt: skip
    """One task per `maxRecordsPerPartition` offsets (fewer with `minPartitions`)."""
    total = sum(e - s for _, _, s, e in ranges)
    step = opts.max_records_per_partition
    if opts.min_partitions and total:
        step = min(step, max(1, math.ceil(total / opts.min_partitions)))
    out: list[InputPartition] = []
    for topic, p, start, end in ranges:
        tail = tails.get((topic, p))
        for lo in range(start, end, step):
            hi = min(end, lo + step)
            out.append(LogRange(topic, p, lo, hi, None, tail.aborted(lo, hi) if tail else ()))
    return out


Offsets = dict[str, dict[str, int]]


class LightgateStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batch reader; keeps one `PartitionTail` per partition so a trigger costs O(new data)."""

    def __init__(self, opts: ReadOptions) -> None:
        self.opts = opts
        root = Path(opts.data_dir)
        if not opts.bootstrap and not root.is_dir():
            raise LogDirError(f"data dir {root} does not exist")
        self.log = root / "log"
        self.tails: dict[tuple[str, int], PartitionTail] = {}
        self.starts: dict[tuple[str, int], int] = {}  # log start per partition (cluster)
        self.target: Offsets | None = None
        self.last_latest: Offsets | None = None

    def _refresh(self) -> Offsets:
        latest: Offsets = {}
        if self.opts.bootstrap:
            for (topic, p), (lo, hwm) in cluster_ranges(self.opts).items():
                self.starts[(topic, p)] = lo
                latest.setdefault(topic, {})[str(p)] = hwm
            self.last_latest = latest
            return latest
        if not self.log.is_dir():
            return latest
        for topic, count in _select_topics(self.log, self.opts, strict=False):
            for p in range(count):
                tail = self.tails.get((topic, p))
                if tail is None:
                    tail = self.tails[(topic, p)] = PartitionTail(self.log, topic, p)
                tail.advance()
                latest.setdefault(topic, {})[str(p)] = tail.stable()
        self.last_latest = latest
        return latest

    def _earliest(self, topic: str, p: str) -> int:
        tail = self.tails.get((topic, int(p)))
        return tail.start_offset if tail else self.starts.get((topic, int(p)), 0)

    def initialOffset(self) -> dict:
        opts = self.opts
        latest = self._refresh()
        out: Offsets = {}
        spans = {
            (t, int(p)): (self._earliest(t, p), h)
            for t, ps in latest.items()
            for p, h in ps.items()
        }
        at_time = _cluster_times(opts, spans)
        for topic, parts in latest.items():
            for p, hwm in parts.items():
                lo = self._earliest(topic, p)
                if at_time is not None:
                    found = at_time.get((topic, int(p)))
                    start = hwm if found is None else found
                elif opts.starting_timestamp is not None:
                    found = offset_for_timestamp(self.log, topic, int(p), opts.starting_timestamp)
                    start = hwm if found is None else found
                else:
                    start = offset_for(opts.starting, topic, int(p), LATEST)
                    start = {EARLIEST: lo, LATEST: hwm}.get(start, start)
                out.setdefault(topic, {})[p] = max(lo, min(start, hwm))
        return out

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self._refresh()

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.opts.max_records_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def reportLatestOffset(self) -> dict | None:
        return self.last_latest

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        latest = self._refresh()
        if self.target is not None:
            latest = {
                t: {p: min(o, self.target.get(t, {}).get(p, 0)) for p, o in parts.items()}
                for t, parts in latest.items()
            }
        begin: Offsets = {}
        for t, parts in latest.items():
            for p in parts:
                b = start.get(t, {}).get(p)
                begin.setdefault(t, {})[p] = self._earliest(t, p) if b is None else b
        end = {t: {p: max(o, begin[t][p]) for p, o in parts.items()} for t, parts in latest.items()}
        for t, parts in start.items():  # partitions we no longer see keep their position
            for p, o in parts.items():
                end.setdefault(t, {}).setdefault(p, o)
        if isinstance(limit, ReadMaxRows):
            end = _prorate(begin, end, limit.max_rows)
        return end

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        out: list[InputPartition] = []
        for t, parts in end.items():
            for p, e in parts.items():
                s = start.get(t, {}).get(p)
                if s is None:
                    s = self._earliest(t, p)
                if s < e:
                    tail = self.tails.get((t, int(p)))
                    hint = tail.hint_for(s) if tail is not None else None
                    aborted = tail.aborted(s, e) if tail is not None else ()
                    out.append(LogRange(t, int(p), s, e, hint, aborted))
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(self.opts, partition)

    def commit(self, end: dict) -> None:
        """Nothing to release: the log is retained by the gateway's own policy."""


def _prorate(begin: Offsets, end: Offsets, max_rows: int) -> Offsets:
    """Split a record budget over partitions in proportion to their lag (Kafka source's rule)."""
    lags = [
        (t, p, end[t][p] - begin.get(t, {}).get(p, end[t][p]))
        for t in end
        for p in end[t]
        if p in begin.get(t, {})
    ]
    total = sum(lag for *_, lag in lags)
    if total <= max_rows:
        return end
    out = {t: dict(parts) for t, parts in end.items()}
    grant = {(t, p): (lag * max_rows) // total for t, p, lag in lags}
    left = max_rows - sum(grant.values())
    for t, p, lag in sorted(lags, key=lambda x: -x[2]):  # rounding leftovers to the largest lags
        if left <= 0:
            break
        if grant[(t, p)] < lag:
            grant[(t, p)] += 1
            left -= 1
    for t, p, _ in lags:
        out[t][p] = begin[t][p] + grant[(t, p)]
    return out


class LightgateDataSource(DataSource):
    """`spark.read.format("lightgate").load(DATA_DIR)`; options: docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "lightgate"

    def schema(self) -> StructType:
        return SCHEMA

    def _check(self, schema: StructType) -> None:
        if schema != SCHEMA:
            raise OptionError(f"the lightgate source has a fixed schema: {SCHEMA.simpleString()}")

    def reader(self, schema: StructType) -> DataSourceReader:
        self._check(schema)
        return LightgateBatchReader(parse_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        self._check(schema)
        return LightgateStreamReader(parse_options(self.options, streaming=True))
