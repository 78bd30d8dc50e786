"""What an append returns (`AppendResult`): where the records went, and when they are durable.
Shared by the local store, the cluster log's produce path and the proxy's remote store."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

Run = tuple[str, int, int, Sequence[int], int]  # topic, partition, base offset, indexes, bytes


class AppendResult:
    """What an append returns: where its records went, and when they are durable.

    `runs` has one entry per batch written: (log topic, partition, base offset, the indexes of
    the input messages in offset order, batch bytes), so nobody pays for a tuple per message
    who does not need one; `offsets` (log topic, partition, offset) per message or record is
    derived from it on first use. In-process both are known at once and `staged` is None;
    through `mqtt_proxy.backends.remote_store.RemoteStore` they arrive with the core's reply (`runs` is None until
    `staged` resolves), and both futures fail if the core refused the append.
    """

    __slots__ = ("runs", "count", "durable", "staged", "_offsets", "_then")

    def __init__(
        self,
        runs: list[Run] | None,
        count: int,
        durable: asyncio.Future[None],
        staged: asyncio.Future[None] | None = None,
    ) -> None:
        self.runs = runs
        self.count = count  # messages (append_mqtt) or records (append_batch)
        self.durable = durable  # resolves when durable under the topic's fsync policy
        self.staged = staged
        self._offsets: list[tuple[str, int, int]] | None = None
        self._then: list[Callable[[], None]] | None = None

    def when_staged(self, cb: Callable[[], None]) -> None:
        """Run `cb` once the offsets are known: now in-process, else the moment the core's reply
        is read (before anything read after it); never if the append was refused."""
        if self.runs is not None:
            cb()
        elif self._then is None:
            self._then = [cb]
        else:
            self._then.append(cb)

    def set_staged(self, runs: list[Run], count: int) -> None:
        """The reply arrived (RemoteStore): record the runs, run the when_staged callbacks."""
        self.runs = runs
        self.count = count
        then, self._then = self._then, None
        for cb in then or ():
            cb()
        if self.staged is not None and not self.staged.done():
            self.staged.set_result(None)

    @property
    def offsets(self) -> list[tuple[str, int, int]] | None:
        if self._offsets is None and self.runs is not None:
            out: list[Any] = [None] * self.count
            for topic, part, base, idxs, _n in self.runs:
                for k, i in enumerate(idxs):
                    out[i] = (topic, part, base + k)
            self._offsets = out
        return self._offsets
