"""What opening and closing the store do to its files. Open: every partition of topics.json is
registered and recovered (its segments scanned from the recovery point, a torn tail cut; all of
it trusted when the last close left the clean-shutdown marker), the marker then removed, so a
crash from here on is known at the next open. Close: each changed partition's segments are
fsynced and its active segment's indexes sealed, and only if all of that worked the marker is
written."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from store.durable_files import fsync_dir, seal_segment, write_text_atomic
from store.log import Log
from store.topic_admin import remove_orphans

log = logging.getLogger("lightgate.store")

CLEAN_SHUTDOWN = "clean-shutdown"
TOPICS_FILE = "topics.json"

Register = Callable[[str, int, dict[str, Any], Any], Any]  # (name, partitions, config, id)


def recover(
    log_dir: Path, register: Register, counts: dict[str, int], logs: dict[tuple[str, int], Log]
) -> None:
    """Register the topics of topics.json (`register` fills `counts` and `logs`) and load every
    partition; logs what a crash cost. The clean-shutdown marker stays until `opened`."""
    log_dir.mkdir(parents=True, exist_ok=True)
    clean = (log_dir / CLEAN_SHUTDOWN).exists()
    try:
        meta = json.loads((log_dir / TOPICS_FILE).read_text())
        remove_orphans(log_dir, meta)
    except FileNotFoundError:
        meta = {}
    t0 = last = time.monotonic()
    done = [0]

    def progress(nbytes: int) -> None:
        nonlocal last
        done[0] += nbytes
        now = time.monotonic()
        if now - last >= 2.0:
            last = now
            log.info("recovery: %.1f MB scanned in %.0f s", done[0] / 1e6, now - t0)

    total_cut = 0
    for name, entry in sorted(meta.items()):
        register(name, int(entry["partitions"]), dict(entry.get("config", {})), entry.get("id"))
        for p in range(counts[name]):
            total_cut += logs[(name, p)].load(clean, progress)
    if not clean and logs:
        log.warning(
            "store was not shut down cleanly: recovered %d partitions in %.2f s, %d bytes cut",
            len(logs), time.monotonic() - t0, total_cut,
        )  # fmt: skip


def opened(log_dir: Path) -> None:
    """Recovered: remove the clean-shutdown marker (a crash from now on is seen next time)."""
    (log_dir / CLEAN_SHUTDOWN).unlink(missing_ok=True)
    fsync_dir(log_dir)


def seal_all(log_dir: Path, logs: list[Log]) -> None:
    """Close every partition, its changed segments fsynced and sealed; the clean-shutdown
    marker is written only if all of them were."""
    ok = True
    for lg in logs:
        if lg.failed is not None:
            ok = False
            lg.close()
            continue
        if not lg.changed and lg.recovery_point == lg.hwm:
            lg.close()  # untouched since a clean open: its files are already sealed
            continue
        try:
            for seg in lg.segments:
                if seg.dirty:
                    os.fsync(seg.fd)
            seg = lg.active
            idx, tix = seg.index_bytes()
            seal_segment(lg.dir, seg, idx, tix, lg.hwm)
        except OSError:
            ok = False
            log.exception("close: cannot flush %s", lg.name)
        lg.close()
    if ok:
        write_text_atomic(log_dir / CLEAN_SHUTDOWN, f"{int(time.time())}\n")
