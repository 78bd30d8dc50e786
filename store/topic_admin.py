"""Topic administration: delete a topic, delete records, add partitions, change a topic's config.

What Kafka's admin APIs (DeleteTopics, DeleteRecords, CreatePartitions, IncrementalAlterConfigs)
do to the log, for `Store`, which holds a `TopicAdmin` (event-loop-only, like the rest of it). Each change is made
durable before it is visible to others, and listeners (`add_topic_listener`) hear of it, so that
derived data (light queues, retained messages, the proxies' partition counts, Kafka group offsets)
can follow:

- `"deleted"`: the topic is gone; a later create of the same name is a new topic whose offsets
  start at 0 again, so nothing may keep pointing at the old offsets.
- `"partitions"`: the partition count grew; MQTT topics are routed by `hash % count`, so from now
  on an MQTT topic may land in another partition than before (per-topic order holds within each
  count, as Kafka's key order does across CreatePartitions).
- `"config"`: a per-topic config changed; it applies at once (retention at its next check).

Deleting a topic, if we crash:
  1. before `topics.json` is rewritten: the topic is still there, nothing happened;
  2. after it, before a directory is renamed: recovery finds directories of a topic `topics.json`
     does not name; they are renamed `*-delete` and removed (`remove_orphans`);
  3. after the renames: recovery removes the `*-delete` directories.
DeleteRecords writes `log-start-offset` (fsynced) before deleting the segments below it; a crash
in between leaves segments below the floor that the floor hides and the next call deletes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store.config import (
    MAX_PARTITIONS,
    StoreConfig,
    StoreError,
    TopicConfig,
    UnknownTopicOrPartitionError,
)
from store.durable_files import delete_segment_files, fsync_dir, write_text_atomic
from store.log import LOG_START_FILE, Log, OffsetOutOfRangeError

if TYPE_CHECKING:
    from store.commit import GroupCommit
    from store.txn_index import TxnIndex

log = logging.getLogger("lightgate.store")

DELETE_SUFFIX = "-delete"  # a deleted topic's partition directory, removed in the background
TopicListener = Callable[[str, str], None]  # (event, topic)


def _remove_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def remove_orphans(log_dir: Path, topics: dict[str, Any]) -> int:
    """Recovery: remove deleted topics' directories (`*-delete`, or of a topic `topics.json` no
    longer names). Worker thread, before the store opens its logs; returns directories removed."""
    n = 0
    for name in os.listdir(log_dir):
        path = log_dir / name
        if not path.is_dir():
            continue
        topic, _, part = name.rpartition("-")
        if name.endswith(DELETE_SUFFIX) or (part.isdigit() and topic and topic not in topics):
            log.info("removing the directory %s of a deleted topic", name)
            _remove_dir(path)
            n += 1
    return n


class TopicAdmin:
    """The admin operations `Store` delegates to. It works on the store's topic tables (dicts
    the store mutates in place, never rebinds): `topics` (topics.json's entries), `counts`,
    `tconf`, `logs` and the MQTT-topic `routes` cache; `register`, `save_topics` and `lookup`
    are the store's own steps for a topic's entry, topics.json and a partition's Log."""

    def __init__(
        self,
        config: StoreConfig,
        log_dir: Path,
        *,
        topics: dict[str, dict[str, Any]],
        counts: dict[str, int],
        tconf: dict[str, TopicConfig],
        logs: dict[tuple[str, int], Log],
        routes: dict[str, Any],
        commit: GroupCommit,
        txn_index: TxnIndex,
        bg: ThreadPoolExecutor,
        register: Callable[[str, int, dict[str, Any], str | None], None],
        save_topics: Callable[[], None],
        lookup: Callable[[str, int], Log],
    ) -> None:
        self.config = config
        self.log_dir = log_dir
        self._topics = topics
        self._counts = counts
        self._tconf = tconf
        self._logs = logs
        self._routes = routes
        self._commit = commit
        self.txn_index = txn_index
        self._bg = bg
        self._register = register
        self._save_topics = save_topics
        self._log = lookup
        self._topic_listeners: list[TopicListener] = []

    def add_topic_listener(self, cb: TopicListener) -> None:
        """cb(event, topic) after a topic is deleted, grows partitions or changes config."""
        self._topic_listeners.append(cb)

    def remove_topic_listener(self, cb: TopicListener) -> None:
        self._topic_listeners.remove(cb)

    def _tell(self, event: str, topic: str) -> None:
        for cb in list(self._topic_listeners):
            try:
                cb(event, topic)
            except Exception:
                log.exception("topic listener failed on %s %s", event, topic)

    async def _quiesce(self, logs: list[Log]) -> None:
        """Until none of `logs` has staged batches or an fsync in flight."""
        while any(lg.has_pending or lg.syncing or lg.sync_waiters for lg in logs):
            await self._commit.drain()
            await asyncio.sleep(0)

    def topic_uuid(self, name: str) -> uuid.UUID:
        """Kafka's topic id: new for every topic created (a deleted and re-created name gets
        another), derived from the name for topics created before ids were kept."""
        raw = self._topics[name].get("id") if name in self._topics else None
        if raw is None:
            return uuid.uuid5(uuid.NAMESPACE_URL, f"lightgate:topic:{name}")
        return uuid.UUID(raw)

    def max_timestamp(self, topic: str, partition: int) -> int:
        """Largest record timestamp of the partition, -1 if it is empty."""
        return self._log(topic, partition).max_timestamp()

    def partition_size(self, topic: str, partition: int) -> int:
        """Bytes of the partition's segments."""
        return self._log(topic, partition).size_bytes()

    def topic_overrides(self, name: str) -> dict[str, Any]:
        """The per-topic config set on `name` (dynamic topic config), without defaults."""
        if name not in self._topics:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        return dict(self._topics[name]["config"])

    async def delete_topic(self, name: str) -> None:
        """Remove a topic and its data (see the module docstring for the crash points)."""
        if name not in self._counts:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        logs = [self._logs[(name, p)] for p in range(self._counts[name])]
        await self._quiesce(logs)
        if name not in self._counts:  # deleted by a concurrent call meanwhile
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        del self._topics[name], self._counts[name], self._tconf[name]
        for p in range(len(logs)):
            del self._logs[(name, p)]
        self._commit.interval_dirty.difference_update(logs)  # no fsync of closed files later
        self._routes.clear()
        self._save_topics()
        tag = uuid.uuid4().hex[:8]
        for lg in logs:
            lg.close()
            gone = lg.dir.with_name(f"{lg.dir.name}.{tag}{DELETE_SUFFIX}")
            try:
                os.rename(lg.dir, gone)
            except FileNotFoundError:
                continue
            f: Future[None] = self._bg.submit(_remove_dir, gone)
            f.add_done_callback(functools.partial(log_failure, what=f"deleting {gone.name}"))
        fsync_dir(self.log_dir)
        self.txn_index.forget_topic(name)
        log.info("deleted topic %s (%d partitions)", name, len(logs))
        self._tell("deleted", name)

    async def delete_records(self, topic: str, partition: int, offset: int) -> int:
        """Move the log start to `offset` (-1: the high watermark); returns the new log start.
        Offsets below it are gone for every reader; an offset past the end is out of range."""
        lg = self._log(topic, partition)
        if offset == -1:
            offset = lg.hwm
        if offset < 0 or offset > lg.hwm:
            raise OffsetOutOfRangeError(topic, partition, offset, lg.log_start_offset, lg.hwm)
        if offset <= lg.log_start_offset:
            return lg.log_start_offset
        await self._quiesce([lg])
        if self._logs.get((topic, partition)) is not lg:  # DeleteTopics won the race meanwhile
            raise UnknownTopicOrPartitionError(f"topic {topic!r} was deleted")
        doomed = lg.delete_records_below(offset)
        # On the store's single background thread: concurrent DeleteRecords of one partition
        # write in the order they moved the floor (two threads shared the temporary file).
        write = self._bg.submit(write_text_atomic, lg.dir / LOG_START_FILE, str(lg.start_floor))
        try:
            await asyncio.wrap_future(write)
        except FileNotFoundError:
            if self._logs.get((topic, partition)) is lg:
                raise
            raise UnknownTopicOrPartitionError(f"topic {topic!r} was deleted") from None
        for seg in doomed:
            f = self._bg.submit(delete_segment_files, seg)
            f.add_done_callback(functools.partial(log_failure, what=f"deleting in {lg.name}"))
        log.info("delete records: log start of %s now %d", lg.name, lg.log_start_offset)
        self._tell("start", topic)
        return lg.log_start_offset

    def create_partitions(self, name: str, count: int) -> None:
        """Grow `name` to `count` partitions (never shrink, as Kafka)."""
        n = self._counts.get(name)
        if n is None:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        if count <= n:
            raise StoreError(f"topic {name!r} has {n} partitions; the new count must be larger")
        if count > MAX_PARTITIONS:
            raise StoreError(f"topic {name!r}: at most {MAX_PARTITIONS} partitions, asked {count}")
        entry = self._topics[name]
        self._register(name, count, entry["config"], entry.get("id"))
        try:
            for p in range(n, count):
                self._logs[(name, p)].load(clean=False)
        except OSError as exc:  # out of files or disk: back to the old count
            for p in range(n, count):
                self._logs.pop((name, p)).close()
            self._register(name, n, entry["config"], entry.get("id"))
            raise StoreError(f"cannot add partitions to {name!r}: {exc}") from exc
        self._routes.clear()
        self._save_topics()
        fsync_dir(self.log_dir)
        self._tell("partitions", name)

    def alter_topic_config(
        self, name: str, set_: dict[str, Any], delete: list[str] | None = None
    ) -> TopicConfig:
        """Set and/or remove per-topic overrides (keys of TopicConfig); validated as a whole,
        persisted, applied at once."""
        if name not in self._topics:
            raise UnknownTopicOrPartitionError(f"unknown topic {name!r}")
        overrides = dict(self._topics[name]["config"])
        for k in delete or ():
            overrides.pop(k, None)
        overrides.update(set_)
        tc = TopicConfig.resolve(name, self.config, overrides)
        self._topics[name]["config"] = overrides
        self._tconf[name] = tc
        for p in range(self._counts[name]):
            lg = self._logs[(name, p)]
            lg.segment_bytes, lg.segment_ms = tc.segment_bytes, tc.segment_ms
        self._save_topics()
        self._tell("config", name)
        return tc


def log_failure(fut: Future[Any], what: str) -> None:
    """Done-callback of a background file operation: log what failed (the store goes on)."""
    exc = fut.exception()
    if exc is not None:
        log.error("%s failed: %s", what, exc)
