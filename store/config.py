"""Store configuration (store-wide defaults, per-topic overrides) and the store's errors."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

FSYNC_POLICIES = ("always", "interval_ms", "never")
# Partitions one topic may have: each is a directory and open segment files, so a CreateTopics
# or CreatePartitions asking for millions (one request, from anyone) must be refused rather
# than tried. The same bound as `default_partitions`.
MAX_PARTITIONS = 1024
TOPIC_KEYS = (
    "fsync", "fsync_interval_ms", "segment_bytes", "segment_ms", "retention_ms", "retention_bytes",
)  # fmt: skip


class StoreError(Exception):
    """The store cannot do what was asked (I/O failure, poisoned partition, bad argument)."""


class StoreLockedError(StoreError):
    """Another process holds DATA/LOCK."""


class UnknownTopicOrPartitionError(StoreError):
    pass


@dataclass(slots=True)
class StoreConfig:
    """Defaults for new topics (per-topic overrides live in topics.json) and store-wide knobs."""

    default_partitions: int = 4
    fsync: str = "always"
    fsync_interval_ms: int = 200  # lightgate/config.py documents the default
    segment_bytes: int = 256 << 20
    segment_ms: int = 7 * 24 * 3600 * 1000
    retention_ms: int = 7 * 24 * 3600 * 1000
    retention_bytes: int = -1
    retention_check_interval_ms: int = 60_000
    index_interval_bytes: int = 4096
    max_batch_bytes: int = 8 << 20
    auto_create_topics: bool = True

    @classmethod
    def from_object(cls, obj: Any) -> StoreConfig:
        """Pick the matching attributes of any config object (e.g. lightgate's GatewayConfig)."""
        kw = {f.name: getattr(obj, f.name) for f in fields(cls) if hasattr(obj, f.name)}
        return cls(**kw)


@dataclass(slots=True)
class TopicConfig:
    """Effective config of one topic: store defaults with its overrides applied."""

    fsync: str
    fsync_interval_ms: int
    segment_bytes: int
    segment_ms: int
    retention_ms: int
    retention_bytes: int

    @classmethod
    def resolve(cls, name: str, defaults: StoreConfig, overrides: dict[str, Any]) -> TopicConfig:
        unknown = set(overrides) - set(TOPIC_KEYS)
        if unknown:
            raise StoreError(f"topic {name}: unknown config keys {sorted(unknown)}")
        base = {k: getattr(defaults, k) for k in TOPIC_KEYS}
        base.update(overrides)
        tc = cls(**base)
        if tc.fsync not in FSYNC_POLICIES:
            raise StoreError(f"topic {name}: fsync policy {tc.fsync!r} not one of {FSYNC_POLICIES}")
        return tc
