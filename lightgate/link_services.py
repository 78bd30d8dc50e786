"""The services of the core link: the core's half of every method a proxy calls.

`StoreService` serves one `Store`, `LightQueueService` one `LightQueues`, `NotifyService` the
notifier's `RouteTable`; `lightgate.core_link.CoreLink` puts their methods in one
`MethodRegistry` and serves it. The bodies are decoded and encoded by the component's own wire
module (store.wire, lightqueue.wire, notify.wire); the clients are in `mqtt_proxy.remote_*`.

Holds: ACQUIRE holds a filter queue for the calling link (`LightQueues.acquire_filter`); when a
link goes away every hold and watch it took is released, so a crashed proxy keeps nothing alive.
Event-loop-only.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from lightqueue import wire as lw
from notify import RouteTable
from notify import wire as nw
from notify.link import Handler, RpcPeer
from notify.link_frames import RpcError
from store import wire as sw
from store.append_result import AppendResult
from store.config import UnknownTopicOrPartitionError

if TYPE_CHECKING:
    from lightqueue import LightQueues
    from lightqueue.model import Position
    from store import Store
    from store.cluster.kafka_log import KafkaLog

log = logging.getLogger("lightgate.store.remote")


class StoreService:
    """The core side: serves one log to every link: the local `Store`, or the cluster's
    `KafkaLog` (`log = "kafka"`). For the cluster, offsets arrive with its acks and reads may
    need a fetch: those calls answer once they are known (an awaitable reply), so a proxy
    sees the same answers from either log."""

    def __init__(self, store: Store | KafkaLog) -> None:
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
            body = sw.str_body(topic)
            for peer in self.peers:
                peer.send(sw.TOPIC_CHANGED, body)

    def methods(self) -> dict[int, Handler]:
        return {
            sw.TOPICS: self._topics,
            sw.ENSURE_TOPIC: self._ensure_topic,
            sw.APPEND: self._append,
            sw.READ: self._read,
            sw.OFFSETS: self._offsets,
        }

    def _topics(self, peer: RpcPeer, body: bytes) -> bytes:
        return sw.encode_topics(self.store.topics())

    def _ensure_topic(self, peer: RpcPeer, body: bytes) -> bytes:
        name, force = sw.decode_ensure_topic(body)
        store = self.store
        try:
            if not force and name not in store.topics() and not store.config.auto_create_topics:
                raise UnknownTopicOrPartitionError(f"log topic {name!r} does not exist")
            return sw.encode_count(store.ensure_topic(name))
        except Exception as exc:
            raise RpcError(sw.error_code(exc), str(exc)) from None

    def _append(self, peer: RpcPeer, body: bytes) -> bytes | Awaitable[bytes]:
        token, sync, items = sw.decode_append(body)
        store = self.store
        results: list[AppendResult | str] = []
        waits: list[asyncio.Future[None]] = []
        for topic, part, batch in items:
            try:
                res = store.append_batch(topic, part, batch, sync)
            except Exception as exc:
                log.warning("append from %s to %s-%d refused: %s", peer.name, topic, part, exc)
                results.append(str(exc) or type(exc).__name__)
                continue
            results.append(res)
            if sync:
                waits.append(res.durable)
        if all(isinstance(r, str) or r.runs is not None for r in results):
            reply: bytes | Awaitable[bytes] = _append_reply(results)  # the local log: at once
            first: list[asyncio.Future[Any]] = []
        else:
            # The cluster: offsets come with its acks. The REPLY goes out before the DURABLE
            # (the proxy's acks wait for what it does on the reply: retained writes).
            task = asyncio.ensure_future(_staged_reply(results))
            reply, first = task, [task]
        if sync:
            if waits:
                done = asyncio.gather(*first, *waits)
                done.add_done_callback(lambda f: self._durable(peer, token, f))
            else:
                peer.send(sw.DURABLE, sw.encode_durable(token))
        return reply

    def _durable(self, peer: RpcPeer, token: int, fut: asyncio.Future[list[Any]]) -> None:
        err = ""
        if fut.cancelled():
            err = "not durable: cancelled"
        elif fut.exception() is not None:
            err = f"not durable: {fut.exception()}"
        peer.send(sw.DURABLE, sw.encode_durable(token, err))

    def _read(self, peer: RpcPeer, body: bytes) -> bytes | Awaitable[bytes]:
        topic, part, offset, max_bytes = sw.decode_read(body)
        if self.store.remote_reads:
            return self._read_fetched(topic, part, offset, max_bytes)
        try:
            return bytes(self.store.read(topic, part, offset, max_bytes))
        except Exception as exc:
            raise RpcError(sw.error_code(exc), str(exc)) from None

    async def _read_fetched(self, topic: str, part: int, offset: int, max_bytes: int) -> bytes:
        """The cluster log: fetch first, then read from memory (store.backend)."""
        try:
            await self.store.prefetch([(topic, part, offset)])
            return bytes(self.store.read(topic, part, offset, max_bytes))
        except Exception as exc:
            raise RpcError(sw.error_code(exc), str(exc)) from None

    def _offsets(self, peer: RpcPeer, body: bytes) -> bytes:
        topic, part = sw.decode_offsets_request(body)
        try:
            return sw.encode_offsets(
                self.store.log_start_offset(topic, part), self.store.high_watermark(topic, part)
            )
        except Exception as exc:
            raise RpcError(sw.error_code(exc), str(exc)) from None


def _append_reply(results: list[AppendResult | str]) -> bytes:
    out: list[bytes] = []
    for r in results:
        if isinstance(r, str):
            sw.append_failed(out, r)
        else:
            assert r.runs is not None
            sw.append_ok(out, r.runs[0][2])
    return b"".join(out)


async def _staged_reply(results: list[AppendResult | str]) -> bytes:
    """The APPEND reply once every append has its offsets (or failed: said per append)."""
    out: list[AppendResult | str] = []
    for r in results:
        if isinstance(r, str) or r.runs is not None or r.staged is None:
            out.append(r)
            continue
        try:
            await r.staged
        except Exception as exc:
            out.append(str(exc) or type(exc).__name__)
            continue
        out.append(r)
    return _append_reply(out)


class LightQueueService:
    """Serves one `LightQueues` to every link; call `on_round` after each dispatch round."""

    def __init__(self, queues: LightQueues) -> None:
        self.queues = queues
        self.peers: set[RpcPeer] = set()
        self._push_scheduled = False
        self._watchers: dict[str, set[RpcPeer]] = {}
        queues.set_watch_sink(self.on_entries)

    def methods(self) -> dict[int, Handler]:
        return {
            lw.WATCH: self._watch,
            lw.UNWATCH: self._unwatch,
            lw.READ: self._read,
            lw.RESOLVE: self._resolve,
            lw.ACQUIRE: self._acquire,
            lw.RELEASE: self._release,
            lw.RETAIN: self._retain,
            lw.RETAINED: self._retained,
            lw.SESSIONS: self._sessions,
            lw.PUT_SESSIONS: self._put_sessions,
            lw.DEL_SESSION: self._del_session,
        }

    def peer_connected(self, peer: RpcPeer) -> None:
        peer.state["holds"] = Counter()
        self.peers.add(peer)
        peer.send(lw.INDEXED, lw.encode_indexed(int(self.queues.dispatcher.records)))

    def peer_lost(self, peer: RpcPeer) -> None:
        """Release every hold and watch the link took (a proxy that went away holds nothing)."""
        self.peers.discard(peer)
        holds: Counter[str] = peer.state.pop("holds", Counter())
        for queue, n in holds.items():
            for _ in range(n):
                self.queues.release_filter(queue)
        for queue in peer.state.pop("watching", set()):
            self._drop_watch(peer, queue)

    def _watch(self, peer: RpcPeer, body: bytes) -> None:
        queue = lw.decode_str_body(body)
        watching: set[str] = peer.state.setdefault("watching", set())
        if queue in watching or not self.queues.watch(queue):
            return
        watching.add(queue)
        self._watchers.setdefault(queue, set()).add(peer)

    def _unwatch(self, peer: RpcPeer, body: bytes) -> None:
        queue = lw.decode_str_body(body)
        watching: set[str] = peer.state.setdefault("watching", set())
        if queue in watching:
            watching.discard(queue)
            self._drop_watch(peer, queue)

    def _drop_watch(self, peer: RpcPeer, queue: str) -> None:
        self.queues.unwatch(queue)
        peers = self._watchers.get(queue)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                del self._watchers[queue]

    def on_entries(self, pushed: list[tuple[str, int, list[tuple[str, int, int]]]]) -> None:
        """The dispatcher's watch sink: one ENTRIES frame per watching link."""
        frames: dict[RpcPeer, list[tuple[str, int, list[tuple[str, int, int]]]]] = {}
        for item in pushed:
            for peer in self._watchers.get(item[0], ()):
                if peer.paused:
                    # The proxy is not reading as fast as we push: skip, it reads these later
                    # (a gap in its pushed runs makes it READ), so our buffer stays bounded.
                    continue
                frames.setdefault(peer, []).append(item)
        for peer, items in frames.items():
            peer.send(lw.ENTRIES, lw.encode_pushed(items))

    def on_round(self) -> None:
        """A dispatch round finished: tell the links how far indexing got (once per tick)."""
        if self.peers and not self._push_scheduled:
            self._push_scheduled = True
            asyncio.get_running_loop().call_soon(self._push_indexed)

    def _push_indexed(self) -> None:
        self._push_scheduled = False
        body = lw.encode_indexed(int(self.queues.dispatcher.records))
        for peer in self.peers:
            peer.send(lw.INDEXED, body)

    def _read(self, peer: RpcPeer, body: bytes) -> bytes:
        queue, from_seq, max_n = lw.decode_read(body)
        return lw.encode_read_reply(self.queues.read(queue, from_seq, max_n))

    def _resolve(self, peer: RpcPeer, body: bytes) -> bytes | Awaitable[bytes]:
        entries = lw.decode_resolve(body)
        if self.queues.remote_reads:
            return self._resolve_fetched(entries)
        return lw.encode_messages(self.queues.resolve(entries))

    async def _resolve_fetched(self, entries: list[Position | None]) -> bytes:
        """The cluster log: the records in memory first (one fetch per partition run), as
        `mqtt_proxy.backends.backend.LocalBackend` does in one process; the proxy does not know."""
        await self.queues.prefetch(entries)
        return lw.encode_messages(self.queues.resolve(entries))

    def _acquire(self, peer: RpcPeer, body: bytes) -> bytes | Awaitable[bytes]:
        items = lw.decode_acquire(body)
        if self.queues.needs_prepare(items):
            return self._acquire_prepared(peer, items)
        return self._acquire_now(peer, items)

    async def _acquire_prepared(self, peer: RpcPeer, items: list[tuple[str, int | None]]) -> bytes:
        """The cluster log: where each replay starts is asked of it first (its answer is not
        synchronous); the holds are then taken at once, as for the local log."""
        try:
            await self.queues.prepare_acquire(items)
        except Exception as exc:
            log.warning("finding replay starts on the cluster failed: %r", exc)
        if peer.is_closing():
            return b""  # the link went away meanwhile: take no hold it cannot release
        return self._acquire_now(peer, items)

    def _acquire_now(self, peer: RpcPeer, items: list[tuple[str, int | None]]) -> bytes:
        holds: Counter[str] = peer.state.setdefault("holds", Counter())
        out: list[tuple[str, int] | str] = []
        for filt, since_ms in items:
            try:
                a = self.queues.acquire_filter(filt, since_ms)
            except Exception as exc:
                out.append(f"{type(exc).__name__}: {exc}")
                continue
            holds[a.queue] += 1
            out.append((a.queue, a.start_seq))
        return lw.encode_acquire_reply(out)

    def _release(self, peer: RpcPeer, body: bytes) -> None:
        queue = lw.decode_str_body(body)
        holds: Counter[str] = peer.state.setdefault("holds", Counter())
        if holds[queue] > 0:
            holds[queue] -= 1
            if not holds[queue]:
                del holds[queue]
        self.queues.release_filter(queue)

    def _retain(self, peer: RpcPeer, body: bytes) -> bytes:
        self.queues.retained.set(*lw.decode_retain(body))
        return b""

    def _retained(self, peer: RpcPeer, body: bytes) -> bytes:
        filt, after, limit = lw.decode_retained_req(body)
        return lw.encode_retained_page(*self.queues.retained.page(filt, after, limit))

    def _sessions(self, peer: RpcPeer, body: bytes) -> bytes:
        return lw.encode_sessions(self.queues.sessions.load_all())

    def _put_sessions(self, peer: RpcPeer, body: bytes) -> bytes:
        self.queues.sessions.put_many(lw.decode_put_sessions(body))
        return b""

    def _del_session(self, peer: RpcPeer, body: bytes) -> None:
        cid = lw.decode_str_body(body)
        self.queues.sessions.delete(cid)


