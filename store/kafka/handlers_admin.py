"""Admin APIs: DeleteTopics, DeleteRecords, CreatePartitions, DescribeConfigs, AlterConfigs,
IncrementalAlterConfigs, DescribeCluster, DescribeLogDirs, OffsetDelete, DeleteGroups.

Topic configs are the store's per-topic overrides (`Store.alter_topic_config`), named as Kafka
names them; the fsync policy, which Kafka does not have, is `lightgate.fsync.policy` (and
`lightgate.fsync.interval.ms`). DescribeConfigs reports a value set on the topic as
DYNAMIC_TOPIC_CONFIG and everything else as DEFAULT_CONFIG, like Kafka.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as E

from store.config import FSYNC_POLICIES, StoreError, UnknownTopicOrPartitionError
from store.log import OffsetOutOfRangeError

from .protocol import Request, build, response_module

if TYPE_CHECKING:
    from .broker import Broker, ConnInfo

TOPIC, BROKER = 2, 4  # ConfigResource types
DYNAMIC_TOPIC_CONFIG, STATIC_BROKER_CONFIG, DEFAULT_CONFIG = 1, 4, 5  # ConfigSource
T_BOOLEAN, T_STRING, T_INT, T_LONG = 1, 2, 3, 5  # ConfigType
SET, DELETE, APPEND, SUBTRACT = 0, 1, 2, 3  # IncrementalAlterConfigs operations
INT32_MIN = -(2**31)


@dataclass(frozen=True, slots=True)
class TopicConfigKey:
    """A Kafka topic config name and the store override it is (None: fixed, read-only)."""

    name: str
    store_key: str | None
    type: int
    doc: str
    fixed: str = ""


TOPIC_CONFIG_KEYS: tuple[TopicConfigKey, ...] = (
    TopicConfigKey("retention.ms", "retention_ms", T_LONG, "delete segments older than this (-1: never)"),
    TopicConfigKey("retention.bytes", "retention_bytes", T_LONG, "keep at most this much per partition (-1: no limit)"),
    TopicConfigKey("segment.bytes", "segment_bytes", T_INT, "roll a new segment past this size"),
    TopicConfigKey("segment.ms", "segment_ms", T_LONG, "roll a new segment after this long"),
    TopicConfigKey("lightgate.fsync.policy", "fsync", T_STRING, "always (acks wait for fsync), interval_ms or never"),
    TopicConfigKey("lightgate.fsync.interval.ms", "fsync_interval_ms", T_LONG, "fsync interval under interval_ms"),
    TopicConfigKey("cleanup.policy", None, T_STRING, "only delete (no compaction)", "delete"),
    TopicConfigKey("min.insync.replicas", None, T_INT, "one node: 1", "1"),
    TopicConfigKey("message.timestamp.type", None, T_STRING, "records keep their CreateTime", "CreateTime"),
)  # fmt: skip
BY_NAME = {k.name: k for k in TOPIC_CONFIG_KEYS}


def _value(key: TopicConfigKey, store_value: Any) -> str:
    return key.fixed if key.store_key is None else str(store_value)


def parse_topic_configs(items: list[tuple[str, str | None]]) -> tuple[dict[str, Any], str | None]:
    """Kafka config (name, value) pairs → store overrides, or an error message."""
    out: dict[str, Any] = {}
    for name, value in items:
        key = BY_NAME.get(name)
        if key is None:
            return {}, f"unknown topic config {name!r} (known: {', '.join(sorted(BY_NAME))})"
        if key.store_key is None:
            if value != key.fixed:
                return {}, f"{name} is fixed at {key.fixed!r} here"
            continue
        if key.store_key == "fsync":
            if value not in FSYNC_POLICIES:
                return {}, f"{name} must be one of {', '.join(FSYNC_POLICIES)}"
            out["fsync"] = value
            continue
        try:
            out[key.store_key] = int(value or "")
        except ValueError:
            return {}, f"{name} needs an integer, got {value!r}"
    return out, None


# --- DeleteTopics / DeleteRecords / CreatePartitions ----------------------------------------


async def delete_topics(b: Broker, req: Request, conn: ConnInfo) -> Any:
    """Deletes each topic with its data, light-queue entries, retained messages and committed
    offsets (docs/kafka.md "Deleting a topic")."""
    mod = response_module(20, req.api_version)
    body = req.body
    if req.api_version >= 6:
        wanted = [(t.name, t.topic_id) for t in body.topics]
    else:
        wanted = [(n, None) for n in body.topic_names]
    by_id = {b.topic_id(n): n for n in b.store.topics()}
    results = []
    for name, tid in wanted:
        error, message = E.none, None
        if name is None:
            name = by_id.get(tid)
            if name is None:
                error, message = E.unknown_topic_id, f"no topic with id {tid}"
        if error == E.none and not b.authorized(conn, req.client_id, name, "write"):
            error, message = E.topic_authorization_failed, "no write access to the topic"
        elif error == E.none:
            tid = b.topic_id(name)
            try:
                await b.store.delete_topic(name)
            except UnknownTopicOrPartitionError:
                error, message = E.unknown_topic_or_partition, f"unknown topic {name!r}"
        results.append(
            build(
                mod.DeletableTopicResult,
                name=name,
                topic_id=tid,
                error_code=error,
                error_message=message,
            )  # fmt: skip
        )
    return build(mod.DeleteTopicsResponse, throttle_time=0, responses=tuple(results))


async def delete_records(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(21, req.api_version)
    topics = []
    for t in req.body.topics:
        parts = []
        allowed = b.authorized(conn, req.client_id, t.name, "write")
        for p in t.partitions:
            error, low = E.none, -1
            try:
                if not allowed:
                    error = E.topic_authorization_failed
                else:
                    low = await b.store.delete_records(t.name, p.partition_index, p.offset)
            except UnknownTopicOrPartitionError:
                error = E.unknown_topic_or_partition
            except OffsetOutOfRangeError:
                error = E.offset_out_of_range
            parts.append(
                build(
                    mod.DeleteRecordsPartitionResult,
                    partition_index=p.partition_index,
                    low_watermark=low,
                    error_code=error,
                )  # fmt: skip
            )
        topics.append(build(mod.DeleteRecordsTopicResult, name=t.name, partitions=tuple(parts)))
    return build(mod.DeleteRecordsResponse, throttle_time=0, topics=tuple(topics))


async def create_partitions(b: Broker, req: Request, conn: ConnInfo) -> Any:
    """Grows topics. MQTT topics are routed by hash modulo the count, so an MQTT topic may move
    to another partition: its order holds before and after, as Kafka's key order does."""
    mod = response_module(37, req.api_version)
    results = []
    node = b.config.node_id
    for t in req.body.topics:
        error, message = E.none, None
        current = b.store.partitions(t.name)
        if not b.authorized(conn, req.client_id, t.name, "write"):
            error, message = E.topic_authorization_failed, "no write access to the topic"
        elif current is None:
            error, message = E.unknown_topic_or_partition, f"unknown topic {t.name!r}"
        elif t.count <= current:
            error, message = E.invalid_partitions, f"{t.name} has {current} partitions already"
        elif t.assignments and any(tuple(a.broker_ids) != (node,) for a in t.assignments):
            error, message = E.invalid_replica_assignment, "single-node gateway"
        elif not req.body.validate_only:
            try:
                b.store.create_partitions(t.name, t.count)
            except StoreError as exc:
                error, message = E.invalid_partitions, str(exc)
        results.append(
            build(
                mod.CreatePartitionsTopicResult,
                name=t.name,
                error_code=error,
                error_message=message,
            )  # fmt: skip
        )
    return build(mod.CreatePartitionsResponse, throttle_time=0, results=tuple(results))


