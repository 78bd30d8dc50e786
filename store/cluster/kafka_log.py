"""KafkaLog: the log on a Kafka cluster (`log = "kafka"`), a `store.backend.LogBackend`.

Theory of operation
-------------------
Writes. `append_mqtt` builds the batches `Store.append_mqtt` would write (store.mqtt_batches)
and queues them; one sender task hands them, in call order, to aiokafka's producer (acks=all,
idempotent unless `kafka_client_enable_idempotence = false`), which sends one request per
broker for many partitions. Ticks queued while a request is out are merged into one build. The
offsets arrive with the cluster's acknowledgement: `AppendResult.staged` and `durable` both
resolve then (so a PUBACK waits for acks=all). Unknown log topics are created first, with
`kafka_topic_partitions` partitions and `kafka_replication_factor` replicas.

Reads. Batches live in a `BatchCache`. What this node produced goes in as it is acknowledged,
at the offset the cluster gave it (the bytes the cluster stores, the base offset outside the
CRC), so its readers never fetch it back. One fetch task fills in the rest: what readers missed
(`FetchPending`, `prefetch`), records of other writers found before ours, and every `poll_ms`
when idle the tail of every partition (records produced by other clients and nodes). Every fetch response moves the partition's
high watermark, last stable offset and log start, and wakes the partition's append listeners,
so the dispatcher reads again. Fetches are read_committed; which Kafka transactions were
aborted is learned from their markers (store.cluster.txns). Fetches are raw Fetch requests through aiokafka's client: the record set comes
back as the bytes the cluster stores, and is never decoded here.

Connecting (the client, the producer and the admin client, retried until
`kafka_connect_timeout_s`) is in store.cluster.clients.

The data dir holds no log: only DATA/LOCK (taken as the local store takes it) and what the
light queues keep (derived from the cluster, rebuilt when missing).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import NewTopic

from store.append_result import AppendResult
from store.backend import AppendListener, FetchPending, LogBackend
from store.cluster.appender import ClusterAppender
from store.cluster.batch_cache import BatchCache
from store.cluster.clients import ClusterUnreachableError, connect, stop_clients
from store.cluster.offsets_by_time import OffsetsByTime
from store.cluster.reader import (
    EMPTY_RETRIES,
    READER_WAIT_MS,
    by_leader,
    fetch_raw,
    list_offsets,
)
from store.cluster.txns import ClusterTxns
from store.config import StoreError, UnknownTopicOrPartitionError
from store.data_dir_lock import release_data_dir_lock, take_data_dir_lock
from store.log import OffsetOutOfRangeError
from store.mapping import MqttMessage
from store.record_batch import BASE_OFFSET_OFFSET
from store.store import Store

log = logging.getLogger("lightgate.store.kafka_log")

ERR_OFFSET_OUT_OF_RANGE = 1
METADATA_EVERY_S = 1.0
_BASE = struct.Struct(">q")  # new topics (other nodes, other clients) are found this fast


@dataclass(slots=True)
class KafkaLogConfig:
    bootstrap: str
    topic_partitions: int = 4
    replication_factor: int = -1  # the cluster's default
    client: dict[str, Any] = field(default_factory=dict)  # kafka_client_<name> keywords
    connect_timeout_s: float = 60.0
    cache_bytes: int = 64 << 20
    fetch_bytes: int = 4 << 20  # per partition and fetch
    poll_ms: int = 20  # tail poll when nothing was asked for
    auto_create_topics: bool = True
    # The cluster's topics that are not log topics (the nodes' shared session state): not read,
    # not indexed.
    private_topics: tuple[str, ...] = ()


class KafkaLog:
    """The cluster's topics as a LogBackend. Event-loop-only except where a method says so.
    Writes go through its `ClusterAppender`, offsets by time through its `OffsetsByTime`."""

    remote_reads = True

    def __init__(self, data_dir: Path, config: KafkaLogConfig) -> None:
        self.data_dir = Path(data_dir)
        self.config = config
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()  # the loop's thread
        self._lock_fd = -1
        self._client: Any = None
        self._producer: Any = None
        self._admin: Any = None
        self._counts: dict[str, int] = {}
        self._hwm: dict[tuple[str, int], int] = {}
        self._start: dict[tuple[str, int], int] = {}
        self._creating: dict[str, asyncio.Future[None]] = {}
        self._listeners: list[AppendListener] = []
        self.cache = BatchCache(config.cache_bytes)
        self._wanted: dict[tuple[str, int], int] = {}
        self._lso: dict[tuple[str, int], int] = {}  # where the cluster said LSO < HW
        self.txn_index = ClusterTxns()  # aborted transactions (lightqueue's aborted_check)
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.fetches = 0  # Fetch requests sent for readers (tests check batching), not polls
        self.polls = 0  # tail polls (one Fetch per leader every poll_ms when idle)
        self._meta_at = 0.0
        self.appender = ClusterAppender(
            self._loop, self._counts, self._hwm, self._creating, config.auto_create_topics,
            self.ensure_topic, self._want, self._wrote,
        )  # fmt: skip
        self.fsync_latency = self.appender.fsync_latency  # produce → acks=all (for /metrics)
        self.times = OffsetsByTime(
            self._hwm, self._start, self.last_stable_offset, self._list_offsets, self._fetch_one
        )

    # --- lifecycle ------------------------------------------------------------------------------

    @classmethod
    async def open(cls, data_dir: Path, config: KafkaLogConfig) -> KafkaLog:
        """Lock the data dir, connect (retrying until `connect_timeout_s`, logging why), learn the
        topics and their offsets, start the sender and the fetcher."""
        self = cls(Path(data_dir), config)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = take_data_dir_lock(self.data_dir)
        try:
            await self._connect()
            await self._refresh_metadata()
        except BaseException:
            await self._stop_clients()
            release_data_dir_lock(self._lock_fd)
            self._lock_fd = -1
            raise
        self._tasks = [
            asyncio.create_task(self.appender.run(), name="kafka-log-sender"),
            asyncio.create_task(self._fetcher(), name="kafka-log-fetcher"),
        ]
        return self

    async def _connect(self) -> None:
        cfg = self.config
        clients = await connect(cfg.bootstrap, cfg.client, cfg.connect_timeout_s)
        self._client, self._producer, self._admin = clients
        self.appender.producer = self._producer

    async def _stop_clients(self) -> None:
        await stop_clients(self._producer, self._admin, self._client)
        self._producer = self._admin = self._client = None

    async def close(self) -> None:
        """Send what is queued, wait for its acks, stop the tasks and the clients, unlock."""
        if self._closed:
            return
        await self.appender.drain()
        if self._producer is not None:
            try:
                await self._producer.flush()
            except Exception:
                log.exception("flushing the Kafka producer")
        self._closed = self.appender.closed = True
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        await self._stop_clients()
        if self._lock_fd >= 0:
            release_data_dir_lock(self._lock_fd)
            self._lock_fd = -1

    # --- writes and offsets by time (delegated) -----------------------------------------------

    def append_mqtt(self, messages: Sequence[MqttMessage], sync: bool = True) -> AppendResult:
        """Queue MQTT messages for the cluster; offsets and durability with its acks=all."""
        return self.appender.append_mqtt(messages, sync)

    def append_batch(
        self, topic: str, partition: int, batch: bytes, sync: bool = True
    ) -> AppendResult:
        """Produce already-built batches (base offset 0) to one partition."""
        return self.appender.append_batch(topic, partition, batch, sync)

    def offset_for_timestamp(self, topic: str, partition: int, ts_ms: int) -> int | None:
        """The first offset at/after `ts_ms` as `prefetch_times` found it (see OffsetsByTime)."""
        return self.times.offset_for_timestamp(self._tp(topic, partition), ts_ms)

    async def prefetch_times(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Find the first offset at/after each (topic, partition, ts_ms) on the cluster."""
        await self.times.prefetch_times(wants)

    # --- topics ---------------------------------------------------------------------------------

    async def _refresh_metadata(self) -> None:
        """Learn topics and partitions (new ones from other clients too), and their offsets."""
        self._meta_at = time.monotonic()
        await self._client.force_metadata_update()
        cluster = self._client.cluster
        new: list[tuple[str, int]] = []
        for t in cluster.topics():
            if t.startswith("__") and not t.startswith("__lightgate"):
                continue  # the cluster's own (__consumer_offsets, ...)
            if t in self.config.private_topics:
                continue
            parts = cluster.partitions_for_topic(t) or set()
            if not parts:
                continue
            n = max(parts) + 1
            if self._counts.get(t, 0) < n:
                self._counts[t] = n
            for p in range(n):
                if (t, p) not in self._hwm:
                    new.append((t, p))
        if new:
            ends = await self._list_offsets(new, -1)
            starts = await self._list_offsets(new, -2)
            # Tansu answers ListOffsets(latest) with the last batch's base offset + 1, not the
            # last offset + 1: a Fetch from just below it reports the true high watermark.
            probe = {tp: max(starts.get(tp, 0), ends.get(tp, 0) - 1) for tp in new}
            for node, tps in self._by_leader(new).items():
                v, parts = await fetch_raw(self._client, node, {tp: probe[tp] for tp in tps},
                                           1 << 16, 1, 1)  # fmt: skip
                for t, part in parts:
                    if part[2] > ends.get((t, part[0]), 0):
                        ends[(t, part[0])] = part[2]
                    self._note_lso((t, part[0]), v, part)
            for tp in new:
                self._start[tp] = starts.get(tp, 0)
                self._hwm[tp] = max(ends.get(tp, 0), self._start[tp])
            for tp in new:
                self._fire(tp)

    async def _list_offsets(
        self, tps: list[tuple[str, int]], ts: int
    ) -> dict[tuple[str, int], int]:
        return await list_offsets(self._client, tps, ts)

    def _by_leader(self, tps: Any) -> dict[int, list[tuple[str, int]]]:
        return by_leader(self._client, tps)

    def topics(self) -> dict[str, int]:
        return dict(self._counts)

    def partitions(self, name: str) -> int | None:
        return self._counts.get(name)

    def ensure_topic(self, name: str, partitions: int | None = None) -> int:
        """Known: its count. Else the topic is created on the cluster in the background (appends
        to it wait for that); returns the count it is created with."""
        n = self._counts.get(name)
        if n is not None:
            return n
        n = partitions or self.config.topic_partitions
        self._counts[name] = n
        for p in range(n):
            self._hwm[(name, p)] = self._start[(name, p)] = 0
        self._creating[name] = asyncio.ensure_future(self._create(name, n))
        return n

    async def _create(self, name: str, n: int) -> None:
        nt = NewTopic(name, n, 1)
        nt.replication_factor = self.config.replication_factor  # -1: the cluster's default
        try:
            resp = await self._admin.create_topics([nt])
            for _t, code, *_rest in resp.topic_errors:
                if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS (another node made it)
                    log.error("creating topic %s on the cluster: error %d %s", name, code, _rest)
        except Exception:
            log.exception("creating topic %s on the cluster", name)
        await self._refresh_metadata()
        self._creating.pop(name, None)

    # --- reads ----------------------------------------------------------------------------------

    def _tp(self, topic: str, partition: int) -> tuple[str, int]:
        tp = (topic, partition)
        if tp not in self._hwm:
            raise UnknownTopicOrPartitionError(f"unknown topic or partition {topic}-{partition}")
        return tp

    def high_watermark(self, topic: str, partition: int) -> int:
        """The cluster's high watermark as last learned (fetch responses, our produce acks)."""
        return self._hwm[self._tp(topic, partition)]

    def log_start_offset(self, topic: str, partition: int) -> int:
        return self._start[self._tp(topic, partition)]

    def last_stable_offset(self, topic: str, partition: int) -> int:
        """Below it every Kafka transaction is decided (the dispatcher indexes up to here)."""
        tp = self._tp(topic, partition)
        return min(self._lso.get(tp, self._hwm[tp]), self._hwm[tp])

    def _note_lso(self, tp: tuple[str, int], v: int, part: Any) -> bool:
        """The LSO of a fetch response (v4+); True when it moved."""
        lso = part[3] if v >= 4 and 0 <= part[3] < part[2] else None
        if lso == self._lso.get(tp):
            return False
        if lso is None:
            del self._lso[tp]
        else:
            self._lso[tp] = lso
        return True

    def read(self, topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
        """From memory, else FetchPending (a fetch is started). Thread-safe for one other thread
        (`rebuild-queues` runs the dispatcher in one): there, it waits for the fetch instead."""
        tp = self._tp(topic, partition)
        if offset >= self._hwm[tp]:
            return b""
        if offset < self._start[tp]:
            raise OffsetOutOfRangeError(topic, partition, offset, self._start[tp], self._hwm[tp])
        if threading.get_ident() != self._thread:
            at, empty = offset, 0
            while empty <= EMPTY_RETRIES:  # a slow broker may answer with no records
                got = asyncio.run_coroutine_threadsafe(
                    self._fetch_one(tp, at, False), self._loop
                ).result()
                empty = 0 if got else empty + 1
                if got and at == offset:
                    first = got
                if at == offset and not got:
                    continue
                data, at = self.txn_index.decided_prefix(tp, first, offset)
                if data:
                    return data
                # else: fetch on for the marker of the first batch's transaction
            raise StoreError(f"{topic}-{partition}: offset {offset} not fetched")
        cached = self.cache.read(topic, partition, offset, max_bytes)
        if cached is None:
            self._want(tp, offset)
            raise FetchPending(f"{topic}-{partition} offset {offset}")
        # Only batches whose Kafka transaction is known decided (store.cluster.txns).
        data, marker_at = self.txn_index.decided_prefix(tp, cached, offset)
        if not data:
            self._want(tp, marker_at)
            raise FetchPending(f"{topic}-{partition} offset {offset}: its transaction's marker")
        return data

    async def prefetch(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Fetch what `read` would miss, one run per partition: each fetch brings
        `fetch_bytes` from the first missing offset, which covers the offsets after it."""
        by_tp: dict[tuple[str, int], list[int]] = {}
        for t, p, o in wants:
            by_tp.setdefault((t, p), []).append(o)

        async def one(tp: tuple[str, int], offs: list[int]) -> None:
            for o in sorted(offs):
                tries = 0
                while self._start.get(tp, 0) <= o < self._hwm.get(tp, 0):
                    if self.cache.find(tp[0], tp[1], o) is not None:
                        break
                    if tries > EMPTY_RETRIES:  # the delivery that asked retries later
                        raise StoreError(f"{tp[0]}-{tp[1]}: offset {o} not fetched")
                    tries += 1
                    await self._fetch_one(tp, o, True)

        await asyncio.gather(*(one(tp, offs) for tp, offs in by_tp.items()))

    def add_append_listener(self, cb: AppendListener) -> None:
        self._listeners.append(cb)

    def remove_append_listener(self, cb: AppendListener) -> None:
        self._listeners.remove(cb)

    def disk_usage(self) -> dict[str, tuple[int, int]]:
        """Log topic -> (0: the bytes are on the cluster, records between log start and end)."""
        out: dict[str, tuple[int, int]] = {}
        for (t, _p), h in self._hwm.items():
            out[t] = (0, out.get(t, (0, 0))[1] + h - self._start[(t, _p)])
        return out

    def stats(self) -> dict[str, int]:
        """For /metrics: Fetch requests sent, the batch cache's bytes, hits and misses."""
        c = self.cache
        return {
            "kafka_log_fetches": self.fetches,
            "kafka_log_polls": self.polls,
            "kafka_log_cache_bytes": c.bytes,
            "kafka_log_cache_hits": c.hits,
            "kafka_log_cache_misses": c.misses,
        }

    def _fire(self, tp: tuple[str, int]) -> None:
        for cb in list(self._listeners):
            cb(tp[0], tp[1], self._hwm[tp])

    # --- fetching -------------------------------------------------------------------------------

    def _wrote(self, tp: tuple[str, int], base: int, data: bytes) -> None:
        """A batch this node produced, acknowledged at `base`: cached as the cluster stores it
        (its base offset set; the CRC does not cover it), and its readers woken. Fetching it
        back cost the cluster one Fetch per produce, and slowed its produce answers."""
        buf = bytearray(data)
        _BASE.pack_into(buf, BASE_OFFSET_OFFSET, base)
        self.cache.insert(tp[0], tp[1], bytes(buf))
        self._fire(tp)

    def _want(self, tp: tuple[str, int], offset: int) -> None:
        o = self._wanted.get(tp)
        if o is None or offset < o:
            self._wanted[tp] = offset
        self._kick.set()

    async def _fetcher(self) -> None:
        """Fetch what readers missed; when nobody asked for `poll_ms`, poll every tail."""
        poll = self.config.poll_ms / 1000
        while not self._closed:
            if not self._wanted:
                # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that
                # lands as the event fires, and then close() waited for this task forever.
                try:
                    async with asyncio.timeout(poll):
                        await self._kick.wait()
                except TimeoutError:
                    pass
            self._kick.clear()
            try:
                if time.monotonic() - self._meta_at > METADATA_EVERY_S:
                    await self._refresh_metadata()
                wanted, self._wanted = self._wanted, {}
                tail = not wanted
                if tail:
                    wanted = dict(self._hwm)
                await self._fetch(wanted, tail)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("fetching from the Kafka cluster failed: %r; retrying", exc)
                await asyncio.sleep(0.5)

    async def _fetch(self, wanted: dict[tuple[str, int], int], tail: bool) -> None:
        await asyncio.gather(
            *(
                self._fetch_node(node, {tp: wanted[tp] for tp in tps}, tail)
                for node, tps in self._by_leader(wanted).items()
            )
        )

    async def _fetch_node(
        self, node: int, wanted: dict[tuple[str, int], int], tail: bool, keep: bool = True
    ) -> dict[tuple[str, int], bytes]:
        if tail:
            self.polls += 1
        else:
            self.fetches += 1
        v, parts = await fetch_raw(self._client, node, wanted, self.config.fetch_bytes,
                                   1 if tail else READER_WAIT_MS, 1)  # fmt: skip
        out: dict[tuple[str, int], bytes] = {}
        for t, part in parts:
            p, err, hw = part[0], part[1], part[2]
            tp = (t, p)
            if tp not in self._hwm:
                continue
            changed = False
            if err == ERR_OFFSET_OUT_OF_RANGE:
                starts = await self._list_offsets([tp], -2)
                if tp in starts and starts[tp] != self._start[tp]:
                    self._start[tp] = starts[tp]
                    changed = True
            elif err:
                log.warning("fetch %s-%d: error %d", t, p, err)
                continue
            if v >= 5 and part[4] >= 0 and part[4] > self._start[tp]:
                self._start[tp] = part[4]
                self.cache.drop_below(t, p, part[4])
                changed = True
            if hw > self._hwm[tp]:
                self._hwm[tp] = hw
                changed = True
            changed = self._note_lso(tp, v, part) or changed
            data = part[-1] or b""
            out[tp] = data
            if data:
                self.txn_index.scan(tp, data)
            if data and keep and self.cache.insert(t, p, data) >= 0:
                changed = changed or not tail
            if changed:
                self._fire(tp)
        return out

    async def _fetch_one(self, tp: tuple[str, int], offset: int, keep: bool) -> bytes:
        """One partition from `offset`: into the cache (`keep`), or just returned."""
        nodes = self._by_leader([tp])
        if not nodes:
            await self._refresh_metadata()
            nodes = self._by_leader([tp])
            if not nodes:
                raise StoreError(f"no leader for {tp[0]}-{tp[1]}")
        (node,) = nodes
        got = await self._fetch_node(node, {tp: offset}, False, keep)
        return got.get(tp, b"")


def _both_are_log_backends(local: Store, cluster: KafkaLog) -> tuple[LogBackend, LogBackend]:
    """Never called: mypy checks here that both logs satisfy the Protocol (STYLE 17)."""
    return local, cluster


__all__ = ["ClusterUnreachableError", "KafkaLog", "KafkaLogConfig"]
