"""Data-plane APIs: ApiVersions, Metadata, CreateTopics, Fetch, ListOffsets, InitProducerId
(Produce: handlers_produce.py).

Each handler serves every advertised version of its API: it reads the fields present in that
version (`getattr` with the Kafka default for older ones) and builds the response with
`protocol.build`, which drops fields the version lacks.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as E

from store.config import MAX_PARTITIONS
from store.mapping import is_system_topic
from store.record_batch import (
    BH_BASE_OFFSET,
    BH_LAST_OFFSET_DELTA,
    BatchWalk,
    iter_batch_headers,
    iter_records,
)
from store.store import StoreError

from .handlers_admin import parse_topic_configs
from .handlers_txn import init_transactional
from .protocol import SUPPORTED_VERSIONS, Request, build, response_module

if TYPE_CHECKING:
    from .broker import Broker, ConnInfo

INT32_MIN = -(2**31)  # "authorized operations not requested"
_TOPIC_OPS = sum(1 << op for op in (3, 4, 5, 6, 7, 8, 10, 11))  # read..alter_configs, no ACLs
_CLIENT_SOFTWARE = re.compile(r"[a-zA-Z0-9](?:[a-zA-Z0-9\-.]*[a-zA-Z0-9])?")
EARLIEST, LATEST, MAX_TIMESTAMP, EARLIEST_LOCAL, LATEST_TIERED = -2, -1, -3, -4, -5


def _ms(td: Any) -> float:
    return td.total_seconds() * 1000.0


async def api_versions(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(18, req.api_version)
    error = E.none
    if req.api_version >= 3:
        name = req.body.client_software_name
        version = req.body.client_software_version
        if not (_CLIENT_SOFTWARE.fullmatch(name) and _CLIENT_SOFTWARE.fullmatch(version)):
            error = E.invalid_request
    keys = tuple(
        build(mod.ApiVersion, api_key=k, min_version=lo, max_version=hi)
        for k, (lo, hi) in sorted(SUPPORTED_VERSIONS.items())
        if error == E.none  # Kafka lists nothing with INVALID_REQUEST
    )
    return build(mod.ApiVersionsResponse, error_code=error, api_keys=keys, throttle_time=0)


# --- Metadata / CreateTopics --------------------------------------------------------------


def _host(b: Broker, conn: ConnInfo) -> str:
    return b.config.advertised_host or conn.local_host


def _port(b: Broker, conn: ConnInfo) -> int:
    """The listener the client came in on (plaintext or TLS): Kafka advertises per listener."""
    return conn.local_port or b.port


async def metadata(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(3, v)
    node = b.config.node_id
    allow_create = b.config.auto_create_topics and getattr(body, "allow_auto_topic_creation", True)
    want_ops = getattr(body, "include_topic_authorized_operations", False)
    known = b.store.topics()
    if body.topics is None or (v == 0 and not body.topics):  # all topics: those it may see
        names: list[str | None] = [
            n for n in sorted(known) if b.authorized(conn, req.client_id, n, "describe", False)
        ]
    else:  # v10+ may name a topic by id only
        by_id = (
            {b.topic_id(n): n for n in known} if any(t.name is None for t in body.topics) else {}
        )
        names = [t.name if t.name is not None else by_id.get(t.topic_id) for t in body.topics]
    topics = []
    for name in names:
        error, count = E.none, known.get(name) if name is not None else None
        if name is None:
            error = E.unknown_topic_id
        elif not b.legal_topic(name):
            error = E.invalid_topic_exception
        elif not b.authorized(conn, req.client_id, name, "describe"):
            error, count = E.topic_authorization_failed, None
        elif count is None:
            if allow_create and not b.authorized(conn, req.client_id, name, "write"):
                error = E.topic_authorization_failed  # Kafka: no Create right, no auto-create
            elif allow_create:
                count = b.store.ensure_topic(name, b.config.default_partitions)
            else:
                error = E.unknown_topic_or_partition
        partitions = tuple(
            build(mod.MetadataResponsePartition, error_code=0, partition_index=i, leader_id=node,
                  leader_epoch=0, replica_nodes=(node,), isr_nodes=(node,), offline_replicas=())
            for i in range(count or 0)
        )  # fmt: skip
        topics.append(
            build(
                mod.MetadataResponseTopic,
                error_code=error,
                name=name if name is not None or v >= 12 else "",  # nullable from v12 only
                topic_id=b.topic_id(name or "") if count else b.topic_id(""),
                # The gateway's own topics (device events, latency probes): consumers that
                # exclude internal topics from pattern subscriptions skip them, as Kafka's own.
                is_internal=bool(name and is_system_topic(name)),
                partitions=partitions,
                topic_authorized_operations=_TOPIC_OPS if want_ops else INT32_MIN,
            )  # fmt: skip
        )
    broker = build(mod.MetadataResponseBroker, node_id=node, host=_host(b, conn),
                   port=_port(b, conn), rack=None)  # fmt: skip
    return build(mod.MetadataResponse, throttle_time=0, brokers=(broker,),
                 cluster_id=b.config.cluster_id, controller_id=node, topics=tuple(topics),
                 cluster_authorized_operations=INT32_MIN)  # fmt: skip


# Kafka topic configs the store applies per topic; any other config name is INVALID_CONFIG.
async def create_topics(b: Broker, req: Request, conn: ConnInfo) -> Any:
    """Creates topics in the store with the topic configs of handlers_admin.TOPIC_CONFIG_KEYS."""
    mod = response_module(19, req.api_version)
    known = b.store.topics()
    results, seen = [], set()
    for t in req.body.topics:
        error, message, count = E.none, None, t.num_partitions
        if t.assignments:
            count = len(t.assignments)
        if t.name in seen:
            error, message = E.invalid_request, "topic listed twice"
        elif not b.legal_topic(t.name):
            error, message = E.invalid_topic_exception, "illegal topic name"
        elif not b.authorized(conn, req.client_id, t.name, "write"):
            error, message = E.topic_authorization_failed, "no write access to the topic"
        elif t.name in known:
            error, message = E.topic_already_exists, f"topic {t.name!r} already exists"
        elif t.assignments and t.num_partitions != -1:
            error, message = E.invalid_request, "both assignments and num_partitions given"
        elif t.replication_factor not in (-1, 1) and not t.assignments:
            error, message = E.invalid_replication_factor, "single-node gateway: factor 1"
        elif any(tuple(a.broker_ids) != (b.config.node_id,) for a in t.assignments):
            error, message = E.invalid_replica_assignment, "single-node gateway"
        elif count == 0 or count < -1:
            error, message = E.invalid_partitions, "partition count must be positive"
        elif count > MAX_PARTITIONS:
            error, message = E.invalid_partitions, f"at most {MAX_PARTITIONS} partitions a topic"
        elif (config := parse_topic_configs([(c.name, c.value) for c in t.configs]))[1]:
            error, message = E.invalid_config, config[1]
        elif not req.body.validate_only:
            partitions = b.config.default_partitions if count == -1 else count
            try:
                count = b.store.create_topic(t.name, partitions, config[0])
            except StoreError as exc:
                error, message = E.invalid_request, str(exc)
        seen.add(t.name)
        if count == -1:
            count = b.config.default_partitions or b.store.config.default_partitions
        results.append(
            build(
                mod.CreatableTopicResult,
                name=t.name,
                topic_id=b.topic_id(t.name),
                error_code=error,
                error_message=message,
                topic_config_error_code=0,
                num_partitions=count if error == E.none else -1,
                replication_factor=1 if error == E.none else -1,
                configs=(),
            )  # fmt: skip
        )
    return build(mod.CreateTopicsResponse, throttle_time=0, topics=tuple(results))


# --- Fetch ------------------------------------------------------------------------------------


def _fetch_session_error(body: Any, v: int) -> int:
    """We never create incremental fetch sessions (KIP-227 lets a broker decline with id 0)."""
    if v < 7:
        return E.none
    if body.session_id != 0:
        return E.fetch_session_id_not_found
    if body.session_epoch not in (0, -1):
        return E.invalid_fetch_session_epoch
    return E.none


def records_from(data: bytes, offset: int) -> int:
    """Records at or after `offset` in whole batches `data` (headers only; for /metrics)."""
    n = 0
    for h, _pos, _size in BatchWalk(data, offset):
        base = h[BH_BASE_OFFSET]
        n += base + h[BH_LAST_OFFSET_DELTA] + 1 - max(base, offset)
    return n


def _read_all(b: Broker, body: Any, mod: Any, denied: set[str]) -> tuple[list[Any], int, bool, int]:
    """One pass over the requested partitions: (topic responses, bytes, any error, records)."""
    store = b.store
    known = store.topics()
    budget = min(body.max_bytes, b.config.fetch_max_bytes)
    committed = getattr(body, "isolation_level", 0) == 1
    total, errors, out, nrec = 0, False, [], 0
    for t in body.topics:
        count = known.get(t.topic)
        parts = []
        for p in t.partitions:
            err, hwm, lso, start, records = E.none, -1, -1, -1, b""
            aborted: tuple[Any, ...] | None = None
            if t.topic in denied:
                err = E.topic_authorization_failed
            elif count is None or not 0 <= p.partition < count:
                err = E.unknown_topic_or_partition
            else:
                hwm = store.high_watermark(t.topic, p.partition)
                lso = store.last_stable_offset(t.topic, p.partition)
                start = store.log_start_offset(t.topic, p.partition)
                end = lso if committed else hwm
                if not start <= p.fetch_offset <= hwm:
                    err = E.offset_out_of_range
                elif p.fetch_offset < end:
                    limit = min(p.partition_max_bytes, budget)
                    if limit > 0 or total == 0:
                        records = store.read(t.topic, p.partition, p.fetch_offset, max(limit, 1))
                        if committed:
                            records, aborted = _committed_view(b, mod, t.topic, p, records, lso)
                        total += len(records)
                        nrec += records_from(records, p.fetch_offset)
                        budget -= len(records)
            errors = errors or err != E.none
            parts.append(
                build(
                    mod.PartitionData,
                    partition_index=p.partition,
                    error_code=err,
                    high_watermark=hwm,
                    last_stable_offset=lso,
                    log_start_offset=start,
                    aborted_transactions=None if err else (aborted or ()),
                    preferred_read_replica=-1,
                    records=records,
                )  # fmt: skip
            )
        out.append(build(mod.FetchableTopicResponse, topic=t.topic, partitions=tuple(parts)))
    return out, total, errors, nrec


def _committed_view(
    b: Broker, mod: Any, topic: str, p: Any, records: bytes, lso: int
) -> tuple[bytes, tuple[Any, ...]]:
    """read_committed: the batches below the LSO, and the aborted transactions among them
    (the consumer drops their records, as from Kafka)."""
    cut, last = 0, p.fetch_offset
    for h in iter_batch_headers(records):
        if h.base_offset >= lso:
            break
        cut += h.batch_length + 12
        last = h.base_offset + h.last_offset_delta
    aborted = b.store.aborted_transactions(topic, p.partition, p.fetch_offset, last + 1)
    entries = tuple(build(mod.AbortedTransaction, producer_id=pid, first_offset=first)
                    for pid, first in aborted)  # fmt: skip
    return (records if cut == len(records) else records[:cut]), entries


async def fetch(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(1, v)
    session_error = _fetch_session_error(body, v)
    if session_error:
        return build(mod.FetchResponse, throttle_time=0, error_code=session_error, session_id=0,
                     responses=())  # fmt: skip
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _ms(body.max_wait) / 1000.0
    keys = [(t.topic, p.partition) for t in body.topics for p in t.partitions]
    denied = {
        t.topic for t in body.topics if not b.authorized(conn, req.client_id, t.topic, "read")
    }
    while True:
        responses, total, errors, nrec = _read_all(b, body, mod, denied)
        remaining = deadline - loop.time()
        if total >= body.min_bytes or errors or remaining <= 0 or not keys:
            break
        await b.wait_for_append(keys, remaining)
    b.counters["fetch_bytes"] += total
    b.counters["fetch_records"] += nrec
    return build(mod.FetchResponse, throttle_time=0, error_code=0, session_id=0,
                 responses=tuple(responses))  # fmt: skip


# --- ListOffsets ------------------------------------------------------------------------------


def _offset_for_time(b: Broker, topic: str, partition: int, ts: int) -> tuple[int, int]:
    """(offset, timestamp) of the first record with timestamp >= ts, or (-1, -1)."""
    offset = b.store.offset_for_timestamp(topic, partition, ts)
    if offset is None:
        return -1, -1
    data = b.store.read(topic, partition, offset, 1)
    for h in iter_batch_headers(data):
        if h.base_offset + h.last_offset_delta < offset or h.max_timestamp < ts:
            continue
        for rec in iter_records(data[: h.batch_length + 12]):
            if rec.offset >= offset and rec.timestamp >= ts:
                return rec.offset, rec.timestamp
        break
    return offset, ts


async def list_offsets(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(2, req.api_version)
    committed = getattr(req.body, "isolation_level", 0) == 1
    known = b.store.topics()
    topics = []
    for t in req.body.topics:
        count = known.get(t.name)
        allowed = b.authorized(conn, req.client_id, t.name, "describe")
        parts = []
        for p in t.partitions:
            err, offset, ts = E.none, -1, -1
            if not allowed:
                err = E.topic_authorization_failed
            elif count is None or not 0 <= p.partition_index < count:
                err = E.unknown_topic_or_partition
            elif p.timestamp == LATEST and committed:  # read_committed: the LSO
                offset = b.store.last_stable_offset(t.name, p.partition_index)
            elif p.timestamp == LATEST:
                offset = b.store.high_watermark(t.name, p.partition_index)
            elif p.timestamp in (EARLIEST, EARLIEST_LOCAL):  # all of the log is local
                offset = b.store.log_start_offset(t.name, p.partition_index)
            elif p.timestamp == MAX_TIMESTAMP:  # v7+: the first record with the largest time
                top = b.store.max_timestamp(t.name, p.partition_index)
                if top >= 0:
                    offset, ts = _offset_for_time(b, t.name, p.partition_index, top)
            elif p.timestamp == LATEST_TIERED:  # v9+: no tiered storage, as Kafka answers it
                offset = -1
            else:
                offset, ts = _offset_for_time(b, t.name, p.partition_index, p.timestamp)
            if (
                committed
                and err == E.none
                and (p.timestamp >= 0 or p.timestamp == MAX_TIMESTAMP)
                and (offset >= b.store.last_stable_offset(t.name, p.partition_index))
            ):  # as Kafka: a time lookup under read_committed finds nothing past the LSO
                offset, ts = -1, -1
            parts.append(
                build(
                    mod.ListOffsetsPartitionResponse,
                    partition_index=p.partition_index,
                    error_code=err,
                    timestamp=ts,
                    offset=offset,
                    leader_epoch=0 if err == E.none else -1,
                )  # fmt: skip
            )
        topics.append(build(mod.ListOffsetsTopicResponse, name=t.name, partitions=tuple(parts)))
    return build(mod.ListOffsetsResponse, throttle_time=0, topics=tuple(topics))


# --- InitProducerId ---------------------------------------------------------------------------


async def init_producer_id(b: Broker, req: Request, conn: ConnInfo) -> Any:
    """Like Kafka without a transactional id, every call (including a KIP-360 epoch bump) gets a
    fresh producer id at epoch 0; with one, the transaction coordinator answers."""
    mod = response_module(22, req.api_version)
    if req.body.transactional_id is not None:
        return await init_transactional(b, req)
    return build(mod.InitProducerIdResponse, throttle_time=0, error_code=E.none,
                 producer_id=b.producers.new_producer_id(), producer_epoch=0)  # fmt: skip