# --- configs ----------------------------------------------------------------------------------


def _broker_configs(b: Broker) -> list[tuple[str, str, int, str]]:
    c = b.store.config
    return [
        ("log.retention.ms", str(c.retention_ms), T_LONG, "default retention.ms of new topics"),
        ("log.retention.bytes", str(c.retention_bytes), T_LONG, "default retention.bytes"),
        ("log.segment.bytes", str(c.segment_bytes), T_INT, "default segment.bytes"),
        ("num.partitions", str(c.default_partitions), T_INT, "partitions of auto-created topics"),
        ("auto.create.topics.enable", str(c.auto_create_topics).lower(), T_BOOLEAN, "create on first use"),
        ("default.replication.factor", "1", T_INT, "one node"),
        ("lightgate.fsync.policy", c.fsync, T_STRING, "default fsync policy of new topics"),
    ]  # fmt: skip


async def describe_configs(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(32, req.api_version)
    v = req.api_version
    synonyms = getattr(req.body, "include_synonyms", False)
    docs = getattr(req.body, "include_documentation", False)
    results = []
    for r in req.body.resources:
        keys = set(r.configuration_keys) if r.configuration_keys is not None else None
        error, message, entries = E.none, None, []
        if r.resource_type == TOPIC:
            if not b.authorized(conn, req.client_id, r.resource_name, "describe"):
                error, message = E.topic_authorization_failed, "no access to the topic"
            elif b.store.partitions(r.resource_name) is None:
                error, message = E.unknown_topic_or_partition, f"unknown topic {r.resource_name!r}"
            else:
                tc = b.store.topic_config(r.resource_name)
                own = b.store.topic_overrides(r.resource_name)
                defaults = b.store.config
                for k in TOPIC_CONFIG_KEYS:
                    if keys is not None and k.name not in keys:
                        continue
                    dynamic = k.store_key in own
                    value = _value(k, getattr(tc, k.store_key) if k.store_key else None)
                    default = _value(k, getattr(defaults, k.store_key) if k.store_key else None)
                    syn = []
                    if synonyms:
                        if dynamic:
                            syn.append((k.name, value, DYNAMIC_TOPIC_CONFIG))
                        syn.append((k.name, default, DEFAULT_CONFIG))
                    source = DYNAMIC_TOPIC_CONFIG if dynamic else DEFAULT_CONFIG
                    entries.append((k.name, value, k.store_key is None, source, k.type, k.doc, syn))
        elif r.resource_type == BROKER:
            for name, value, typ, doc in _broker_configs(b):
                if keys is None or name in keys:
                    entries.append((name, value, True, STATIC_BROKER_CONFIG, typ, doc, []))
        else:
            error, message = E.invalid_request, f"resource type {r.resource_type} not supported"
        configs = tuple(
            build(
                mod.DescribeConfigsResourceResult,
                name=name, value=value, read_only=ro, config_source=source, is_sensitive=False,
                synonyms=tuple(build(mod.DescribeConfigsSynonym, name=n, value=sv, source=s)
                               for n, sv, s in syn),
                config_type=typ, documentation=doc if docs else None,
                is_default=source == DEFAULT_CONFIG,
            )
            for name, value, ro, source, typ, doc, syn in entries
        )  # fmt: skip
        results.append(
            build(
                mod.DescribeConfigsResult,
                error_code=error,
                error_message=message,
                resource_type=r.resource_type,
                resource_name=r.resource_name,
                configs=configs if v >= 0 else (),
            )  # fmt: skip
        )
    return build(mod.DescribeConfigsResponse, throttle_time=0, results=tuple(results))


def _alter_topic(
    b: Broker, name: str, set_: dict[str, Any], delete: list[str], validate_only: bool
) -> tuple[E, str | None]:
    if b.store.partitions(name) is None:
        return E.unknown_topic_or_partition, f"unknown topic {name!r}"
    if validate_only:
        from store.config import TopicConfig

        merged = {**b.store.topic_overrides(name), **set_}
        for k in delete:
            merged.pop(k, None)
        try:
            TopicConfig.resolve(name, b.store.config, merged)
        except StoreError as exc:
            return E.invalid_config, str(exc)
        return E.none, None
    try:
        b.store.alter_topic_config(name, set_, delete)
    except StoreError as exc:
        return E.invalid_config, str(exc)
    return E.none, None


async def incremental_alter_configs(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(44, req.api_version)
    out = []
    for r in req.body.resources:
        error, message = E.none, None
        if r.resource_type != TOPIC:
            error, message = E.invalid_request, "only topic configs can be changed here"
        elif not b.authorized(conn, req.client_id, r.resource_name, "write"):
            error, message = E.topic_authorization_failed, "no write access to the topic"
        else:
            sets, deletes = [], []
            for c in r.configs:
                key = BY_NAME.get(c.name)
                if c.config_operation in (APPEND, SUBTRACT):
                    error, message = E.invalid_config, f"{c.name} is not a list"
                elif c.config_operation == DELETE:
                    if key is None:
                        error, message = E.invalid_config, f"unknown topic config {c.name!r}"
                    elif key.store_key is not None:
                        deletes.append(key.store_key)
                else:
                    sets.append((c.name, c.value))
            if error == E.none:
                parsed, problem = parse_topic_configs(sets)
                if problem is not None:
                    error, message = E.invalid_config, problem
                else:
                    error, message = _alter_topic(
                        b, r.resource_name, parsed, deletes, req.body.validate_only
                    )
        out.append(
            build(
                mod.AlterConfigsResourceResponse,
                error_code=error,
                error_message=message,
                resource_type=r.resource_type,
                resource_name=r.resource_name,
            )  # fmt: skip
        )
    return build(mod.IncrementalAlterConfigsResponse, throttle_time=0, responses=tuple(out))


async def alter_configs(b: Broker, req: Request, conn: ConnInfo) -> Any:
    """The legacy API: the listed configs become the topic's whole dynamic config."""
    mod = response_module(33, req.api_version)
    out = []
    for r in req.body.resources:
        error, message = E.none, None
        if r.resource_type != TOPIC:
            error, message = E.invalid_request, "only topic configs can be changed here"
        elif not b.authorized(conn, req.client_id, r.resource_name, "write"):
            error, message = E.topic_authorization_failed, "no write access to the topic"
        else:
            parsed, problem = parse_topic_configs([(c.name, c.value) for c in r.configs])
            if problem is not None:
                error, message = E.invalid_config, problem
            elif b.store.partitions(r.resource_name) is None:
                error, message = E.unknown_topic_or_partition, "unknown topic"
            else:
                gone = [k for k in b.store.topic_overrides(r.resource_name) if k not in parsed]
                error, message = _alter_topic(
                    b, r.resource_name, parsed, gone, req.body.validate_only
                )
        out.append(
            build(
                mod.AlterConfigsResourceResponse,
                error_code=error,
                error_message=message,
                resource_type=r.resource_type,
                resource_name=r.resource_name,
            )  # fmt: skip
        )
    return build(mod.AlterConfigsResponse, throttle_time=0, responses=tuple(out))


# --- cluster, log dirs ------------------------------------------------------------------------


async def describe_cluster(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(60, req.api_version)
    node = b.config.node_id
    host = b.config.advertised_host or conn.local_host
    port = conn.local_port or b.port  # the listener the client came in on (plaintext or TLS)
    broker = build(mod.DescribeClusterBroker, broker_id=node, host=host, port=port, rack=None,
                   is_fenced=False)  # fmt: skip
    return build(mod.DescribeClusterResponse, throttle_time=0, error_code=E.none,
                 error_message=None, endpoint_type=1, cluster_id=b.config.cluster_id,
                 controller_id=node, brokers=(broker,),
                 cluster_authorized_operations=INT32_MIN)  # fmt: skip


async def describe_log_dirs(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(35, req.api_version)
    store = b.store
    known = store.topics()
    if req.body.topics is None:
        wanted = {t: list(range(n)) for t, n in known.items()}
    else:
        wanted = {t.topic: [p for p in t.partitions if 0 <= p < known.get(t.topic, 0)]
                  for t in req.body.topics if t.topic in known}  # fmt: skip
    # Kafka answers only for topics the user may describe (leaving the others out)
    wanted = {t: ps for t, ps in wanted.items() if b.authorized(conn, req.client_id, t,
                                                                 "describe", False)}  # fmt: skip
    topics = tuple(
        build(mod.DescribeLogDirsTopic, name=t, partitions=tuple(
            build(mod.DescribeLogDirsPartition, partition_index=p,
                  partition_size=store.partition_size(t, p), offset_lag=0, is_future_key=False)
            for p in parts))
        for t, parts in sorted(wanted.items())
    )  # fmt: skip
    st = os.statvfs(store.log_dir)
    result = build(mod.DescribeLogDirsResult, error_code=E.none, log_dir=str(store.log_dir),
                   topics=topics, total_bytes=st.f_blocks * st.f_frsize,
                   usable_bytes=st.f_bavail * st.f_frsize)  # fmt: skip
    return build(mod.DescribeLogDirsResponse, throttle_time=0, error_code=E.none,
                 results=(result,))  # fmt: skip


# --- groups -----------------------------------------------------------------------------------


def subscribed_topics(metadata: bytes) -> set[str]:
    """Topics of a consumer's ConsumerProtocolSubscription (version, [topic]) ; empty if it is
    not one (another protocol type)."""
    try:
        (n,) = struct.unpack_from(">i", metadata, 2)
        pos, out = 6, set()
        for _ in range(max(n, 0)):
            (ln,) = struct.unpack_from(">h", metadata, pos)
            out.add(metadata[pos + 2 : pos + 2 + ln].decode())
            pos += 2 + ln
        return out
    except (struct.error, UnicodeDecodeError):
        return set()


async def offset_delete(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(47, req.api_version)
    group = req.body.group_id
    g = b.groups.group(group)
    if g is None and group not in b.offsets.groups():
        return build(mod.OffsetDeleteResponse, error_code=E.group_id_not_found, throttle_time=0,
                     topics=())  # fmt: skip
    subscribed: set[str] = set()
    if g is not None and g.members:
        for m in g.members.values():
            for _name, meta in m.protocols:
                subscribed |= subscribed_topics(meta)
    topics, gone = [], []
    for t in req.body.topics:
        parts = []
        for p in t.partitions:
            err = E.group_subscribed_to_topic if t.name in subscribed else E.none
            if not b.authorized(conn, req.client_id, t.name, "read"):  # Kafka: Read on it
                err = E.topic_authorization_failed
            if err == E.none:
                gone.append((t.name, p.partition_index))
            parts.append(build(mod.OffsetDeleteResponsePartition,
                               partition_index=p.partition_index, error_code=err))  # fmt: skip
        topics.append(build(mod.OffsetDeleteResponseTopic, name=t.name, partitions=tuple(parts)))
    await b.offsets.delete(group, gone)
    return build(mod.OffsetDeleteResponse, error_code=E.none, throttle_time=0,
                 topics=tuple(topics))  # fmt: skip


async def delete_groups(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(42, req.api_version)
    results = []
    for group in req.body.groups_names:
        g = b.groups.group(group)
        if g is None and group not in b.offsets.groups():
            err = E.group_id_not_found
        elif g is not None and (g.members or g.pending):
            err = E.non_empty_group
        else:
            err = E.none
            await b.offsets.delete(group, None)
            b.groups.groups.pop(group, None)
        results.append(build(mod.DeletableGroupResult, group_id=group, error_code=err))
    return build(mod.DeleteGroupsResponse, throttle_time=0, results=tuple(results))
