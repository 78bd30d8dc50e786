"""Persistent MQTT sessions in the light-queue DB (`s` prefix): client id → session state.

State, not derived data: `rebuild_queues` keeps it. The state is the proxy's own dict
(mqtt_proxy `Session.to_state`): subscriptions with their options and light-queue position,
outbound QoS 1/2 in flight, inbound QoS 2 packet ids awaiting PUBREL, the will and the expiry.
This module does not interpret it beyond a `client_id` check; it stores it compactly and versioned
(`codec`, FORMAT_V1; bytes stay raw, so the proxy need not hex-encode payloads).

Durability: writes use `sync=False` by default, like the queues: a `kill -9` loses nothing (the
write is in the OS before `put` returns), an OS crash may lose the last few updates. Positions
then lag, which re-delivers (allowed for QoS 1/2, with DUP), never skips. `flush(sync=True)` at
graceful shutdown makes everything durable. Event-loop-only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import plyvel

from lightqueue import codec
from lightqueue.keys import P_BRIDGE, P_GLOBAL, P_SESSION


def _key(client_id: str) -> bytes:
    return P_SESSION + client_id.encode("utf-8")


class SessionStore:
    """client id → session state dict (anything `codec` encodes)."""

    def __init__(self, db: plyvel.DB, sync: bool = False) -> None:
        self._db = db
        self._sync = sync
        # Told of every write (client id, new state or None when deleted): a node of a cluster
        # copies the changed sessions to the other nodes without walking them all.
        self.changed: Callable[[str, dict[str, Any] | None], None] | None = None

    def put(self, client_id: str, state: dict[str, Any]) -> None:
        self._db.put(_key(client_id), codec.encode(state), sync=self._sync)
        if self.changed is not None:
            self.changed(client_id, state)

    def put_many(
        self, items: Iterable[tuple[str, dict[str, Any]]], sync: bool | None = None
    ) -> int:
        """Write several sessions in one WriteBatch (a periodic flush); returns how many."""
        n = 0
        changed = self.changed
        with self._db.write_batch(sync=self._sync if sync is None else sync) as wb:
            for cid, state in items:
                wb.put(_key(cid), codec.encode(state))
                if changed is not None:
                    changed(cid, state)
                n += 1
        return n

    def get(self, client_id: str) -> dict[str, Any] | None:
        v = self._db.get(_key(client_id))
        return None if v is None else codec.decode(v)

    def delete(self, client_id: str) -> None:
        self._db.delete(_key(client_id), sync=self._sync)
        if self.changed is not None:
            self.changed(client_id, None)

    def items(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every stored session (restore after a restart). Unreadable ones raise CodecError."""
        for k, v in self._db.iterator(prefix=P_SESSION):
            yield k[1:].decode("utf-8"), codec.decode(v)

    def load_all(self) -> list[dict[str, Any]]:
        """Every readable session state; corrupt ones are skipped (and left for inspection)."""
        out = []
        for k, v in self._db.iterator(prefix=P_SESSION):
            try:
                state = codec.decode(v)
            except codec.CodecError:
                continue
            if isinstance(state, dict):
                state.setdefault("client_id", k[1:].decode("utf-8"))
                out.append(state)
        return out

    def flush(self) -> None:
        """Make every write so far durable (one synced empty batch flushes LevelDB's log)."""
        with self._db.write_batch(sync=True) as wb:
            wb.put(P_GLOBAL + b"flush", b"")


class BridgePositions:
    """Where each MQTT bridge stands in each light queue it forwards (`b` prefix): bridge name
    and queue → the first sequence the remote has not acknowledged. State, like sessions (kept
    by `rebuild_queues`), written the same way: `sync=False` survives a `kill -9`; a lagging
    position re-sends, it never skips."""

    def __init__(self, db: plyvel.DB) -> None:
        self._db = db

    @staticmethod
    def _key(bridge: str, queue: str) -> bytes:
        return P_BRIDGE + bridge.encode("utf-8") + b"\x00" + queue.encode("utf-8")

    def get(self, bridge: str, queue: str) -> int | None:
        v = self._db.get(self._key(bridge, queue))
        return None if v is None else int(v)

    def put_many(self, bridge: str, positions: Iterable[tuple[str, int]]) -> None:
        with self._db.write_batch() as wb:
            for queue, seq in positions:
                wb.put(self._key(bridge, queue), str(seq).encode())

    def forget(self, bridge: str) -> None:
        """Drop a bridge's positions (it was removed, or asked to start over)."""
        with self._db.write_batch() as wb:
            for k in self._db.iterator(prefix=P_BRIDGE + bridge.encode("utf-8") + b"\x00",
                                       include_value=False):  # fmt: skip
                wb.delete(k)
