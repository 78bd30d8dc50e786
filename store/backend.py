"""`LogBackend`: what the light queues, delivery, replay and the MQTT proxy need from a log.

Two implementations stand behind it (STYLE 17): `store.Store`, the commitlog in the data dir
(`log = "local"`), and `store.cluster.kafka_log.KafkaLog`, the topics of a Kafka cluster
(`log = "kafka"`, docs/deployment.md). Callers type their log with this Protocol and use
nothing else, so the dispatcher, the resolver, replay backfill and the proxy are the same code
over either.

Reads are synchronous (the dispatcher's rounds and the resolver are plain loops on the event
loop). The local log answers every read from its files. The cluster log answers from memory:
batches it fetched for the tail, or because a reader asked. A read it cannot answer raises
`FetchPending`; the log fetches the range and then calls the append listeners for that
partition (with an unchanged high watermark), which is the cue to read again. Callers that
must not wait for such a cue (delivery of old messages) `await prefetch(...)` first, which
returns once every named offset is in memory (at once for the local log).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from store.mapping import MqttMessage


class FetchPending(LookupError):
    """The bytes at this offset are not in memory; a fetch was started (cluster log only).
    The partition's append listeners run when it completes: read again then."""


AppendListener = Callable[[str, int, int], None]  # (log topic, partition, new high watermark)


@runtime_checkable
class LogBackend(Protocol):
    """The log as its readers and the MQTT proxy see it. Event-loop-only, except `open`/`close`.

    Offsets: readable offsets lie in [log_start_offset, high_watermark). `append_*` return an
    `AppendResult` whose `durable` future resolves when the log acknowledged the records as
    durable (local: the topic's fsync policy; cluster: acks=all), and whose offsets are known
    at once (local) or once `staged` resolves (cluster, remote store).
    """

    #: True when reads may raise FetchPending (the cluster log); readers then prefetch.
    remote_reads: bool

    async def close(self) -> None: ...

    def append_mqtt(self, messages: Sequence[MqttMessage], sync: bool = True) -> object: ...

    def append_batch(
        self, topic: str, partition: int, batch: bytes, sync: bool = True
    ) -> object: ...

    def read(self, topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
        """Whole RecordBatch v2 batches from the one holding `offset`, about `max_bytes` (at
        least one batch); b"" at the high watermark. Raises OffsetOutOfRangeError below the
        log start, FetchPending (cluster) when the bytes are not in memory."""
        ...

    async def prefetch(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Make `read` of each (topic, partition, offset) answer from memory right after this
        returns (batched: one fetch per partition run, not one per offset)."""
        ...

    def high_watermark(self, topic: str, partition: int) -> int: ...

    def log_start_offset(self, topic: str, partition: int) -> int: ...

    def offset_for_timestamp(self, topic: str, partition: int, ts_ms: int) -> int | None:
        """First offset whose timestamp >= ts_ms; None when every record is older."""
        ...

    async def prefetch_times(self, wants: Sequence[tuple[str, int, int]]) -> None:
        """Make `offset_for_timestamp` of each (topic, partition, ts_ms) give the log's own
        answer right after this returns (at once for the local log; the cluster asks it)."""
        ...

    def topics(self) -> dict[str, int]:
        """Log topic -> partition count."""
        ...

    def partitions(self, name: str) -> int | None: ...

    def ensure_topic(self, name: str, partitions: int | None = None) -> int: ...

    def add_append_listener(self, cb: AppendListener) -> None: ...

    def remove_append_listener(self, cb: AppendListener) -> None: ...

    def disk_usage(self) -> dict[str, tuple[int, int]]: ...


__all__ = ["AppendListener", "FetchPending", "LogBackend"]
