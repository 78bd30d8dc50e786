"""`RemoteBackend`: the proxy's backend (backend.py) when the store, the light queues and notify
live in the core process, reached over the core link (mqtt_proxy.backends.remote_store,
mqtt_proxy.backends.remote_queues, mqtt_proxy.backends.remote_notify; docs/architecture.md, "The core link").
Calls that need an answer complete later, on the link's reply."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from lightqueue.model import ReadResult, StoredMessage
from mqtt_proxy.backends.backend import Backend
from mqtt_proxy.ports import (
    Acquired,
    Entries,
    LoadDone,
    NotifierPort,
    RetainedPageSink,
    SessionState,
)
from mqtt_proxy.sessions.topic_filters import FilterSpec
from store.append_result import AppendResult
from store.mapping import MqttMessage

if TYPE_CHECKING:
    from mqtt_proxy.backends.remote_queues import RemoteLightQueues
    from mqtt_proxy.backends.remote_store import RemoteStore

log = logging.getLogger("lightgate.mqtt.backend")


class RemoteBackend(Backend):
    """Store and light queues in the core process (`RemoteStore`, `RemoteLightQueues` on one
    link), notify on the same link (`LinkNotifier`). A failed call is logged once per kind; the
    link going away ends the proxy (the wiring watches `link_lost`)."""

    def __init__(
        self,
        store: RemoteStore,
        queues: RemoteLightQueues,
        notifier: NotifierPort,
        proxy_id: str,
        recent_bytes: int,
    ) -> None:
        super().__init__(store, notifier, proxy_id, recent_bytes)
        self.remote_store = store
        self.queues = queues
        self._loop = asyncio.get_running_loop()
        queues.entries_sink = self._pushed

    def _watch(self, queue: str, on: bool) -> None:
        self.queues.watch(queue, on)

    def _pushed(self, queue: str, first: int, entries: Entries) -> None:
        if self.entries_sink is not None:
            self.entries_sink(queue, first, entries)

    def publish(
        self,
        msgs: list[MqttMessage],
        retained: list[int],
        acked: Callable[[asyncio.Future[None]], None] | None,
        writes: list[asyncio.Future[bytes]],
    ) -> AppendResult:
        """The round through the core link: the core writes, indexes and pushes the entries
        back (ENTRIES, then events); here only the append, and once its reply is read (before
        any entry that names these messages) the recent runs and the retained writes."""
        res = self.store.append_mqtt(msgs, acked is not None)
        res.when_staged(lambda: self._staged(msgs, retained, res, writes))
        if acked is not None:
            res.durable.add_done_callback(acked)
        return res

    async def start(self) -> None:
        from mqtt_proxy.device_events import TOPIC

        await self.remote_store.ensure_topic(TOPIC, force=True)

    def load(self, queue: str, from_seq: int, max_n: int, done: LoadDone) -> None:
        self.queues.read(queue, from_seq, max_n).add_done_callback(
            lambda f: self._read_done(f, queue, done)
        )

    def _read_done(self, fut: asyncio.Future[ReadResult], queue: str, done: LoadDone) -> None:
        if fut.cancelled() or fut.exception() is not None:
            log.warning("light-queue read of %s failed: %r", queue, fut.exception())
            done(None, None)
            return
        self._resolve(queue, fut.result(), done)

    def _resolve(self, queue: str, res: ReadResult, done: LoadDone) -> None:
        msgs, missing = self._from_recent(res.entries)
        if not missing:
            done(res, msgs)
            return
        entries = res.entries

        def resolved(f: asyncio.Future[list[StoredMessage | None]]) -> None:
            if f.cancelled() or f.exception() is not None:
                log.warning("resolving %d entries of %s failed: %r", len(missing), queue,
                            f.exception())  # fmt: skip
                done(None, None)
                return
            for i, m in zip(missing, f.result(), strict=True):
                msgs[i] = m
            done(res, msgs)

        self.queues.resolve([entries[i] for i in missing]).add_done_callback(resolved)

    def acquire_many(self, specs: list[FilterSpec], done: Callable[[list[Acquired]], None]) -> None:
        if not specs:
            done([])
            return

        def answered(f: asyncio.Future[list[Acquired]]) -> None:
            if f.cancelled() or f.exception() is not None:
                err = f"core link: {f.exception()!r}"
                done([err] * len(specs))
            else:
                done(list(f.result()))

        items = [(s.filter, s.replay_since_ms) for s in specs]
        self.queues.acquire_many(items).add_done_callback(answered)

    def release(self, queue: str) -> None:
        self.queues.release(queue)

    def indexed(self) -> int:
        return int(self.queues.indexed)

    def retain(
        self, msg: MqttMessage, offset: tuple[str, int, int]
    ) -> asyncio.Future[bytes] | None:
        fut = self.queues.retain(
            msg.topic, msg.payload, msg.qos, msg.client_id, msg.properties, msg.timestamp_ms, offset
        )
        fut.add_done_callback(_log_retain_failure)
        return fut

    def retained_page(
        self, filt: str, after: bytes | None, limit: int, done: RetainedPageSink
    ) -> None:
        def answered(f: asyncio.Future[tuple[list[StoredMessage], bytes | None]]) -> None:
            if f.cancelled() or f.exception() is not None:
                log.warning("retained lookup for %r failed: %r", filt, f.exception())
                done([], None)
            else:
                done(*f.result())

        self.queues.retained_page(filt, after, limit).add_done_callback(answered)

    async def load_sessions(self) -> list[SessionState]:
        return list(await self.queues.load_sessions())

    def save_sessions(
        self, items: list[tuple[str, SessionState]], done: Callable[[], None] | None = None
    ) -> None:
        if done is None:
            if items:
                self.queues.put_sessions(items)
            return
        fut = self.queues.put_sessions(items, wait=True)
        assert fut is not None  # wait=True: the core answers once they are written

        def written(f: asyncio.Future[bytes]) -> None:
            if f.cancelled() or f.exception() is not None:
                log.error("writing %d sessions failed: %r", len(items), f.exception())
            done()

        fut.add_done_callback(written)

    def delete_session(self, client_id: str) -> None:
        self.queues.delete_session(client_id)


def _log_retain_failure(fut: asyncio.Future[bytes]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("setting a retained message in the core failed: %r", fut.exception())
