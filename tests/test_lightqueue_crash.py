"""kill -9 during dispatch, restart: the queues equal a clean rebuild from the log.

LevelDB runs with sync=False: the crash proof is that every dispatch round (entries, queue
metadata, checkpoint) is one WriteBatch, so whatever prefix of rounds survives, re-dispatch from
its checkpoint reproduces the rest with no duplicate and no gap.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from lightqueue_crash_child import BATCH_RECORDS, FILTERS, PARTITIONS
from lightqueue_helpers import open_all, queue_dump, raw_dump

from lightqueue.dispatch_rules import mqtt_topic_of
from lightqueue.keys import KIND_EXACT
from lightqueue.rebuild import rebuild_queues
from lightqueue.topic_trie import topic_matches
from store import Store, StoreConfig
from store.record_batch import iter_batches, iter_records

CHILD = Path(__file__).with_name("lightqueue_crash_child.py")


def run_child(data: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(data), mode],
        stdout=subprocess.PIPE,
        text=True,
    )


def kill9(p: subprocess.Popen[str]) -> None:
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)
    assert p.stdout is not None
    p.stdout.close()


def wait_dispatched(p: subprocess.Popen[str], at_least: int, timeout: float = 60) -> int:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            raise AssertionError(f"child exited with {p.poll()}")
        if line.startswith("dispatched") and int(line.split()[1]) >= at_least:
            return int(line.split()[1])
    raise AssertionError("child too slow")


async def reopen_and_catch_up(data: Path) -> tuple[Any, dict[bytes, bytes], int]:
    """Restart as `serve` would; returns the dumps and the position the crash left."""
    store, lq = await open_all(data, partitions=PARTITIONS, dispatch_batch_records=BATCH_RECORDS)
    for f in FILTERS:
        lq.acquire_filter(f)
    crashed_at = sum(lq.qdb.checkpoints.values())
    lq.dispatcher.refresh()
    lq.dispatcher.repair()
    lq.dispatcher.catch_up()
    dump = queue_dump(lq)
    raw = raw_dump(lq.qdb.db)
    await lq.close()
    await store.close()
    return dump, raw, crashed_at


async def rebuilt_copy(data: Path, copy: Path) -> tuple[Any, dict[bytes, bytes]]:
    shutil.copytree(data, copy)
    (copy / "LOCK").unlink(missing_ok=True)
    phases: list[str] = []
    await rebuild_queues(
        copy,
        progress=lambda pr: phases.append(pr.phase),
        store_config=StoreConfig(default_partitions=PARTITIONS, fsync="never"),
        batch_records=BATCH_RECORDS,
    )
    assert "index" in phases
    store, lq = await open_all(copy, partitions=PARTITIONS)
    dump, raw = queue_dump(lq), raw_dump(lq.qdb.db)
    await lq.close()
    await store.close()
    return dump, raw


@pytest.mark.slow
async def test_kill9_mid_backlog_dispatch_is_identical_to_rebuild(tmp_path: Path) -> None:
    """Deterministic case: the whole backlog is in the log before dispatch starts, so the
    restarted dispatcher must produce the very same bytes as one clean rebuild."""
    data = tmp_path / "data"
    data.mkdir()
    for i in range(1, 4):
        p = run_child(data, "backlog")
        wait_dispatched(p, 60_000 * i // 5)
        kill9(p)  # the child is dispatching as fast as it can: mid-round in all likelihood
    dump, raw, crashed_at = await reopen_and_catch_up(data)
    assert 3 * 60_000 // 5 <= crashed_at < 60_000  # the last kill left work to redo
    rdump, rraw = await rebuilt_copy(data, tmp_path / "copy")
    assert sum(v[2] for k, v in dump.items() if v[0] == KIND_EXACT) == 60_000
    assert dump == rdump
    assert raw == rraw  # byte for byte: entries, queue metadata, checkpoints


def log_records(data: Path) -> list[tuple[str, int, int, str]]:
    """(log topic, partition, offset, MQTT topic) of every record, brute force."""

    async def scan() -> list[tuple[str, int, int, str]]:
        store = await Store.open(data, StoreConfig(default_partitions=PARTITIONS, fsync="never"))
        out = []
        for t, n in sorted(store.topics().items()):
            for p in range(n):
                o = store.log_start_offset(t, p)
                while o < store.high_watermark(t, p):
                    data_ = store.read(t, p, o, 1 << 20)
                    for pos, size in iter_batches(data_):
                        for r in iter_records(memoryview(data_)[pos : pos + size]):
                            if r.offset >= o:
                                out.append((t, p, r.offset, mqtt_topic_of(t, r.key)))
                                o = r.offset + 1
        await store.close()
        return out

    return asyncio.run(scan())


@pytest.mark.slow
def test_kill9_while_appending_no_gap_no_duplicate(tmp_path: Path) -> None:
    """Appends and dispatch interleaved, killed at random moments, three times."""
    data = tmp_path / "data"
    data.mkdir()
    rnd = random.Random()
    for _ in range(3):
        p = run_child(data, "live")
        wait_dispatched(p, 1)
        time.sleep(rnd.uniform(0.2, 1.0))
        kill9(p)
    dump, _raw, _ = asyncio.run(reopen_and_catch_up(data))
    records = log_records(data)
    assert len(records) > 1000
    by_topic: dict[str, list[tuple[str, int, int]]] = {}
    for t, p, o, mt in records:
        by_topic.setdefault(mt, []).append((t, p, o))
    # Exact queues: every record of the topic, in log order, seqs 0..n-1 (no gap, no dup).
    for mt, recs in by_topic.items():
        kind, start, nxt, entries = dump[mt]
        assert (start, nxt) == (0, len(recs))
        assert [tuple(e) for e in entries] == recs
    # Filter queues (created before the first record): all matching records exactly once, in
    # log order within each partition.
    for f in FILTERS:
        kind, start, nxt, entries = dump[f]
        want = [(t, p, o) for t, p, o, mt in records if topic_matches(f, mt)]
        got = [tuple(e) for e in entries]
        assert (start, nxt) == (0, len(want))
        assert sorted(got) == sorted(want)
        for tp in {(t, p) for t, p, _ in want}:
            assert [g for g in got if g[:2] == tp] == [w for w in want if w[:2] == tp]
    # And a clean rebuild agrees: exact queues entry for entry, filter queues as sets.
    rdump, _ = asyncio.run(rebuilt_copy(data, tmp_path / "copy"))
    assert set(rdump) == set(dump)
    for name, (kind, start, nxt, entries) in dump.items():
        r = rdump[name]
        assert (r[0], r[1], r[2]) == (kind, start, nxt)
        if kind == KIND_EXACT:
            assert r[3] == entries
        else:
            assert sorted(r[3]) == sorted(entries)
