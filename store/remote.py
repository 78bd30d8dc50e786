"""The store over the core link: `StoreService` in the core, `RemoteStore` in a proxy process.

A proxy builds its MQTT RecordBatches itself (`store.mqtt_batches`, the same bytes the in-process
store writes) and ships them per loop tick in one APPEND; the core appends them exactly as it
appends a Kafka producer's batches (`Store.append_batch`: CRC check, base offset rewrite). So the
core spends no CPU per MQTT message beyond the copy into its segment, and the proxy learns every
record's offset from the reply. Under `always`, acknowledgement is two-phase: the reply carries
the offsets at once (delivery and retained messages need them), and a DURABLE message follows
when the fsync covering the append is done; the proxy's PUBACK/PUBREC wait for that one.

Wire bodies (strings are u16 length + UTF-8, see store.rpc)::

    TOPICS       → JSON {topic: partitions}
    ENSURE_TOPIC str topic | u8 force → u32 partitions   (creates it if auto-create is on, or forced)
    APPEND       u32 token | u8 sync | u16 n | n × (str topic, u32 partition, u32 size, bytes)
                 → n × (i64 base offset | str error)               base -1 when that batch failed
    DURABLE      (core → proxy, one-way) u32 token | str error     "" = durable
    READ         str topic | u32 partition | i64 offset | u32 max bytes → whole batches
    OFFSETS      str topic | u32 partition → i64 log start | i64 high watermark
    TOPIC_CHANGED (core → proxy, one-way) str topic   deleted or grown: forget its partition count

Event-loop-only on both sides.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
from collections.abc import Sequence
from time import time
from typing import Any

from store.config import StoreError, UnknownTopicOrPartitionError
from store.log import OffsetOutOfRangeError
from store.mapping import MqttMessage, log_topic_for, partition_for_key
from store.mqtt_batches import build_mqtt_batches
from store.record_batch import split_batches
from store.rpc import BAD_REQUEST, Handler, RpcError, RpcPeer, get_str, put_str
from store.store import AppendResult, Run

log = logging.getLogger("lightgate.store.remote")

TOPICS, ENSURE_TOPIC, APPEND, DURABLE, READ, OFFSETS, TOPIC_CHANGED = 1, 2, 3, 4, 5, 6, 7
OFFSET_OUT_OF_RANGE, UNKNOWN_TOPIC, STORE_ERROR = 100, 101, 102

_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_I64 = struct.Struct(">q")
_APPEND_HEAD = struct.Struct(">IBH")  # token, sync, n
_PART = struct.Struct(">II")  # partition, size
_READ = struct.Struct(">IqI")  # partition, offset, max bytes
_OFFSETS = struct.Struct(">qq")


def _store_error(exc: Exception) -> RpcError:
    if isinstance(exc, OffsetOutOfRangeError):
        return RpcError(OFFSET_OUT_OF_RANGE, str(exc))
    if isinstance(exc, UnknownTopicOrPartitionError):
        return RpcError(UNKNOWN_TOPIC, str(exc))
    return RpcError(STORE_ERROR, str(exc))


def _raise_store_error(
    exc: RpcError, topic: str = "", partition: int = -1, offset: int = -1
) -> None:
    if exc.code == OFFSET_OUT_OF_RANGE:
        raise OffsetOutOfRangeError(topic, partition, offset, -1, -1) from None
    if exc.code == UNKNOWN_TOPIC:
        raise UnknownTopicOrPartitionError(str(exc)) from None
    raise StoreError(str(exc)) from None


class StoreService:
    """The core side: serves one `Store` to every link."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.peers: set[RpcPeer] = set()
        if hasattr(store, "add_topic_listener"):
            store.add_topic_listener(self._on_topic_event)

    def peer_connected(self, peer: RpcPeer) -> None:
        self.peers.add(peer)

    def peer_lost(self, peer: RpcPeer) -> None:
        self.peers.discard(peer)

    def _on_topic_event(self, event: str, topic: str) -> None:
        """A deleted or grown log topic: proxies must ask for its partition count again, or
        they would route MQTT topics by the old one."""
        if event in ("deleted", "partitions"):
            out: list[bytes] = []
            put_str(out, topic)
            body = b"".join(out)
            for peer in self.peers:
                peer.send(TOPIC_CHANGED, body)

    def methods(self) -> dict[int, Handler]:
        return {
            TOPICS: self._topics,
            ENSURE_TOPIC: self._ensure_topic,
            APPEND: self._append,
            READ: self._read,
            OFFSETS: self._offsets,
        }

    def _topics(self, peer: RpcPeer, body: bytes) -> bytes:
        return json.dumps(self.store.topics()).encode()

    def _ensure_topic(self, peer: RpcPeer, body: bytes) -> bytes:
        name, pos = get_str(body, 0)
        force = body[pos : pos + 1] == b"\x01"
        store = self.store
        try:
            if not force and name not in store.topics() and not store.config.auto_create_topics:
                raise UnknownTopicOrPartitionError(f"log topic {name!r} does not exist")
            return _U32.pack(store.ensure_topic(name))
        except Exception as exc:
            raise _store_error(exc) from None

    def _append(self, peer: RpcPeer, body: bytes) -> bytes:
        token, sync, n = _APPEND_HEAD.unpack_from(body, 0)
        pos = _APPEND_HEAD.size
        store = self.store
        out: list[bytes] = []
        waits: list[asyncio.Future[None]] = []
        for _ in range(n):
            topic, pos = get_str(body, pos)
            part, size = _PART.unpack_from(body, pos)
            pos += _PART.size
            batch = body[pos : pos + size]
            pos += size
            if len(batch) != size:
                raise RpcError(BAD_REQUEST, "truncated APPEND")
            try:
                res = store.append_batch(topic, part, batch, bool(sync))
            except Exception as exc:
                log.warning("append from %s to %s-%d refused: %s", peer.name, topic, part, exc)
                out.append(_I64.pack(-1))
                put_str(out, str(exc) or type(exc).__name__)
                continue
            out.append(_I64.pack(res.runs[0][2]))
            out.append(b"\0\0")
            if sync:
                waits.append(res.durable)
        if sync:
            if waits:
                done = asyncio.gather(*waits)
                done.add_done_callback(lambda f: self._durable(peer, token, f))
            else:
                peer.send(DURABLE, _U32.pack(token) + _U16.pack(0))
        return b"".join(out)

    def _durable(self, peer: RpcPeer, token: int, fut: asyncio.Future[Any]) -> None:
        err = ""
        if fut.cancelled():
            err = "not durable: cancelled"
        elif fut.exception() is not None:
            err = f"not durable: {fut.exception()}"
        out = [_U32.pack(token)]
        put_str(out, err)
        peer.send(DURABLE, b"".join(out))

    def _read(self, peer: RpcPeer, body: bytes) -> bytes:
        topic, pos = get_str(body, 0)
        part, offset, max_bytes = _READ.unpack_from(body, pos)
        try:
            return bytes(self.store.read(topic, part, offset, max_bytes))
        except Exception as exc:
            raise _store_error(exc) from None

    def _offsets(self, peer: RpcPeer, body: bytes) -> bytes:
        topic, pos = get_str(body, 0)
        (part,) = _U32.unpack_from(body, pos)
        try:
            return _OFFSETS.pack(
                self.store.log_start_offset(topic, part), self.store.high_watermark(topic, part)
            )
        except Exception as exc:
            raise _store_error(exc) from None


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
        return {DURABLE: self._on_durable, TOPIC_CHANGED: self._on_topic_changed}

    def _on_topic_changed(self, peer: RpcPeer, body: bytes) -> None:
        topic, _ = get_str(body, 0)
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
        self._counts.update(json.loads(await self.peer.call(TOPICS)))

    def topics(self) -> dict[str, int]:
        return dict(self._counts)

    async def barrier(self) -> None:
        """One round trip: the core has handled everything this link sent before it."""
        assert self.peer is not None
        await self.peer.call(TOPICS)

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
        out: list[bytes] = []
        put_str(out, name)
        out.append(b"\x01" if force else b"\x00")
        try:
            (n,) = _U32.unpack(await self.peer.call(ENSURE_TOPIC, b"".join(out)))
        except RpcError as exc:
            _raise_store_error(exc)
        finally:
            self._ensuring.pop(name, None)
        self._counts[name] = n
        return int(n)

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
        out = [_APPEND_HEAD.pack(token, 1 if sync else 0, len(items))]
        for topic, part, buf, _idxs in items:
            put_str(out, topic)
            out.append(_PART.pack(part, len(buf)))
            out.append(bytes(buf))
        if sync:
            self._durable[token] = res.durable
        else:
            res.durable.set_result(None)
        peer.call_then(
            APPEND,
            b"".join(out),
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
        pos = 0
        for topic, part, buf, idxs in items:
            (base,) = _I64.unpack_from(body, pos)
            err, pos = get_str(body, pos + 8)
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
        (token,) = _U32.unpack_from(body, 0)
        err, _ = get_str(body, 4)
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
        out: list[bytes] = []
        put_str(out, topic)
        out.append(_READ.pack(partition, offset, max_bytes))
        try:
            return await self.peer.call(READ, b"".join(out))
        except RpcError as exc:
            _raise_store_error(exc, topic, partition, offset)
            raise

    async def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        """(log start offset, high watermark)."""
        assert self.peer is not None
        out: list[bytes] = []
        put_str(out, topic)
        out.append(_U32.pack(partition))
        try:
            start, hwm = _OFFSETS.unpack(await self.peer.call(OFFSETS, b"".join(out)))
        except RpcError as exc:
            _raise_store_error(exc)
            raise
        return int(start), int(hwm)


def _fail(res: AppendResult, exc: BaseException) -> None:
    for f in (res.staged, res.durable):
        if f is not None and not f.done():
            f.set_exception(exc)
            f.exception()  # retrieved here: a QoS 0 caller may never look


def _log_task_failure(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("remote append failed: %r", task.exception())
