"""The light queues as an MQTT proxy in another process sees them: `RemoteLightQueues`.

The client half of the light queues' methods (bodies in `lightqueue.wire`, transport
`notify.link`; the service half is `lightgate.link_services.LightQueueService`). Calls that
need an answer return futures; the core answers in link order, so an entry in a READ reply
always belongs to an append whose reply this proxy already has. Event-loop-only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from lightqueue import wire
from lightqueue.model import ReadResult, StoredMessage
from notify.link import Handler, RpcPeer
from store.mapping import MqttProperties

if TYPE_CHECKING:
    from mqtt_proxy.ports import Entries, EntriesSink, SessionState

T = TypeVar("T")


class RemoteLightQueues:
    """What a proxy uses of `LightQueues`, over the core link; calls return futures.

    Construct, put `methods()` into the link's method table, then `attach(peer)`.
    """

    def __init__(self) -> None:
        self.peer: RpcPeer | None = None
        self.indexed = 0  # the core dispatcher's record count, pushed after its rounds
        # Where pushed entries of watched queues go: (queue, first sequence, entries).
        self.entries_sink: EntriesSink | None = None

    def methods(self) -> dict[int, Handler]:
        return {wire.INDEXED: self._on_indexed, wire.ENTRIES: self._on_entries}

    def _on_entries(self, peer: RpcPeer, body: bytes) -> None:
        sink = self.entries_sink
        for queue, first, entries in wire.decode_pushed(body):
            if sink is not None:
                sink(queue, first, entries)

    def watch(self, queue: str, on: bool) -> None:
        """Have the core push `queue`'s new entries (ENTRIES), or stop."""
        assert self.peer is not None
        self.peer.send(wire.WATCH if on else wire.UNWATCH, wire.str_body(queue))

    def attach(self, peer: RpcPeer) -> None:
        self.peer = peer

    def _on_indexed(self, peer: RpcPeer, body: bytes) -> None:
        self.indexed = wire.decode_indexed(body)

    def _call(self, method: int, body: bytes) -> asyncio.Future[bytes]:
        assert self.peer is not None
        return self.peer.call(method, body)

    def read(self, queue: str, from_seq: int, max_n: int) -> asyncio.Future[ReadResult]:
        body = wire.encode_read(queue, from_seq, max_n)
        return _then(self._call(wire.READ, body), wire.decode_read_reply)

    def resolve(self, entries: Entries) -> asyncio.Future[list[StoredMessage | None]]:
        body = wire.encode_resolve(entries)
        return _then(self._call(wire.RESOLVE, body), wire.decode_messages)

    def acquire_many(
        self, items: list[tuple[str, int | None]]
    ) -> asyncio.Future[list[tuple[str, int] | str]]:
        """Per item (queue, start sequence), or the error text when it was refused."""
        body = wire.encode_acquire(items)
        return _then(self._call(wire.ACQUIRE, body), wire.decode_acquire_reply)

    def release(self, queue: str) -> None:
        assert self.peer is not None
        self.peer.send(wire.RELEASE, wire.str_body(queue))

    def retain(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        client_id: str,
        properties: MqttProperties | None,
        timestamp_ms: int,
        position: tuple[str, int, int],
    ) -> asyncio.Future[bytes]:
        """Set (empty payload: clear) a retained message; the answer comes once it is written."""
        assert self.peer is not None
        body = wire.encode_retain(
            topic, payload, qos, client_id, properties, timestamp_ms, position
        )
        return self.peer.call(wire.RETAIN, body)

    def retained_page(
        self, filt: str, after: bytes | None, limit: int
    ) -> asyncio.Future[tuple[list[StoredMessage], bytes | None]]:
        body = wire.encode_retained_req(filt, after, limit)
        return _then(self._call(wire.RETAINED, body), wire.decode_retained_page)

    async def load_sessions(self) -> list[SessionState]:
        return wire.decode_sessions(await self._call(wire.SESSIONS, b""))

    def put_sessions(
        self, items: list[tuple[str, SessionState]], wait: bool = False
    ) -> asyncio.Future[bytes] | None:
        """Write sessions in the core; with `wait`, a future that resolves once written."""
        assert self.peer is not None
        body = wire.encode_put_sessions(items)
        if wait:
            return self.peer.call(wire.PUT_SESSIONS, body)
        self.peer.send(wire.PUT_SESSIONS, body)
        return None

    def delete_session(self, client_id: str) -> None:
        assert self.peer is not None
        self.peer.send(wire.DEL_SESSION, wire.str_body(client_id))


def _then(fut: asyncio.Future[bytes], decode: Callable[[bytes], T]) -> asyncio.Future[T]:
    """A future of `decode(reply)` (decoding errors and RpcErrors land in it)."""
    out: asyncio.Future[T] = asyncio.get_running_loop().create_future()

    def done(f: asyncio.Future[bytes]) -> None:
        if out.done():
            return
        if f.cancelled():
            out.cancel()
        elif (failed := f.exception()) is not None:
            out.set_exception(failed)
        else:
            try:
                out.set_result(decode(f.result()))
            except Exception as exc:
                out.set_exception(exc)

    fut.add_done_callback(done)
    return out
