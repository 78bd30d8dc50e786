"""Store: log topics and partitions over one data dir; topics, routing, lock, retention.
(What opening and closing do to the files, recovery and the final seal, is store/recovery.py.)

Appends assign offsets at once and stage bytes on the partition's `Log`; `store.commit` writes
them once per tick and runs the fsync pipeline (theory of operation there). Offsets: readable
offsets lie in [log_start_offset, high_watermark); the high watermark moves when bytes are written
to the file, `AppendResult.durable` resolves when they are durable under the topic's fsync policy.

Every public method is event-loop-only (no locks inside), except `open` and `close`, which are
coroutines. Other processes read the segments with `store.segment_reader` without the lock.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from store.append_result import AppendResult, Run
from store.commit import GroupCommit
from store.config import (
    MAX_PARTITIONS,
    StoreConfig,
    StoreError,
    StoreLockedError,
    TopicConfig,
    UnknownTopicOrPartitionError,
)
from store.data_dir_lock import release_data_dir_lock, take_data_dir_lock
from store.durable_files import (
    RECOVERY_POINT_FILE,
    delete_segment_files,
    fsync_dir,
    seal_segment,
    write_text_atomic,
)
from store.latency import LatencyHistogram
from store.log import Log, OffsetOutOfRangeError
from store.mapping import (
    MqttMessage,
    is_valid_log_topic,
    log_topic_for,
    partition_for_key,
)
from store.mqtt_batches import build_mqtt_batches
from store.record_batch import CONTROL_MASK, TRANSACTIONAL_MASK, split_batches
from store.recovery import TOPICS_FILE, opened, recover, seal_all
from store.topic_admin import TopicAdmin, TopicListener, log_failure
from store.txn_index import TxnIndex

log = logging.getLogger("lightgate.store")

TXN_BITS = TRANSACTIONAL_MASK | CONTROL_MASK


class Store:
    remote_reads = False  # store.backend.LogBackend: every read answers from the files

    def __init__(self, data_dir: Path, config: StoreConfig) -> None:
        self.data_dir = Path(data_dir)
        self.log_dir = self.data_dir / "log"
        self.config = config
        self._lock_fd = -1
        self._topics: dict[str, dict[str, Any]] = {}
        self._counts: dict[str, int] = {}
        self._tconf: dict[str, TopicConfig] = {}
        self._logs: dict[tuple[str, int], Log] = {}
        self._routes: dict[str, tuple[str, int, bytes, Log]] = {}
        self.txn_index = TxnIndex(self.log_dir)  # first listener: the LSO moves with the hwm
        self._listeners: list[Callable[[str, int, int], None]] = [self.txn_index.advance]
        self._commit = GroupCommit(
            lambda lg: self._tconf[lg.topic].fsync, self._seal, self._listeners
        )
        self._timers: list[asyncio.TimerHandle] = []
        self._bg = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store-seal")
        self.admin = TopicAdmin(
            config, self.log_dir, topics=self._topics, counts=self._counts, tconf=self._tconf,
            logs=self._logs, routes=self._routes, commit=self._commit, txn_index=self.txn_index,
            bg=self._bg, register=self._register, save_topics=self._save_topics, lookup=self._log,
        )  # fmt: skip
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------

    @classmethod
    async def open(cls, data_dir: Path, config: StoreConfig | None = None) -> Store:
        """Take DATA/LOCK, recover every partition (in a thread), remove the clean-shutdown marker."""
        self = cls(Path(data_dir), config or StoreConfig())
        self._loop = asyncio.get_running_loop()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        try:
            await asyncio.to_thread(self._recover_all)
        except BaseException:
            self._release_lock()
            raise
        self._schedule_timers()
        return self

    def _take_lock(self) -> None:
        self._lock_fd = take_data_dir_lock(self.data_dir)

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            release_data_dir_lock(self._lock_fd)
            self._lock_fd = -1

    def _recover_all(self) -> None:
        recover(self.log_dir, self._register, self._counts, self._logs)
        self.txn_index.recover(self._counts, self.high_watermark, self.log_start_offset, self.read)
        self.txn_index.write_snapshot(self.txn_index.export(self.log_start_offset))
        opened(self.log_dir)

    async def close(self) -> None:
        """Write what is staged, wait for fsyncs, seal indexes, write the clean-shutdown marker."""
        if self._closed:
            return
        self._closed = True
        for t in self._timers:
            t.cancel()
        await self._commit.drain()
        doc = self.txn_index.export(self.log_start_offset)
        await asyncio.to_thread(self.txn_index.write_snapshot, doc)
        await asyncio.to_thread(self._final_sync)
        self._commit.shutdown()
        self._release_lock()

    def _final_sync(self) -> None:
        self._bg.shutdown(wait=True)
        seal_all(self.log_dir, list(self._logs.values()))

    # --- topics ---------------------------------------------------------------------------------

    def _register(
        self, name: str, partitions: int, overrides: dict[str, Any], topic_id: str | None = None
    ) -> None:
        entry: dict[str, Any] = {"partitions": partitions, "config": overrides}
        if topic_id is not None:
            entry["id"] = topic_id
        self._topics[name] = entry
        self._counts[name] = partitions
        tc = TopicConfig.resolve(name, self.config, overrides)
        self._tconf[name] = tc
        for p in range(partitions):
            if (name, p) not in self._logs:
                self._logs[(name, p)] = Log(
                    self.log_dir / f"{name}-{p}", name, p, tc.segment_bytes, tc.segment_ms,
                    self.config.index_interval_bytes,
                )  # fmt: skip

    def topics(self) -> dict[str, int]:
        """Log topic name → partition count."""
        return dict(self._counts)

    def disk_usage(self) -> dict[str, tuple[int, int]]:
        """Log topic → (bytes in its segment files, records: high watermark minus log start),
        summed over partitions. Event-loop-only; reads in-memory sizes, no syscalls."""
        out: dict[str, tuple[int, int]] = {}
        for (name, _p), lg in self._logs.items():
            b, n = out.get(name, (0, 0))
            out[name] = (b + lg.size_bytes(), n + lg.hwm - lg.log_start_offset)
        return out

    @property
    def fsync_latency(self) -> LatencyHistogram:
        """Duration of each partition fsync (group commit), for /metrics."""
        return self._commit.fsync_latency

    def partitions(self, name: str) -> int | None:
        """Partition count of `name`, None if it does not exist."""
        return self._counts.get(name)

    def topic_config(self, name: str) -> TopicConfig:
        return self._tconf[name]

    def ensure_topic(self, name: str, partitions: int | None = None) -> int:
        """Create `name` if missing (default partitions unless given); returns its partition count.

        An existing topic keeps its count: changing it would move MQTT topics between partitions.
        """
        n = self._counts.get(name)
        if n is not None:
            return n
        return self.create_topic(name, partitions)

    def create_topic(
        self, name: str, partitions: int | None = None, config: dict[str, Any] | None = None
    ) -> int:
        """Create a topic with per-topic config overrides (keys of TopicConfig); persisted at once."""
        if name in self._counts:
            raise StoreError(f"topic {name!r} already exists")
        if not is_valid_log_topic(name):
            raise StoreError(f"invalid log topic name {name!r}")
        n = partitions if partitions is not None else self.config.default_partitions
        if not 1 <= n <= MAX_PARTITIONS:
            raise StoreError(f"topic {name!r}: partitions must be 1..{MAX_PARTITIONS}, got {n}")
        overrides = dict(config or {})
        TopicConfig.resolve(name, self.config, overrides)  # validate before anything is created
        self._register(name, n, overrides, uuid.uuid4().hex)
        try:
            for p in range(n):
                self._logs[(name, p)].load(clean=False)
        except OSError as exc:  # out of files or disk: no half-made topic may stay registered
            for p in range(n):
                self._logs.pop((name, p)).close()
            del self._topics[name], self._counts[name], self._tconf[name]
            raise StoreError(f"cannot create topic {name!r}: {exc}") from exc
        self._save_topics()
        fsync_dir(self.log_dir)
        return n

    def _save_topics(self) -> None:
        write_text_atomic(
            self.log_dir / TOPICS_FILE, json.dumps(self._topics, indent=1, sort_keys=True)
        )

    def _log(self, topic: str, partition: int) -> Log:
        lg = self._logs.get((topic, partition))
        if lg is None:
            raise UnknownTopicOrPartitionError(f"unknown topic or partition {topic}-{partition}")
        return lg

    # --- topic admin and read_committed (delegated to TopicAdmin, TxnIndex) -----------------------

    def add_topic_listener(self, cb: TopicListener) -> None:
        """cb(event, topic) after a topic is deleted, grows partitions or changes config."""
        self.admin.add_topic_listener(cb)

    def remove_topic_listener(self, cb: TopicListener) -> None:
        self.admin.remove_topic_listener(cb)

    def topic_uuid(self, name: str) -> uuid.UUID:
        return self.admin.topic_uuid(name)

    def max_timestamp(self, topic: str, partition: int) -> int:
        return self.admin.max_timestamp(topic, partition)

    def partition_size(self, topic: str, partition: int) -> int:
        return self.admin.partition_size(topic, partition)

    def topic_overrides(self, name: str) -> dict[str, Any]:
        return self.admin.topic_overrides(name)

    async def delete_topic(self, name: str) -> None:
        await self.admin.delete_topic(name)

    async def delete_records(self, topic: str, partition: int, offset: int) -> int:
        return await self.admin.delete_records(topic, partition, offset)

    def create_partitions(self, name: str, count: int) -> None:
        self.admin.create_partitions(name, count)

    def alter_topic_config(
        self, name: str, set_: dict[str, Any], delete: list[str] | None = None
    ) -> TopicConfig:
        return self.admin.alter_topic_config(name, set_, delete)

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """First offset of the earliest open Kafka transaction, else the high watermark."""
        lg = self._log(topic, partition)
        return max(self.txn_index.last_stable_offset(topic, partition, lg.hwm), lg.log_start_offset)

    def aborted_transactions(
        self, topic: str, partition: int, start: int, end: int
    ) -> list[tuple[int, int]]:
        """(producer id, first offset) of aborted transactions overlapping [start, end)."""
        return self.txn_index.aborted_in(topic, partition, start, end)

    # --- append ---------------------------------------------------------------------------------

    def _route(self, mqtt_topic: str) -> tuple[str, int, bytes, Log]:
        lt = log_topic_for(mqtt_topic)
        n = self._counts.get(lt)
        if n is None:
            if not self.config.auto_create_topics:
                raise UnknownTopicOrPartitionError(f"log topic {lt!r} does not exist")
            n = self.create_topic(lt)
        key = mqtt_topic.encode()
        p = partition_for_key(key, n)
        r = (lt, p, key, self._logs[(lt, p)])
        if len(self._routes) >= 100_000:
            self._routes.clear()
        self._routes[mqtt_topic] = r
        return r

    def append_mqtt(self, messages: Sequence[MqttMessage], sync: bool = True) -> AppendResult:
        """Store MQTT messages: one batch per partition (cut at ~64 KiB); offsets in input order.

        `sync=False` when no caller will wait for durability (QoS 0 only): no fsync of its own.

        Raises TopicMappingError (a ValueError) for `$`-topics and invalid topics before anything
        is staged, so a call is all or nothing.
        """
        if self._closed:
            raise StoreError("store is closed")
        routes = self._routes

        def route(topic: str) -> tuple[Log, bytes]:
            r = routes.get(topic) or self._route(topic)
            return r[3], r[2]

        batches = build_mqtt_batches(messages, route, int(time.time() * 1000))
        for lg, *_ in batches:
            if lg.failed is not None:
                raise StoreError(f"partition {lg.name} is offline after a failed fsync")
        runs: list[Run] = []
        staged: dict[Log, list[int]] = {}
        for lg, buf, n, max_ts, idxs in batches:
            base = lg.stage(buf, n, max_ts)
            staged[lg] = idxs
            runs.append((lg.topic, lg.partition, base, idxs, len(buf)))
        return AppendResult(runs, len(messages), self._commit.enqueue(staged, sync))

    def write_now(self) -> None:
        """Write what this tick staged now rather than in a later pass of the loop: for the
        tick's last appender (the MQTT proxy, whose one append per tick runs after every read),
        so a message that arrives alone crosses the loop once less."""
        self._commit.flush_now()

    def append_batch(
        self, topic: str, partition: int, batch: bytes, sync: bool = True
    ) -> AppendResult:
        """Append producer bytes (one or more RecordBatch v2): check magic + CRC, assign offsets
        by rewriting only each base offset. Offsets: one entry per record, base first.

        Raises InvalidRecordError (corrupt bytes), UnknownTopicOrPartitionError, StoreError.
        """
        if self._closed:
            raise StoreError("store is closed")
        if len(batch) > self.config.max_batch_bytes:
            raise StoreError(f"batch of {len(batch)} bytes exceeds {self.config.max_batch_bytes}")
        if topic not in self._counts and self.config.auto_create_topics:
            self.ensure_topic(topic)
        lg = self._log(topic, partition)
        if lg.failed is not None:
            raise StoreError(f"partition {lg.name} is offline after a failed fsync")
        headers = split_batches(batch)
        runs: list[Run] = []
        data = batch if type(batch) is bytes else bytes(batch)  # views need immutable bytes
        pos = count = 0
        for h in headers:
            base = lg.stage_view(data, pos, h.size, h.record_count, h.max_timestamp)
            if h.attributes & TXN_BITS:
                self.txn_index.observe(topic, partition, data, pos, base)
            pos += h.size
            runs.append((topic, partition, base, range(count, count + h.record_count), h.size))
            count += h.record_count
        return AppendResult(runs, count, self._commit.enqueue({lg: []}, sync))

    def _seal(self, lg: Log, seg: Any) -> None:
        idx, tix = seg.index_bytes()
        fut = self._bg.submit(seal_segment, lg.dir, seg, idx, tix, seg.next_offset)
        fut.add_done_callback(lambda f: log_failure(f, f"sealing a segment of {lg.name}"))

    # --- timers ---------------------------------------------------------------------------------

    def _schedule_timers(self) -> None:
        loop = self._loop
        assert loop is not None
        intervals = [c.fsync_interval_ms for c in self._tconf.values() if c.fsync == "interval_ms"]
        ms = min(intervals + [self.config.fsync_interval_ms])
        self._timers = [
            loop.call_later(ms / 1000, self._interval_tick, ms),
            loop.call_later(self.config.retention_check_interval_ms / 1000, self._retention_tick),
        ]

    def _interval_tick(self, ms: int) -> None:
        if self._closed:
            return
        self._commit.interval_tick()
        assert self._loop is not None
        self._timers[0] = self._loop.call_later(ms / 1000, self._interval_tick, ms)

    def _retention_tick(self) -> None:
        if self._closed:
            return
        try:
            self.enforce_retention()
            if self.txn_index.dirty:  # bounds the replay after a crash to about one interval
                doc = self.txn_index.export(self.log_start_offset)
                f = self._bg.submit(self.txn_index.write_snapshot, doc)
                f.add_done_callback(functools.partial(log_failure, what="transaction index"))
        finally:
            assert self._loop is not None
            self._timers[1] = self._loop.call_later(
                self.config.retention_check_interval_ms / 1000, self._retention_tick
            )

    def enforce_retention(self, now_ms: int | None = None) -> int:
        """Delete whole expired segments (time and size, per topic); returns segments deleted.

        The log start offset moves at once; the files are renamed `.deleted` and unlinked by the
        background worker (after any seal of the same segment, which it runs first).
        """
        now = int(time.time() * 1000) if now_ms is None else now_ms
        n = 0
        for (topic, _p), lg in self._logs.items():
            c = self._tconf[topic]
            for seg in lg.expired_segments(now, c.retention_ms, c.retention_bytes):
                log.info(
                    "retention: deleting segment %020d of %s (%d bytes); log start now %d",
                    seg.base_offset, lg.name, seg.size, lg.log_start_offset,
                )  # fmt: skip
                f = self._bg.submit(delete_segment_files, seg)
                f.add_done_callback(functools.partial(log_failure, what=f"deleting in {lg.name}"))
                n += 1
        return n

    # --- reads ----------------------------------------------------------------------------------

    def read(self, topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
        """Whole batches from the one holding `offset` (see Log.read); b"" at the high watermark."""
        return self._log(topic, partition).read(offset, max_bytes)

    def read_fresh(self, topic: str, partition: int, offset: int) -> bytearray | None:
        """The batch holding `offset` as a recent write of the partition wrote it, or None
        (Log.read_fresh: the dispatcher's read-back of what was just appended, without a pread)."""
        return self._log(topic, partition).read_fresh(offset)

    async def prefetch(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Nothing to do: reads answer from the files (store.backend.LogBackend)."""

    async def prefetch_times(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Nothing to do: `offset_for_timestamp` answers from the time indexes."""

    def high_watermark(self, topic: str, partition: int) -> int:
        """Next offset after the last visible (written) record."""
        return self._log(topic, partition).hwm

    def log_start_offset(self, topic: str, partition: int) -> int:
        return self._log(topic, partition).log_start_offset

    def offset_for_timestamp(self, topic: str, partition: int, ts_ms: int) -> int | None:
        """First offset whose timestamp ≥ ts_ms (None: all older), as Kafka ListOffsets."""
        return self._log(topic, partition).offset_for_timestamp(ts_ms)

    def add_append_listener(self, cb: Callable[[str, int, int], None]) -> None:
        """cb(topic, partition, new_hwm) after each write, on the event loop (before fsync)."""
        self._listeners.append(cb)

    def remove_append_listener(self, cb: Callable[[str, int, int], None]) -> None:
        self._listeners.remove(cb)


__all__ = [
    "AppendResult",
    "OffsetOutOfRangeError",
    "RECOVERY_POINT_FILE",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreLockedError",
    "TopicConfig",
    "UnknownTopicOrPartitionError",
]
