"""Reading a Kafka cluster's partitions as raw record batches, for readers outside the gateway.

Spark's `lightgate` source reads the cluster with this (`kafka.bootstrap.servers`): the driver
asks `partition_spans` for every partition's [log start, high watermark), each task
`iter_range`s its offsets. Batches come back as the bytes the cluster stores, the same
RecordBatch v2 bytes the local log's segments hold, so the source decodes both with one
decoder. No consumer group, no offsets committed: a reader, like a Spark Kafka source.

Synchronous wrappers over aiokafka's client (each call runs its own event loop), because a
Spark task is plain blocking Python.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.structs import TopicPartition

from store.cluster.txns import ClusterTxns
from store.config import StoreError
from store.record_batch import BatchWalk

FETCH_BYTES = 8 << 20
READER_WAIT_MS = 200  # max_wait of a fetch that expects records (answered at once when there)
EMPTY_RETRIES = 5  # empty answers in a row below the high watermark before giving up


def by_leader(client: Any, tps: Any) -> dict[int, list[tuple[str, int]]]:
    """Partitions grouped by their leader's node id (unknown leaders left out)."""
    out: dict[int, list[tuple[str, int]]] = {}
    for t, p in tps:
        node = client.cluster.leader_for_partition(TopicPartition(t, p))
        if node is not None and node >= 0:
            out.setdefault(node, []).append((t, p))
    return out


async def list_offsets(
    client: Any, tps: list[tuple[str, int]], ts: int
) -> dict[tuple[str, int], int]:
    """ListOffsets per leader: ts -1 latest, -2 earliest, else the first offset at/after it
    (-1 in the answer: none). Partitions answered with an error are left out."""
    out: dict[tuple[str, int], int] = {}
    for node, items in by_leader(client, tps).items():
        topics: dict[str, list[tuple[int, int]]] = {}
        for t, p in items:
            topics.setdefault(t, []).append((p, ts))
        resp = await client.send(node, OffsetRequest(-1, 0, list(topics.items())))
        for t, parts in resp.topics:
            for p, err, *info in parts:
                if err == 0:
                    out[(t, p)] = info[-1]
    return out


async def fetch_raw(client: Any, node: int, wanted: dict[tuple[str, int], int], max_bytes: int,
                    max_wait_ms: int = 1, isolation: int = 0) -> tuple[int, list[Any]]:  # fmt: skip
    """One Fetch to `node`: (API version, [(topic, partition response)]). min_bytes is 1, so
    the answer comes as soon as there is data. max_wait is never 0: Tansu answers that with no
    partitions at all (Kafka answers with what it has); and under load Tansu can answer a 1 ms
    wait with no records even where there are some, so readers that expect data wait longer
    (READER_WAIT_MS) and retry an empty answer. `isolation` 1: read_committed (records below
    the last stable offset only)."""
    topics: dict[str, list[tuple[int, int, int]]] = {}
    for (t, p), o in wanted.items():
        topics.setdefault(t, []).append((p, o, max_bytes))
    resp = await client.send(
        node, FetchRequest(max_wait_ms, 1, max_bytes * len(wanted), isolation, list(topics.items()))
    )
    return resp.API_VERSION, [(t, part) for t, parts in resp.topics for part in parts]


