"""The data directory's lock: one process (`lightgate serve`, `rebuild-queues`) per data dir, for
both logs (local and cluster)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from store.config import StoreLockedError


def take_data_dir_lock(data_dir: Path) -> int:
    """Take DATA/LOCK (fcntl, non-blocking) for this process, write our pid in it; returns the fd.
    Raises StoreLockedError naming the holder's pid. Both logs (local, cluster) take it."""
    path = data_dir / "LOCK"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLockedError(
            f"data dir {data_dir} is locked by another process (pid {holder}); "
            "is another `lightgate serve` or `rebuild-queues` running on it?"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def release_data_dir_lock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
