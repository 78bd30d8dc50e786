"""The store as an MQTT proxy in another process sees it: `RemoteStore`, over the core link.

The client half of the store's methods (bodies in `store.wire`, transport `notify.link`; the
service half is `lightgate.link_services.StoreService`). The proxy builds its MQTT RecordBatches
itself (`store.mqtt_batches`) and ships them per loop tick in one APPEND; the reply carries the
offsets at once and, under `always`, a DURABLE message follows the fsync (the proxy's PUBACK /
PUBREC wait for that one). Event-loop-only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from time import time

from notify.link import Handler, RpcPeer
from notify.link_frames import RpcError
from store import wire
from store.append_result import AppendResult, Run
from store.config import StoreError
from store.mapping import MqttMessage, log_topic_for, partition_for_key
from store.mqtt_batches import build_mqtt_batches
from store.record_batch import split_batches

log = logging.getLogger("lightgate.store.remote")


class RemoteStore:
    """The proxy side: the part of the `Store` API an MQTT proxy uses, over the core link.

    Construct, put `methods()` into the link's method table, `attach(peer)`, then
    `await start()` (learns the topics). `append_mqtt` / `append_batch` return an
    `AppendResult` whose offsets arrive with the reply (`staged`). Messages on a log topic this
    proxy has not seen yet wait for one ENSURE_TOPIC round trip (once per topic).
    """

    def __init__(self) -> None:
        self.peer: RpcPeer | None = None
        self._counts: dict[str, int] = {}
        self._routes: dict[str, tuple[tuple[str, int], bytes]] = {}
        self._ensuring: dict[str, asyncio.Future[int]] = {}
        self._durable: dict[int, asyncio.Future[None]] = {}
        self._token = 0
        # Appends waiting for a new log topic's partition count, and every one after them.
        self._held: list[tuple[Sequence[MqttMessage], bool, AppendResult, set[str]]] = []

    def methods(self) -> dict[int, Handler]:
        return {wire.DURABLE: self._on_durable, wire.TOPIC_CHANGED: self._on_topic_changed}

    def _on_topic_changed(self, peer: RpcPeer, body: bytes) -> None:
        topic = wire.decode_str_body(body)
        self._counts.pop(topic, None)
        self._routes.clear()

    def attach(self, peer: RpcPeer) -> None:
        self.peer = peer
        peer.closed.add_done_callback(lambda _f: self._link_lost())

    def _link_lost(self) -> None:
        pending, self._durable = self._durable, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(StoreError("core link lost before the append was durable"))

    async def start(self) -> None:
        assert self.peer is not None
        self._counts.update(wire.decode_topics(await self.peer.call(wire.TOPICS)))

    def topics(self) -> dict[str, int]:
        return dict(self._counts)

    async def barrier(self) -> None:
        """One round trip: the core has handled everything this link sent before it."""
        assert self.peer is not None
        await self.peer.call(wire.TOPICS)

    async def ensure_topic(self, name: str, force: bool = False) -> int:
        """Partitions of `name`, creating the topic in the core when `auto_create_topics` is on
        (as the in-process store does for MQTT topics) or `force` (internal topics)."""
        n = self._counts.get(name)
        if n is not None:
            return n
        fut = self._ensuring.get(name)
        if fut is None:
            fut = self._ensuring[name] = asyncio.ensure_future(self._ensure(name, force))
        return await fut

    async def _ensure(self, name: str, force: bool) -> int:
        assert self.peer is not None
        try:
            body = await self.peer.call(wire.ENSURE_TOPIC, wire.encode_ensure_topic(name, force))
            n = wire.decode_count(body)
        except RpcError as exc:
            raise wire.store_error(exc.code, str(exc)) from None
        finally:
            self._ensuring.pop(name, None)
        self._counts[name] = n
        return n

    def partitions(self, name: str) -> int | None:
        return self._counts.get(name)

    # -- appends -------------------------------------------------------------------------------
    def _route(self, mqtt_topic: str) -> tuple[tuple[str, int], bytes]:
        r = self._routes.get(mqtt_topic)
        if r is not None:
            return r
        lt = log_topic_for(mqtt_topic)
        n = self._counts[lt]  # callers made sure it is known
        key = mqtt_topic.encode()
        r = ((lt, partition_for_key(key, n)), key)
        if len(self._routes) >= 100_000:
            self._routes.clear()
        self._routes[mqtt_topic] = r
        return r

    def _result(self) -> AppendResult:
        loop = asyncio.get_running_loop()
        return AppendResult(None, 0, loop.create_future(), loop.create_future())

    def append_mqtt(self, messages: Sequence[MqttMessage], sync: bool = True) -> AppendResult:
        """Build the batches here, append them in the core. Raises TopicMappingError for
        `$`-topics and invalid topics before anything is sent, like `Store.append_mqtt`.

        Appends leave in call order: one that waits for a new log topic holds back every later
        one (else a later tick's messages on that topic would be stored first)."""
        res = self._result()
        missing: set[str] = set()
        routes, counts = self._routes, self._counts
        for m in messages:
            if m.topic not in routes:
                lt = log_topic_for(m.topic)
                if lt not in counts:
                    missing.add(lt)
        if missing or self._held:
            self._held.append((messages, sync, res, missing))
            if len(self._held) == 1:
                task = asyncio.ensure_future(self._release_held())
                task.add_done_callback(_log_task_failure)
        else:
            self._send_mqtt(messages, sync, res)
        return res

    async def _release_held(self) -> None:
        """Send the held appends in order, each once its log topics are known."""
        held = self._held
        while held:
            messages, sync, res, missing = held[0]
            try:
                for t in sorted(missing):
                    await self.ensure_topic(t)
            except Exception as exc:
                _fail(res, exc)
            else:
                self._send_mqtt(messages, sync, res)
            held.pop(0)

    def _send_mqtt(self, messages: Sequence[MqttMessage], sync: bool, res: AppendResult) -> None:
        try:
            batches = build_mqtt_batches(messages, self._route, int(time() * 1000))
        except Exception as exc:
            _fail(res, exc)
            return
        items: list[tuple[str, int, bytes | bytearray, Sequence[int]]] = [
            (slot[0], slot[1], buf, idxs) for slot, buf, _n, _ts, idxs in batches
        ]
        self._send(items, len(messages), sync, res)

    def append_batch(
        self, topic: str, partition: int, batch: bytes, sync: bool = True
    ) -> AppendResult:
        """Producer-style bytes (one or more batches) for a topic this proxy knows; offsets
        (one per record) arrive with `staged`."""
        res = self._result()
        count = sum(h.record_count for h in split_batches(batch))
        self._send([(topic, partition, bytes(batch), range(count))], count, sync, res)
        return res

    def _send(
        self,
        items: list[tuple[str, int, bytes | bytearray, Sequence[int]]],
        total: int,
        sync: bool,
        res: AppendResult,
    ) -> None:
        peer = self.peer
        assert peer is not None
        self._token = token = (self._token % 0xFFFFFFFF) + 1
        body = wire.encode_append(token, sync, [(t, p, buf) for t, p, buf, _idxs in items])
        if sync:
            self._durable[token] = res.durable
        else:
            res.durable.set_result(None)
        peer.call_then(
            wire.APPEND,
            body,
            lambda body, err: self._replied(body, err, items, total, token, res),
        )

    def _replied(
        self,
        body: bytes,
        error: RpcError | None,
        items: list[tuple[str, int, bytes | bytearray, Sequence[int]]],
        total: int,
        token: int,
        res: AppendResult,
    ) -> None:
        if error is not None:
            self._durable.pop(token, None)
            log.error("append over the core link failed: %s", error)
            _fail(res, StoreError(f"append failed: {error}"))
            return
        runs: list[Run] = []
        errors = []
        answers = wire.decode_append_reply(body, len(items))
        for (topic, part, buf, idxs), (base, err) in zip(items, answers, strict=True):
            if base < 0:
                errors.append(f"{topic}-{part}: {err}")
                continue
            runs.append((topic, part, base, idxs, len(buf)))
        if errors:
            self._durable.pop(token, None)
            log.error("the core refused an append: %s", "; ".join(errors))
            _fail(res, StoreError("; ".join(errors)))
            return
        res.set_staged(runs, total)

    def _on_durable(self, peer: RpcPeer, body: bytes) -> None:
        token, err = wire.decode_durable(body)
        fut = self._durable.pop(token, None)
        if fut is None or fut.done():
            return
        if err:
            fut.set_exception(StoreError(err))
        else:
            fut.set_result(None)

    # -- reads ---------------------------------------------------------------------------------
    async def read(self, topic: str, partition: int, offset: int, max_bytes: int) -> bytes:
        assert self.peer is not None
        body = wire.encode_read(topic, partition, offset, max_bytes)
        try:
            return await self.peer.call(wire.READ, body)
        except RpcError as exc:
            raise wire.store_error(exc.code, str(exc), topic, partition, offset) from None

    async def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        """(log start offset, high watermark)."""
        assert self.peer is not None
        body = wire.encode_offsets_request(topic, partition)
        try:
            return wire.decode_offsets(await self.peer.call(wire.OFFSETS, body))
        except RpcError as exc:
            raise wire.store_error(exc.code, str(exc)) from None


def _fail(res: AppendResult, exc: BaseException) -> None:
    for f in (res.staged, res.durable):
        if f is not None and not f.done():
            f.set_exception(exc)
            f.exception()  # retrieved here: a QoS 0 caller may never look


def _log_task_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("remote append failed: %r", task.exception())