async def connect(bootstrap: str, kwargs: dict[str, Any] | None) -> Any:
    """An aiokafka client with fresh metadata (also for store.cluster.offsets_by_time)."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap, **(kwargs or {}))
    await client.bootstrap()
    await client.force_metadata_update()
    return client


def partition_spans(bootstrap: str, topics: list[str],
                    kwargs: dict[str, Any] | None = None) -> dict[tuple[str, int], tuple[int, int]]:  # fmt: skip
    """(topic, partition) -> (log start, last stable offset) of every partition of `topics` (a
    topic the cluster does not have is left out). Reads are read_committed, so nothing above
    the last stable offset (an open transaction's first record) is read yet."""

    async def run() -> dict[tuple[str, int], tuple[int, int]]:
        client = await connect(bootstrap, kwargs)
        try:
            tps = [
                (t, p) for t in topics for p in sorted(client.cluster.partitions_for_topic(t) or ())
            ]
            ends = await list_offsets(client, tps, -1)
            starts = await list_offsets(client, tps, -2)
            # Tansu's ListOffsets(latest) is the last batch's base + 1: a Fetch from just below
            # it reports the true high watermark (Kafka's answer is unchanged by this).
            for node, items in by_leader(client, tps).items():
                probe = {tp: max(starts.get(tp, 0), ends.get(tp, 0) - 1) for tp in items}
                v, parts = await fetch_raw(client, node, probe, 1 << 16, isolation=1)
                for t, part in parts:
                    tp = (t, part[0])
                    if part[2] > ends.get(tp, 0):
                        ends[tp] = part[2]
                    if v >= 4 and 0 <= part[3] < ends.get(tp, 0):
                        ends[tp] = part[3]  # an open transaction: stop before it
            return {tp: (starts.get(tp, 0), max(ends.get(tp, 0), starts.get(tp, 0))) for tp in tps}
        finally:
            await client.close()

    return asyncio.run(run())


def iter_range(bootstrap: str, topic: str, partition: int, start: int, end: int,
               kwargs: dict[str, Any] | None = None) -> Iterator[memoryview]:  # fmt: skip
    """The complete batches holding offsets in [start, end), in offset order, as memoryviews
    of the fetched bytes (each starts with its 61-byte header). read_committed: batches of
    aborted Kafka transactions are left out, learned from the markers as the MQTT path does
    (store.cluster.txns; a batch whose marker is further on is held until it is fetched)."""
    loop = asyncio.new_event_loop()
    client = None
    tp = (topic, partition)
    txns = ClusterTxns()

    def fetch(at: int) -> bytes:
        nodes = by_leader(client, [tp])
        if not nodes:
            raise StoreError(f"no leader for {topic}-{partition}")
        (node,) = nodes
        _v, parts = loop.run_until_complete(
            fetch_raw(client, node, {tp: at}, FETCH_BYTES, READER_WAIT_MS, isolation=1)
        )
        data = b""
        for _t, part in parts:
            if part[0] == partition:
                if part[1]:
                    raise StoreError(f"fetch {topic}-{partition}@{at}: error {part[1]}")
                data = part[-1] or b""
        txns.scan(tp, data)
        return data

    try:
        client = loop.run_until_complete(connect(bootstrap, kwargs))
        pos = start
        empty = 0
        while pos < end:
            data = fetch(pos)
            ok, marker_at = txns.decided_prefix(tp, data, pos)
            while not ok and marker_at >= 0:  # the first batch's marker is further on
                empty = 0 if fetch(marker_at) else empty + 1
                if empty > EMPTY_RETRIES:
                    raise StoreError(f"{topic}-{partition}: no marker for offset {pos}")
                ok, marker_at = txns.decided_prefix(tp, data, pos)
            mv = memoryview(ok)
            # Markers stay (a Kafka consumer skips them); aborted transactions' data goes.
            walk = BatchWalk(
                ok, pos, end, aborted=lambda pid, o: txns.is_aborted(topic, partition, pid, o)
            )
            for _h, bpos, size in walk:
                yield mv[bpos : bpos + size]
            if walk.past_end:
                return
            if walk.next_offset > pos:
                pos = walk.next_offset
                empty = 0
                continue
            empty += 1  # nothing: a slow broker's empty answer, or records deleted meanwhile
            if empty > EMPTY_RETRIES:
                raise StoreError(
                    f"{topic}-{partition}: no records at offset {pos} (below {end}) after "
                    f"{EMPTY_RETRIES} fetches"
                )
    finally:
        if client is not None:
            loop.run_until_complete(client.close())
        loop.close()
