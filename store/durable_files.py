"""Crash-safe file operations of the log: an atomic small file (tmp, fsync, rename, directory
fsync), a segment's deletion (rename first, unlink after), and sealing a rolled segment (its
`.log` fsynced, its indexes written, the recovery point moved last). Each says which state a
crash at any point leaves, and recovery (store/log.py, `Log.load`) takes it from there."""

from __future__ import annotations

import os
from pathlib import Path

from store.segment import LogSegment

RECOVERY_POINT_FILE = "recovery-point"


def delete_segment_files(seg: LogSegment) -> None:
    """Crash-safe delete: rename `.log` first (the truth), then indexes, then unlink.

    If we crash after a rename, pass 1 of recovery removes the `.deleted` files; before it, the
    segment is simply still there and retention runs again.
    """
    seg.close()
    for p in (seg.log_path, seg.index_path, seg.timeindex_path):
        try:
            os.rename(p, str(p) + ".deleted")
        except FileNotFoundError:
            continue
    for p in (seg.log_path, seg.index_path, seg.timeindex_path):
        Path(str(p) + ".deleted").unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str) -> None:
    """tmp + fsync + rename + directory fsync: after a crash either the old or the new content."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_segment(
    log_dir: Path, seg: LogSegment, index: bytes, timeindex: bytes, next_offset: int
) -> None:
    """Worker thread, after a roll: fsync the sealed `.log`, write its indexes, move the recovery point.

    Crash points: before the indexes are fsynced the recovery point still lies at or before this
    segment, so recovery rescans it and rebuilds them; the recovery point moves last.
    """
    if seg.fd >= 0:
        os.fsync(seg.fd)
    for path, data in ((seg.index_path, index), (seg.timeindex_path, timeindex)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(log_dir)
    write_text_atomic(log_dir / RECOVERY_POINT_FILE, str(next_offset))
