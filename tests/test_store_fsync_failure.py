"""An fsync that fails (EIO from the disk) under `fsync = always`: the appends waiting on it are
told (their `durable` fails, nothing is acknowledged), the partition goes offline until restart
(docs/storage.md, step 4), the gateway's other partitions carry on, and later syncs still
complete through the same fsync workers. The failure is injected at the OS call, the only
fault the disk can give us here."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest
from kafka_helpers import make_batch

import store.commit as commit
from store import Store, StoreConfig, StoreError


async def test_failed_fsync_fails_its_waiters_and_takes_the_partition_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await Store.open(tmp_path / "data", StoreConfig(fsync="always"))
    try:
        store.ensure_topic("t", 2)
        await asyncio.wait_for(store.append_batch("t", 0, make_batch([b"a"])).durable, 10)
        real = os.fdatasync
        bad = store._log("t", 0).segments[-1].fd  # partition 0's active segment

        def fdatasync(fd: int) -> None:
            if fd == bad:
                raise OSError(errno.EIO, "Input/output error")
            real(fd)

        monkeypatch.setattr(commit.os, "fdatasync", fdatasync)
        failing = store.append_batch("t", 0, make_batch([b"b"]))
        healthy = store.append_batch("t", 1, make_batch([b"c"]))
        with pytest.raises(StoreError, match="fsync of t-0 failed"):
            await asyncio.wait_for(failing.durable, 10)
        await asyncio.wait_for(healthy.durable, 10)  # the other partition is not affected
        with pytest.raises(StoreError, match="offline"):
            store.append_batch("t", 0, make_batch([b"d"]))
        monkeypatch.setattr(commit.os, "fdatasync", real)
        for i in range(20):  # the workers still serve later syncs
            await asyncio.wait_for(store.append_batch("t", 1, make_batch([b"%d" % i])).durable, 10)
    finally:
        await store.close()
