"""The Produce API: validate each partition's batch, de-duplicate (idempotent producers), check
transactional ones, append, and answer once the appends are durable under the fsync policy.

`stage_produce` does the appends synchronously, in request order; the connection writes the
response from the durability futures' callbacks (connection.py), `produce` is the task form.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as E

from store.record_batch import (
    CONTROL_MASK,
    HEADER_SIZE,
    MAGIC_V2,
    TRANSACTIONAL_MASK,
    InvalidRecordError,
    check_batch,
    check_records,
    parse_header,
)
from store.store import StoreError, UnknownTopicOrPartitionError

from .protocol import CloseConnection, Request, build, response_module

if TYPE_CHECKING:
    from .broker import Broker, ConnInfo


def _validate_records(records: bytes | None, transactional: bool) -> str | None:
    """Kafka's ProduceRequest rule for v3+: exactly one magic-2 batch, transactional exactly
    when the request has a transactional id, never a control batch."""
    if not records or len(records) < HEADER_SIZE:
        return "a produce request partition must hold exactly one record batch"
    h = parse_header(records)
    if h.magic != MAGIC_V2:
        return f"magic {h.magic} batches are not accepted (RecordBatch v2 only)"
    if h.batch_length + 12 != len(records):
        return None if h.batch_length + 12 > len(records) else "more than one record batch"
    if h.attributes & CONTROL_MASK:
        return "control batches are written by the transaction coordinator only"
    if bool(h.attributes & TRANSACTIONAL_MASK) != transactional:
        return "transactional batches need a transactional id, and only they may have one"
    return None


class StagedProduce:
    """A Produce request whose appends are done: the response is ready once `waits` are.

    `stage_produce` does every append synchronously (so appends keep request order), and
    `response()` builds the answer after the durability futures in `waits` have resolved; the
    connection can then write it from the futures' callbacks, without a task in between.
    """

    __slots__ = ("version", "acks", "results", "waits")

    def __init__(self, version: int, acks: int) -> None:
        self.version = version
        self.acks = acks
        self.results: list[tuple[str, list[list[Any]]]] = []
        self.waits: list[asyncio.Future[None]] = []  # acks=1/all: durable under the fsync policy

    def response(self) -> Any:
        """The ProduceResponse (None for acks=0); call when every future in `waits` is done.

        Raises CloseConnection for a failed acks=0 produce (Kafka drops the connection instead).
        """
        if self.acks == 0:
            if any(part[1] for _, parts in self.results for part in parts):
                raise CloseConnection("acks=0 produce failed")
            return None
        mod = response_module(0, self.version)
        for _, parts in self.results:
            for part in parts:
                fut = part[5]
                if fut is not None and (fut.cancelled() or fut.exception() is not None):
                    part[1], part[2] = E.kafka_storage_error, -1
        return build(
            mod.ProduceResponse,
            throttle_time=0,
            responses=tuple(
                build(mod.TopicProduceResponse, name=name, partition_responses=tuple(
                    build(mod.PartitionProduceResponse, index=i, error_code=err,
                          base_offset=base, log_append_time=-1, log_start_offset=ls,
                          record_errors=(), error_message=msg)
                    for i, err, base, ls, msg, _ in parts))
                for name, parts in self.results
            ),
        )  # fmt: skip


def stage_produce(b: Broker, req: Request, conn: ConnInfo) -> StagedProduce:
    """Validate and append every partition of a Produce request, in order, before returning."""
    body = req.body
    acks = body.acks
    staged = StagedProduce(req.api_version, acks)
    known = b.store.topics()
    tid = body.transactional_id
    for topic in body.topic_data:
        count = known.get(topic.name)
        allowed = b.authorized(conn, req.client_id, topic.name, "write")
        parts = []
        for pd in topic.partition_data:
            err: int = E.none
            base, message, durable = -1, None, None
            if acks not in (0, 1, -1):
                err = E.invalid_required_acks
            elif not allowed:  # checked before existence, as Kafka does
                err = E.topic_authorization_failed
            elif count is None or not 0 <= pd.index < count:
                err = E.unknown_topic_or_partition
            elif (message := _validate_records(pd.records, tid is not None)) is not None:
                err = E.invalid_record
            elif tid is not None and (err := _check_txn(b, tid, topic.name, pd.index, pd.records)):
                pass
            else:
                err, base, message, durable = _append(
                    b, topic.name, pd.index, pd.records, acks != 0
                )
                if durable is not None and acks != 0:
                    staged.waits.append(durable)
            log_start = b.store.log_start_offset(topic.name, pd.index) if err == E.none else -1
            parts.append([pd.index, err, base, log_start, message, durable])
        staged.results.append((topic.name, parts))
    return staged


def _check_txn(b: Broker, tid: str, topic: str, partition: int, records: bytes) -> int:
    """A transactional batch: its producer must hold the id's current epoch and have added the
    partition to its ongoing transaction (so recovery knows every partition with its data)."""
    h = parse_header(records)
    return b.txns.check_produce(tid, h.producer_id, h.producer_epoch, (topic, partition))


async def produce(b: Broker, req: Request, conn: ConnInfo) -> Any:
    staged = stage_produce(b, req, conn)
    if staged.waits:
        # not gather: cancelling us must not cancel the store's futures
        await asyncio.wait(staged.waits)
    return staged.response()


def _append(
    b: Broker, topic: str, partition: int, records: bytes, sync: bool = True
) -> tuple[int, int, str | None, asyncio.Future[None] | None]:
    """De-duplicate, append; (error, base offset, message, future of durability)."""
    h = parse_header(records)
    err, dup = b.producers.check(topic, partition, h)
    if err:
        return err, -1, None, None
    if dup is not None:  # a retry of an appended batch: the original offset, no second copy
        return E.none, dup, None, b.last_durable(topic, partition)
    if len(records) > b.store.config.max_batch_bytes:
        return E.message_too_large, -1, "batch larger than the store's max_batch_bytes", None
    try:
        check_batch(records)  # CRC first: the cheaper check names the likelier damage
        check_records(records)
        result = b.store.append_batch(topic, partition, records, sync)
    except InvalidRecordError as exc:
        return E.corrupt_message, -1, str(exc), None
    except UnknownTopicOrPartitionError as exc:
        return E.unknown_topic_or_partition, -1, str(exc), None
    except StoreError as exc:  # partition offline after a failed fsync
        return E.kafka_storage_error, -1, str(exc), None
    assert result.runs is not None
    base = result.runs[0][2]
    b.counters["produce_bytes"] += len(records)
    b.counters["produce_records"] += h.record_count
    b.producers.record(topic, partition, h, base)
    b.note_durable(topic, partition, result.durable)
    return E.none, base, None, result.durable
