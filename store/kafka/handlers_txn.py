"""Transaction APIs: InitProducerId with a transactional id, AddPartitionsToTxn, AddOffsetsToTxn,
TxnOffsetCommit, EndTxn. The state machine and markers are `txn.TransactionCoordinator`'s.

Fencing errors follow Kafka's KafkaApis: PRODUCER_FENCED from the versions that know it
(InitProducerId v4, AddPartitionsToTxn / AddOffsetsToTxn / EndTxn v2, TxnOffsetCommit v3),
INVALID_PRODUCER_EPOCH before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as E

from .handlers_group import MAX_METADATA
from .offsets import CommittedOffset
from .protocol import Request, build, response_module

if TYPE_CHECKING:
    from .broker import Broker, ConnInfo


def _fenced(version: int, since: int) -> int:
    return E.producer_fenced if version >= since else E.invalid_producer_epoch


def _ms(td: Any) -> int:
    return int(td.total_seconds() * 1000) if not isinstance(td, int) else td


async def init_transactional(b: Broker, req: Request) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(22, v)
    err, pid, epoch = await b.txns.init_producer(
        body.transactional_id, _ms(body.transaction_timeout),
        getattr(body, "producer_id", -1), getattr(body, "producer_epoch", -1),
    )  # fmt: skip
    if err == E.producer_fenced:
        err = _fenced(v, 4)
    return build(mod.InitProducerIdResponse, throttle_time=0, error_code=err, producer_id=pid,
                 producer_epoch=epoch)  # fmt: skip


async def add_partitions_to_txn(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(24, v)
    known = b.store.topics()
    wanted = [(t.name, p) for t in body.v3_and_below_topics for p in t.partitions]
    # Write access as for Produce (the whole log topic), then existence, as Kafka checks them.
    may = {t: b.authorized(conn, req.client_id, t, "write") for t in {tp[0] for tp in wanted}}
    denied = {tp for tp in wanted if not may[tp[0]]}
    bad = {tp for tp in wanted if not 0 <= tp[1] < known.get(tp[0], 0)} - denied
    errors: dict[tuple[str, int], int]
    if denied or bad:  # Kafka: the failing ones say why, the rest are not attempted
        errors = {tp: E.topic_authorization_failed if tp in denied
                  else E.unknown_topic_or_partition if tp in bad
                  else E.operation_not_attempted for tp in wanted}  # fmt: skip
    else:
        err = b.txns.add_partitions(
            body.v3_and_below_transactional_id, body.v3_and_below_producer_id,
            body.v3_and_below_producer_epoch, wanted, _fenced(v, 2),
        )  # fmt: skip
        errors = {tp: err for tp in wanted}
    results = tuple(
        build(mod.AddPartitionsToTxnTopicResult, name=t.name, results_by_partition=tuple(
            build(mod.AddPartitionsToTxnPartitionResult, partition_index=p,
                  partition_error_code=errors[(t.name, p)])
            for p in t.partitions))
        for t in body.v3_and_below_topics
    )  # fmt: skip
    return build(mod.AddPartitionsToTxnResponse, throttle_time=0,
                 results_by_topic_v3_and_below=results)  # fmt: skip


async def add_offsets_to_txn(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    err = E.invalid_group_id if not body.group_id else b.txns.add_offsets(
        body.transactional_id, body.producer_id, body.producer_epoch, body.group_id, _fenced(v, 2)
    )  # fmt: skip
    if not err:
        b.groups.ensure_group(body.group_id)
    return build(response_module(25, v).AddOffsetsToTxnResponse, throttle_time=0, error_code=err)


async def txn_offset_commit(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(28, v)
    known = b.store.topics()
    err: int = E.none
    if v >= 3 and body.generation_id >= 0:  # KIP-447: a zombie consumer generation is fenced
        err = b.groups.validate_commit(b.now_ms(), body.group_id, body.generation_id,
                                       body.member_id, body.group_instance_id)  # fmt: skip
    items: list[tuple[tuple[str, int], CommittedOffset]] = []
    errors: dict[tuple[str, int], int] = {}
    for t in body.topics:
        allowed = b.authorized(conn, req.client_id, t.name, "read")  # as OffsetCommit
        for p in t.partitions:
            tp = (t.name, p.partition_index)
            if err:
                errors[tp] = err
            elif not allowed:
                errors[tp] = E.topic_authorization_failed
            elif not 0 <= p.partition_index < known.get(t.name, 0):
                errors[tp] = E.unknown_topic_or_partition
            elif p.committed_metadata and len(p.committed_metadata) > MAX_METADATA:
                errors[tp] = E.offset_metadata_too_large
            else:
                epoch = getattr(p, "committed_leader_epoch", -1)
                items.append((tp, CommittedOffset(p.committed_offset, epoch, p.committed_metadata)))
    if items:
        e = b.txns.txn_offsets(body.transactional_id, body.producer_id, body.producer_epoch,
                               body.group_id, items, _fenced(v, 3))  # fmt: skip
        for tp, _ in items:
            errors[tp] = e
    topics = tuple(
        build(mod.TxnOffsetCommitResponseTopic, name=t.name, partitions=tuple(
            build(mod.TxnOffsetCommitResponsePartition, partition_index=p.partition_index,
                  error_code=errors[(t.name, p.partition_index)])
            for p in t.partitions))
        for t in body.topics
    )  # fmt: skip
    return build(mod.TxnOffsetCommitResponse, throttle_time=0, topics=topics)


async def end_txn(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    err = await b.txns.end_txn(body.transactional_id, body.producer_id, body.producer_epoch,
                               body.committed, _fenced(v, 2))  # fmt: skip
    return build(response_module(26, v).EndTxnResponse, throttle_time=0, error_code=err)
