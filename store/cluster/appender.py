"""Producing to a Kafka cluster the bytes the local log would have written (KafkaLog's appends).

`PrebuiltBatch` hands aiokafka's producer a RecordBatch v2 built by `store.mqtt_batches` (the
same builder `Store.append_mqtt` uses), so a record produced for an MQTT PUBLISH is the one
the local log lays out: key = MQTT topic, `mqtt.*` headers, CreateTime = receive time. The
producer keeps what makes it a good Kafka producer: acks=all, idempotence (it stamps producer
id, epoch and sequence into the header through `_set_producer_state`, and the CRC is computed
again over the stamped bytes), retries, one request per broker for many partitions.

`aiokafka.producer.message_accumulator.BatchBuilder` is the interface relied on (`append`,
`close`, `_set_producer_state`, `_build`, `size`, `record_count`, `closed`); aiokafka 0.14.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from aiokafka.producer.message_accumulator import BatchBuilder

from store.append_result import AppendResult, Run
from store.config import StoreError, UnknownTopicOrPartitionError
from store.latency import LatencyHistogram
from store.mapping import MqttMessage, log_topic_for, partition_for_key
from store.mqtt_batches import build_mqtt_batches
from store.record_batch import _OFFSETS, ATTRIBUTES_OFFSET, CRC_OFFSET, batch_crc, split_batches

log = logging.getLogger("lightgate.store.kafka_log")

_PRODUCER = struct.Struct(">qhi")  # producer id, producer epoch, base sequence
_PRODUCER_OFFSET = _OFFSETS["producer_id"]
_CRC = struct.Struct(">I")
assert _PRODUCER_OFFSET > ATTRIBUTES_OFFSET  # inside the CRC's span: stamp, then checksum


class PrebuiltBatch(BatchBuilder):  # type: ignore[misc]
    """A closed BatchBuilder over finished bytes (base offset 0; the broker assigns offsets)."""

    def __init__(self, data: bytes | bytearray, records: int) -> None:  # no super(): no builder
        self._buffer: bytes | None = None
        self._data = bytearray(data)
        self._records = records
        self._closed = True

    def append(self, *, timestamp: int | None, key: bytes | None, value: bytes | None,
               headers: object = ()) -> None:  # fmt: skip
        return None  # closed: every record is already in the bytes

    def close(self) -> None:
        self._closed = True

    def _set_producer_state(
        self, producer_id: int, producer_epoch: int, base_sequence: int
    ) -> None:
        _PRODUCER.pack_into(
            self._data, _PRODUCER_OFFSET, producer_id, producer_epoch, base_sequence
        )
        _CRC.pack_into(self._data, CRC_OFFSET, batch_crc(self._data, 0, len(self._data)))

    def _build(self) -> bytes:
        if self._buffer is None:
            self._buffer = bytes(self._data)
        return self._buffer

    def size(self) -> int:
        return len(self._data)

    def record_count(self) -> int:
        return self._records

    def closed(self) -> bool:
        return True


class _Pending:
    """One append call waiting for the sender: its messages or raw batch, and its result."""

    __slots__ = ("msgs", "raw", "res", "now_ms")

    def __init__(self, msgs: Any, raw: tuple[str, int, bytes] | None, res: AppendResult) -> None:
        self.msgs = msgs
        self.raw = raw
        self.res = res
        self.now_ms = int(time.time() * 1000)


class ClusterAppender:
    """KafkaLog's writes: appends queued in call order, one sender task (`run`), offsets and
    durability with the cluster's acks=all (theory of operation: store/cluster/kafka_log.py).

    It shares the log's partition counts, high watermarks and topics being created (dicts the
    log mutates in place), and calls back `ensure_topic` (unknown log topics) and `want` (fetch
    what was just written, so the dispatcher reads it next)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        counts: dict[str, int],
        hwm: dict[tuple[str, int], int],
        creating: dict[str, asyncio.Future[None]],
        auto_create_topics: bool,
        ensure_topic: Callable[[str], int],
        want: Callable[[tuple[str, int], int], None],
        wrote: Callable[[tuple[str, int], int, bytes], None],
    ) -> None:
        self._loop = loop
        self._counts = counts
        self._hwm = hwm
        self._creating = creating
        self._auto_create_topics = auto_create_topics
        self._ensure_topic = ensure_topic
        self._want = want
        self._wrote = wrote
        self.producer: Any = None  # the aiokafka producer, set once the log is connected
        self.queue: deque[_Pending] = deque()
        self._wake = asyncio.Event()
        self.closed = False
        self.fsync_latency = LatencyHistogram()  # produce → acks=all, per send (for /metrics)

    # --- append ---------------------------------------------------------------------------------

    def append_mqtt(self, messages: Sequence[MqttMessage], sync: bool = True) -> AppendResult:
        """Queue MQTT messages for the cluster; offsets and durability with its acks=all.
        Raises TopicMappingError for an invalid topic before anything is queued."""
        if self.closed:
            raise StoreError("log is closed")
        for m in messages:
            lt = log_topic_for(m.topic)
            if lt not in self._counts:
                if not self._auto_create_topics:
                    raise UnknownTopicOrPartitionError(f"log topic {lt!r} does not exist")
                self._ensure_topic(lt)
        return self._enqueue(list(messages), None, len(messages))

    def append_batch(
        self, topic: str, partition: int, batch: bytes, sync: bool = True
    ) -> AppendResult:
        """Produce already-built batches (base offset 0) to one partition."""
        if self.closed:
            raise StoreError("log is closed")
        if topic not in self._counts:
            self._ensure_topic(topic)
        if not 0 <= partition < self._counts[topic]:
            raise UnknownTopicOrPartitionError(f"unknown topic or partition {topic}-{partition}")
        count = sum(h.record_count for h in split_batches(batch))
        return self._enqueue(None, (topic, partition, bytes(batch)), count)

    def _enqueue(self, msgs: Any, raw: Any, count: int) -> AppendResult:
        loop = self._loop
        res = AppendResult(None, count, loop.create_future(), loop.create_future())
        self.queue.append(_Pending(msgs, raw, res))
        self._wake.set()
        return res

    async def drain(self) -> None:
        """Until every queued append was handed to the producer."""
        while self.queue:
            self._wake.set()
            await asyncio.sleep(0.01)

    async def run(self) -> None:
        """The sender task: hand queued appends to the producer in call order (one build for
        all that queued)."""
        while not self.closed:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                if self._creating:
                    await asyncio.gather(*self._creating.values(), return_exceptions=True)
                items = list(self.queue)
                self.queue.clear()
                try:
                    await self._send(items)
                except Exception as exc:
                    log.error("producing %d appends to the cluster failed: %r", len(items), exc)
                    for it in items:
                        _fail(it.res, exc)

    async def _send(self, items: list[_Pending]) -> None:
        counts = self._counts
        msgs: list[MqttMessage] = []
        owner: list[tuple[_Pending, int]] = []  # combined index -> (append, its index)
        now = items[0].now_ms
        sends: list[tuple[str, int, Any, list[int] | None, _Pending | None]] = []
        for it in items:
            if it.raw is not None:
                t, p, data = it.raw
                sends.append((t, p, PrebuiltBatch(data, it.res.count), None, it))
            else:
                for i, m in enumerate(it.msgs):
                    msgs.append(m)
                    owner.append((it, i))

        def route(topic: str) -> tuple[tuple[str, int], bytes]:
            lt = log_topic_for(topic)
            key = topic.encode()
            return (lt, partition_for_key(key, counts[lt])), key

        if msgs:
            for slot, buf, n, _ts, idxs in build_mqtt_batches(msgs, route, now):
                sends.append((slot[0], slot[1], PrebuiltBatch(buf, n), idxs, None))
        t0 = time.perf_counter()
        futs = []
        for t, p, batch, _idxs, _it in sends:
            futs.append(await self.producer.send_batch(batch, t, partition=p))
        done = asyncio.gather(*futs, return_exceptions=True)
        done.add_done_callback(lambda f: self._acked(f.result(), sends, items, owner, t0))

    def _acked(self, results: list[Any], sends: list[Any], items: list[_Pending],
               owner: list[tuple[_Pending, int]], t0: float) -> None:  # fmt: skip
        self.fsync_latency.observe(time.perf_counter() - t0)
        runs: dict[_Pending, list[Run]] = {it: [] for it in items}
        failed: dict[_Pending, BaseException] = {}
        for md, (t, p, batch, idxs, it) in zip(results, sends, strict=True):
            if isinstance(md, BaseException):
                for x in [it] if it is not None else {owner[i][0] for i in idxs}:
                    failed[x] = md
                continue
            base = md.offset
            n = batch.record_count()
            tp = (t, p)
            seen = self._hwm.get(tp, 0)
            if base + n > seen:
                self._hwm[tp] = base + n
                if it is not None or base > seen:
                    # A raw batch (perhaps several, transactional), or records of other
                    # writers before ours: fetch them, the dispatcher reads them next.
                    self._want(tp, min(base, seen) if it is not None else seen)
            if it is None:
                # One batch we built: the cluster holds exactly these bytes at `base` (the base
                # offset is outside the CRC), so the reader gets them without fetching them back.
                self._wrote(tp, base, batch._build())
            if it is not None:
                runs[it].append((t, p, base, range(n), batch.size()))
                continue
            # Split the batch into one run per append (consecutive records of one call).
            k0 = 0
            while k0 < n:
                who = owner[idxs[k0]][0]
                k1 = k0
                local: list[int] = []
                while k1 < n and owner[idxs[k1]][0] is who:
                    local.append(owner[idxs[k1]][1])
                    k1 += 1
                runs[who].append((t, p, base + k0, local, batch.size() * (k1 - k0) // n))
                k0 = k1
        for it in items:
            if it in failed:
                _fail(it.res, failed[it])
                continue
            it.res.set_staged(runs[it], it.res.count)
            if not it.res.durable.done():
                it.res.durable.set_result(None)


def _fail(res: AppendResult, exc: BaseException) -> None:
    for f in (res.durable, res.staged):
        if f is not None and not f.done():
            f.set_exception(StoreError(f"the cluster did not take the append: {exc!r}"))
            f.exception()  # retrieved here: callers may only look at one of the two
