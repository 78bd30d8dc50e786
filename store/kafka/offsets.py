"""Committed consumer-group offsets, persisted under DATA/kafka/ (Kafka's __consumer_offsets role).

Layout: `offsets.snapshot` (JSON, written tmp + fsync + rename) plus `offsets.journal`, one JSON
line per committed partition appended after it. Opening replays snapshot then journal (a torn last
line from a crash is ignored); whenever the journal reaches 100k lines (and on open and close)
both are folded into a new snapshot.
A commit is acknowledged only after its journal lines are fsynced: acknowledged means durable.

If we crash while compacting:
1. before the rename: the old snapshot + journal are intact; the tmp file is discarded on open.
2. after the rename, before the journal is truncated: replaying the (old) journal over the new
   snapshot re-applies the same values, which is idempotent.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CommittedOffset", "OffsetStore"]

_COMPACT_LINES = 100_000


@dataclass(frozen=True, slots=True)
class CommittedOffset:
    offset: int
    leader_epoch: int
    metadata: str | None


Key = tuple[str, str, int]  # (group, topic, partition)


class OffsetStore:
    """Event-loop-only. `commit` writes synchronously (page cache) and fsyncs off the loop."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self._snapshot = self.dir / "offsets.snapshot"
        self._journal = self.dir / "offsets.journal"
        self._offsets: dict[Key, CommittedOffset] = {}
        self._journal_lines = 0
        self._load()
        self._fd = os.open(self._journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _load(self) -> None:
        (self.dir / "offsets.snapshot.tmp").unlink(missing_ok=True)
        if self._snapshot.exists():
            for row in json.loads(self._snapshot.read_text()):
                self._apply(row)
        lines = 0
        if self._journal.exists():
            with self._journal.open("rb") as f:
                for line in f:
                    try:
                        self._apply(json.loads(line))
                    except ValueError:
                        break  # torn tail of a crash
                    lines += 1
        self._journal_lines = lines
        if lines >= _COMPACT_LINES or (lines and not self._snapshot.exists()):
            self._compact()

    def _apply(self, row: list) -> None:
        group, topic, partition, offset, epoch, metadata = row
        if offset is None:  # a deletion (OffsetDelete, DeleteGroups, DeleteTopics)
            self._offsets.pop((group, topic, partition), None)
        else:
            self._offsets[(group, topic, partition)] = CommittedOffset(offset, epoch, metadata)

    def _compact(self) -> None:
        tmp = self.dir / "offsets.snapshot.tmp"
        rows = [
            [g, t, p, c.offset, c.leader_epoch, c.metadata]
            for (g, t, p), c in self._offsets.items()
        ]
        with tmp.open("w") as f:
            json.dump(rows, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snapshot)
        os.truncate(self._journal, 0)  # O_APPEND: later writes start at the new end
        self._journal_lines = 0
        dfd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def get(self, group: str, topic: str, partition: int) -> CommittedOffset | None:
        return self._offsets.get((group, topic, partition))

    def groups(self) -> set[str]:
        return {g for g, _, _ in self._offsets}

    def partitions(self, group: str) -> dict[tuple[str, int], CommittedOffset]:
        return {(t, p): c for (g, t, p), c in self._offsets.items() if g == group}

    async def commit(self, group: str, items: list[tuple[str, int, CommittedOffset]]) -> None:
        """Record offsets; returns once they are on disk."""
        if not items:
            return
        lines = []
        for topic, partition, c in items:
            self._offsets[(group, topic, partition)] = c
            lines.append(
                json.dumps([group, topic, partition, c.offset, c.leader_epoch, c.metadata])
            )
        os.write(self._fd, ("\n".join(lines) + "\n").encode())
        self._journal_lines += len(lines)
        if self._journal_lines >= _COMPACT_LINES:  # the snapshot holds these values, fsynced
            self._compact()
            return
        await asyncio.get_running_loop().run_in_executor(None, os.fsync, self._fd)

    async def delete(self, group: str | None, keys: list[tuple[str, int]] | None,
                     topic: str | None = None) -> int:  # fmt: skip
        """Remove committed offsets, durably: `keys` of `group`, or (None) the whole group, or
        with `topic` that topic in every group. Returns how many went."""
        doomed = [
            k for k in self._offsets
            if (group is None or k[0] == group)
            and (topic is None or k[1] == topic)
            and (keys is None or (k[1], k[2]) in keys)
        ]  # fmt: skip
        if not doomed:
            return 0
        lines = [json.dumps([g, t, p, None, -1, None]) for g, t, p in doomed]
        for k in doomed:
            del self._offsets[k]
        os.write(self._fd, ("\n".join(lines) + "\n").encode())
        self._journal_lines += len(lines)
        await asyncio.get_running_loop().run_in_executor(None, os.fsync, self._fd)
        return len(doomed)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._compact()
