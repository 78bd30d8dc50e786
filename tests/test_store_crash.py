"""Real processes: kill -9 of a writer keeps every acknowledged offset; a concurrent reader in
another process sees only complete batches."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from store import Store, StoreConfig
from store import segment_reader as sr
from store.record_batch import iter_batches, iter_records

WRITER = r"""
import asyncio, os, sys
from pathlib import Path
from store import MqttMessage, Store, StoreConfig

async def main(data, tag, fsync, size):
    cfg = StoreConfig(default_partitions=2, segment_bytes=64_000, fsync=fsync)
    store = await Store.open(Path(data), cfg)
    os.write(1, b"ready\n")
    pad = b"." * size

    async def worker(w):
        i = 0
        while True:
            msgs = [MqttMessage(f"k/{w}/{j}", f"{tag}:{w}:{i}:{j}:".encode() + pad, 1, "c")
                    for j in range(i % 7 + 1)]
            res = store.append_mqtt(msgs)
            await res.durable
            # One write per ack line set, each under PIPE_BUF: atomic on the pipe.
            for (t, p, o), m in zip(res.offsets, msgs):
                os.write(1, f"{t} {p} {o} {m.payload[:40].decode().rstrip('.')}\n".encode())
            i += 1

    await asyncio.gather(*(worker(w) for w in range(8)))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
"""


def start_writer(
    data: Path, tag: str, fsync: str = "always", size: int = 20
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(data), tag, fsync, str(size)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"
    return proc


def stored(data_dir: Path) -> dict[tuple[str, int, int], bytes]:
    out = {}
    for topic, part in sr.list_partitions(data_dir):
        for r in sr.iter_records_from(data_dir, topic, part):
            out[(topic, part, r.offset)] = r.value or b""
    return out


async def test_kill_9_keeps_every_acknowledged_offset(tmp_path: Path) -> None:
    """Three writer lifetimes on one data dir, each SIGKILLed mid-stream; every ack survives."""
    acked: dict[tuple[str, int, int], str] = {}
    for round_ in range(3):
        proc = start_writer(tmp_path, f"r{round_}")
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 0.3 + 0.2 * round_
        while time.monotonic() < deadline or len(lines) < 50:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
        os.kill(proc.pid, signal.SIGKILL)
        lines += proc.stdout.read().splitlines()  # acks written before it died count too
        proc.wait()
        assert len(lines) >= 50
        for line in lines:
            t, p, o, payload = line.decode().split()
            assert (t, int(p), int(o)) not in acked  # offsets are never handed out twice
            acked[(t, int(p), int(o))] = payload
        store = await Store.open(tmp_path, StoreConfig())  # recovery after the kill
        try:
            for (t, p, o), payload in acked.items():
                data = store.read(t, p, o, 1)
                recs = [r for q, n in iter_batches(data) for r in iter_records(data[q : q + n])]
                rec = next(r for r in recs if r.offset == o)
                assert (rec.value or b"").startswith(payload.encode()), (t, p, o)
        finally:
            await store.close()
    assert len(acked) > 150


async def test_kill_9_every_ack_line_present(tmp_path: Path) -> None:
    """Collect *all* ack lines of one run, then check each one after recovery."""
    proc = start_writer(tmp_path, "x")
    assert proc.stdout is not None
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    out = proc.stdout.read()
    proc.wait()
    acks = [line.split(" ") for line in out.decode().splitlines()]
    assert len(acks) > 100
    store = await Store.open(tmp_path, StoreConfig())
    await store.close()
    have = stored(tmp_path)
    for t, p, o, payload in acks:
        assert have[(t, int(p), int(o))].startswith(payload.encode())
    # Offsets are dense per partition: no holes below the high watermark.
    for part in {(t, int(p)) for t, p, _, _ in acks}:
        offs = sorted(o for (t, p, o) in have if (t, p) == part)
        assert offs == list(range(len(offs)))


def test_concurrent_reader_sees_only_complete_batches(tmp_path: Path) -> None:
    proc = start_writer(tmp_path, "c", fsync="never", size=30_000)  # ~1 MB writes span pages
    try:
        seen: dict[tuple[str, int, int], bytes] = {}
        polls = 0
        deadline, hard = time.monotonic() + 1.5, time.monotonic() + 20
        while time.monotonic() < deadline or (
            (len(seen) <= 50 or polls <= 3) and time.monotonic() < hard
        ):
            now = stored(tmp_path)
            polls += 1
            for key, value in now.items():
                assert value.endswith(b"." * 100) and len(value) > 30_000
                assert seen.setdefault(key, value) == value  # never changes once seen
            for part in {(t, p) for t, p, _ in now}:
                offs = sorted(o for (t, p, o) in now if (t, p) == part)
                assert offs == list(range(len(offs)))  # a prefix, no holes
        assert polls > 3 and len(seen) > 50
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