class NotifyService:
    """Notify over the link: a proxy's REGISTER/UNREGISTER route queues to it in the core's
    `RouteTable`, and what its mailbox coalesces goes out in one EVENTS frame per loop tick.

    Notify travels on the same link as the light queues' pushed entries: a dispatch round
    pushes a watched queue's new entries and then its event, in that order on one socket, so
    the proxy never asks the core for entries that were already on their way to it.
    """

    def __init__(self, routes: RouteTable, proxies: dict[str, RpcPeer]) -> None:
        """`proxies`: the core's proxy id → its current link (`CoreLink.proxies`, shared)."""
        self.routes = routes
        self.proxies = proxies

    def methods(self) -> dict[int, Handler]:
        return {nw.REGISTER: self._register, nw.UNREGISTER: self._unregister}

    def proxy_joined(self, peer: RpcPeer, proxy_id: str) -> None:
        """HELLO: routes start afresh (a restarted proxy re-registers what it wants)."""
        self.routes.drop(proxy_id)
        box = self.routes.mailbox(proxy_id)
        box.on_ready = lambda b: self._ready(peer)

    def proxy_left(self, proxy_id: str) -> None:
        self.routes.drop(proxy_id)

    def _ready(self, peer: RpcPeer) -> None:
        if not peer.state.get("drain"):
            peer.state["drain"] = True
            asyncio.get_running_loop().call_soon(self._drain, peer)

    def _drain(self, peer: RpcPeer) -> None:
        """Everything coalesced for this proxy since the last drain, in one EVENTS frame."""
        pid = peer.state.get("proxy_id")
        if pid is None or self.proxies.get(pid) is not peer:
            peer.state["drain"] = False
            return
        if peer.paused and not peer.is_closing():
            # The proxy is behind reading its link: its events stay in the mailbox, coalesced
            # to one last sequence per queue, so the core's memory does not grow with the
            # backlog; look again shortly (several proxies: one slow one delays only itself).
            asyncio.get_running_loop().call_later(0.01, self._drain, peer)
            return
        peer.state["drain"] = False
        pending = self.routes.mailbox(pid).take()
        if pending:
            peer.send(nw.EVENTS, nw.encode_events(pending.items()))

    def _register(self, peer: RpcPeer, body: bytes) -> None:
        pid = peer.state.get("proxy_id")
        if pid is not None:
            self.routes.register(pid, nw.decode_queues(body), announce=True)

    def _unregister(self, peer: RpcPeer, body: bytes) -> None:
        pid = peer.state.get("proxy_id")
        if pid is not None:
            self.routes.unregister(pid, nw.decode_queues(body))
