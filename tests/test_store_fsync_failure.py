"""An fsync that fails (EIO from the disk) under `fsync = always`: the appends waiting on it are
told (their `durable` fails, nothing is acknowledged), the partition goes offline until restart
(docs/storage.md, step 4), the gateway's other partitions carry on, and later syncs still
complete through the same fsync workers. The failure is injected at the OS call, the only
fault the disk can give us here: through `os.fdatasync` for the Python fsync threads, and for
the compiled ones (store/_fsync.pyx, which call fdatasync(2) themselves) by putting a pipe, which
fdatasync refuses (EINVAL), in the segment's descriptor."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from kafka_helpers import make_batch

import store.commit as commit
from store import Store, StoreConfig, StoreError
from store.twins import use_pure


@pytest.fixture
def python_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stores opened in this test fsync from Python threads (os.fdatasync can be patched)."""
    use_pure(monkeypatch.setattr, ["store._fsync.FsyncPool"])


async def test_failed_fsync_fails_its_waiters_and_takes_the_partition_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync_impl: str
) -> None:
    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    pipe: tuple[int, int] | None = None
    try:
        assert (store._commit._io._pool is None) == (fsync_impl == "python")
        store.ensure_topic("t", 2)
        await asyncio.wait_for(store.append_batch("t", 0, make_batch([b"a"])).durable, 10)
        real = os.fdatasync
        bad = store._log("t", 0).segments[-1].fd  # partition 0's active segment
        if fsync_impl == "python":

            def fdatasync(fd: int) -> None:
                if fd == bad:
                    raise OSError(errno.EIO, "Input/output error")
                real(fd)

            monkeypatch.setattr(commit.os, "fdatasync", fdatasync)
        else:
            pipe = os.pipe()
            saved = os.dup(bad)
            os.dup2(pipe[1], bad)  # the next write goes to the pipe, the fdatasync fails
        failing = store.append_batch("t", 0, make_batch([b"b"]))
        healthy = store.append_batch("t", 1, make_batch([b"c"]))
        with pytest.raises(StoreError, match="fsync of t-0 failed"):
            await asyncio.wait_for(failing.durable, 10)
        await asyncio.wait_for(healthy.durable, 10)  # the other partition is not affected
        with pytest.raises(StoreError, match="offline"):
            store.append_batch("t", 0, make_batch([b"d"]))
        if fsync_impl == "python":
            monkeypatch.setattr(commit.os, "fdatasync", real)
        else:
            os.dup2(saved, bad)  # the segment's own file again, for close
            os.close(saved)
        for i in range(20):  # the workers still serve later syncs
            await asyncio.wait_for(store.append_batch("t", 1, make_batch([b"%d" % i])).durable, 10)
    finally:
        await store.close()
        if pipe is not None:
            os.close(pipe[0])
            os.close(pipe[1])


def _hold_first_fsync(monkeypatch: pytest.MonkeyPatch, fd: int, fail: bool = False) -> Any:
    """The next fdatasync of `fd` waits for the returned event (then fails with EIO if `fail`);
    later ones run at once. Records the order of fdatasync starts and ends on `fd`."""
    real = os.fdatasync
    release = threading.Event()
    calls: list[str] = []
    first = [True]

    def fdatasync(f: int) -> None:
        if f != fd:
            real(f)
            return
        held, first[0] = first[0], False
        calls.append("start")
        if held:
            release.wait(10)
            calls.append("end held")
            if fail:
                raise OSError(errno.EIO, "Input/output error")
        real(f)
        if not held:
            calls.append("end")

    monkeypatch.setattr(commit.os, "fdatasync", fdatasync)
    return release, calls


async def _until(cond: Any) -> None:
    for _ in range(500):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def _two_rounds(store: Store, monkeypatch: pytest.MonkeyPatch, fail: bool) -> Any:
    """Two appends to t-0 whose fsyncs overlap: the first's is held, the second's has ended."""
    store.ensure_topic("t", 1)
    await asyncio.wait_for(store.append_batch("t", 0, make_batch([b"a"])).durable, 10)
    release, calls = _hold_first_fsync(monkeypatch, store._log("t", 0).segments[-1].fd, fail)
    first = store.append_batch("t", 0, make_batch([b"b"]))
    await _until(lambda: calls == ["start"])
    await asyncio.sleep(2 * commit.OVERLAP_AFTER_S)  # the held round is old enough to overlap
    second = store.append_batch("t", 0, make_batch([b"c"]))
    await _until(lambda: calls == ["start", "start", "end"])  # overlapped, ended first
    return first, second, release, calls


async def test_overlapping_fsync_rounds_resolve_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_fsync: None
) -> None:
    """A second fsync of a partition starts while the first runs (its waiters need not wait for
    the first to end before theirs starts), but they are told only once every earlier round has
    ended too: an earlier round may carry what a later one relies on (a new segment's directory
    entry, the bytes before theirs)."""
    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    try:
        first, second, release, calls = await _two_rounds(store, monkeypatch, fail=False)
        await asyncio.sleep(0.05)
        assert not first.durable.done() and not second.durable.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(first.durable, second.durable), 10)
        assert calls == ["start", "start", "end", "end held"]
    finally:
        await store.close()


async def test_a_failed_round_fails_the_later_rounds_that_ended_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_fsync: None
) -> None:
    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    try:
        first, second, release, calls = await _two_rounds(store, monkeypatch, fail=True)
        release.set()
        for append in (first, second):
            with pytest.raises(StoreError, match="fsync of t-0 failed"):
                await asyncio.wait_for(append.durable, 10)
        with pytest.raises(StoreError, match="offline"):
            store.append_batch("t", 0, make_batch([b"d"]))
    finally:
        await store.close()


async def test_a_young_fsync_round_is_not_overlapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_fsync: None
) -> None:
    """Data written while the partition's fsync has run less than OVERLAP_AFTER_S waits for
    it and goes in the next round, started by its completion (a fast disk: no extra fsyncs)."""
    monkeypatch.setattr(commit, "OVERLAP_AFTER_S", 60.0)
    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    try:
        store.ensure_topic("t", 1)
        await asyncio.wait_for(store.append_batch("t", 0, make_batch([b"a"])).durable, 10)
        release, calls = _hold_first_fsync(monkeypatch, store._log("t", 0).segments[-1].fd)
        first = store.append_batch("t", 0, make_batch([b"b"]))
        await _until(lambda: calls == ["start"])
        second = store.append_batch("t", 0, make_batch([b"c"]))
        await asyncio.sleep(0.1)
        assert calls == ["start"] and not second.durable.done()
        release.set()
        await asyncio.wait_for(asyncio.gather(first.durable, second.durable), 10)
        assert calls == ["start", "end held", "start", "end"]
    finally:
        await store.close()
