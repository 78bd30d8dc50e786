"""`lightgate rebuild-queues`: the light queues rebuilt from the log (lightqueue.rebuild_queues),
with one progress bar per pass on stderr."""

from __future__ import annotations

import sys

from lightgate.app import open_cluster_log
from lightgate.config import GatewayConfig
from store import StoreConfig, StoreError, StoreLockedError


async def rebuild_queues(cfg: GatewayConfig) -> int:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TaskProgressColumn,
        TextColumn,
    )

    from lightqueue import RebuildProgress
    from lightqueue import rebuild_queues as rebuild

    # One bar per pass ("count" what the old queues had, then "index" the whole log), on stderr;
    # each bar is finished before the next log line so they never share a line.
    current: dict[str, tuple[Progress | None, TaskID]] = {}  # phase -> (bar, task id); None: done

    def progress(p: RebuildProgress) -> None:
        if p.phase not in current:
            bar = Progress(
                TextColumn(f"rebuild-queues: {p.phase}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("records"),
                TaskProgressColumn(),
                console=Console(stderr=True),
                redirect_stdout=False,
                redirect_stderr=False,
            )
            bar.start()
            current[p.phase] = (bar, bar.add_task(p.phase, total=p.records_total))
        shown, task = current[p.phase]
        if shown is None:
            return
        shown.update(task, completed=p.records_done)
        if p.records_done >= p.records_total:
            shown.stop()
            current[p.phase] = (None, task)

    def close_bars() -> None:
        for phase, (bar, task) in list(current.items()):
            if bar is not None:
                bar.stop()
                current[phase] = (None, task)

    try:
        store = await open_cluster_log(cfg) if cfg.log == "kafka" else None
        try:
            stats = await rebuild(
                cfg.data_path, progress=progress, store=store,
                store_config=StoreConfig.from_object(cfg),
            )  # fmt: skip
        finally:
            if store is not None:
                await store.close()
    except (StoreLockedError, StoreError) as exc:
        close_bars()
        print(f"lightgate: {exc}", file=sys.stderr)
        return 1
    finally:
        close_bars()
    print(
        f"rebuild-queues: {stats.records} records, {stats.queues} queues, {stats.entries} entries"
        f" in {stats.seconds:.1f}s",
        file=sys.stderr,
    )
    return 0
