"""The fsync threads of group commit (store.commit.SyncWorkers), compiled (pthreads that never
take the GIL, store/_fsync.pyx) and in Python: every job's completion comes back once, on the
event loop's thread, with the OS's error if any; the threads survive a shutdown, a closed loop
and a fork."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from pathlib import Path

import store.commit as commit


async def _sync(
    sw: commit.SyncWorkers, fds: list[int], directory: Path | None = None
) -> tuple[BaseException | None, int]:
    """One job; (its error or None, the thread its callback ran on)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[tuple[BaseException | None, int]] = loop.create_future()
    sw.submit(loop, fds, directory, lambda exc: fut.set_result((exc, threading.get_ident())))
    return await asyncio.wait_for(fut, 10)


def _file(tmp_path: Path, name: str = "f") -> int:
    fd = os.open(tmp_path / name, os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"data")
    return fd


async def test_every_job_completes_once_on_the_loop_thread(tmp_path: Path, fsync_impl: str) -> None:
    sw = commit.SyncWorkers(4, "t")
    fds = [_file(tmp_path, f"f{i}") for i in range(3)]
    try:
        assert (sw._pool is None) == (fsync_impl == "python")
        results = await asyncio.gather(*(_sync(sw, fds[: 1 + i % 3]) for i in range(300)))
        assert [exc for exc, _ in results] == [None] * 300
        assert {tid for _, tid in results} == {threading.get_ident()}
        assert (await _sync(sw, fds, tmp_path))[0] is None  # and the directory
        sw.shutdown()
        if sw._pool is not None:  # the loop no longer watches the eventfd (nor keeps sw alive)
            assert not asyncio.get_running_loop().remove_reader(sw._pool.fileno())
    finally:
        sw.shutdown()
        for fd in fds:
            os.close(fd)


async def test_the_os_error_of_a_job_is_its_completion(tmp_path: Path, fsync_impl: str) -> None:
    sw = commit.SyncWorkers(2, "t")
    fd = _file(tmp_path)
    r, w = os.pipe()
    closed = os.dup(fd)
    os.close(closed)
    try:
        exc, _ = await _sync(sw, [fd, closed])
        assert isinstance(exc, OSError) and exc.errno == errno.EBADF
        exc, _ = await _sync(sw, [r])  # fdatasync of a pipe
        assert isinstance(exc, OSError) and exc.errno == errno.EINVAL
        exc, _ = await _sync(sw, [fd], tmp_path / "gone")
        assert isinstance(exc, OSError) and exc.errno == errno.ENOENT
        assert (await _sync(sw, [fd]))[0] is None  # the threads carry on
    finally:
        sw.shutdown()
        for x in (fd, r, w):
            os.close(x)


def test_jobs_after_a_shutdown_and_on_a_new_loop_complete(tmp_path: Path, fsync_impl: str) -> None:
    """A store's workers outlive one event loop (tools and tests run several asyncio.run)."""
    sw = commit.SyncWorkers(2, "t")
    fd = _file(tmp_path)
    try:
        assert asyncio.run(_sync(sw, [fd]))[0] is None
        sw.shutdown()
        assert asyncio.run(_sync(sw, [fd]))[0] is None
        assert asyncio.run(_sync(sw, [fd]))[0] is None
    finally:
        sw.shutdown()
        os.close(fd)


def test_a_forked_child_gets_threads_of_its_own(tmp_path: Path, fsync_impl: str) -> None:
    sw = commit.SyncWorkers(2, "t")
    fd = _file(tmp_path)
    try:
        assert asyncio.run(_sync(sw, [fd]))[0] is None  # threads running in the parent
        pid = os.fork()
        if pid == 0:  # the child: no threads were inherited
            code = 1
            try:
                code = 0 if asyncio.run(_sync(sw, [fd]))[0] is None else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert asyncio.run(_sync(sw, [fd]))[0] is None
    finally:
        sw.shutdown()
        os.close(fd)
