"""The proxy's view of the layers below: store, light queues, notify, sessions, retained.

One small adapter so the MQTT code names what it needs (positions, holds, retained lookups,
session state) once, and the calls into `lightqueue` / `notify` live in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from mqtt_proxy.subscriptions import FilterSpec

log = logging.getLogger("lightgate.mqtt.backend")


class Backend:
    def __init__(self, store: Any, queues: Any, notifier: Any, proxy_id: str) -> None:
        self.store = store
        self.queues = queues
        self.notifier = notifier
        self.proxy_id = proxy_id
        self._holds: dict[str, int] = {}  # wildcard filter -> holders in this proxy

    # -- reading ---------------------------------------------------------------------------
    def read(self, queue: str, from_seq: int, max_n: int) -> Any:
        return self.queues.read(queue, from_seq, max_n)

    def resolve(self, entries: Any) -> list[Any]:
        return self.queues.resolve(entries)

    def queue_end(self, queue: str) -> int:
        """The next sequence the queue will assign: where a live subscription starts."""
        if self.queues is None:
            return 0
        return self.queues.next_seq(queue)

    # -- notify ----------------------------------------------------------------------------
    def set_interest(self, queue: str, on: bool) -> None:
        if self.notifier is None:
            return
        if on:
            self.notifier.register(self.proxy_id, [queue])
        else:
            self.notifier.unregister(self.proxy_id, [queue])

    async def events(self) -> AsyncIterator[Any]:
        if self.notifier is None:
            return
        async for ev in self.notifier.events(self.proxy_id):
            yield ev

    # -- subscriptions ---------------------------------------------------------------------
    def subscribe_position(self, spec: FilterSpec) -> int:
        """Where a new subscription starts: the live end, or the replay start."""
        if spec.replay_since_ms is not None:
            return self.queues.replay_start(spec.filter, spec.replay_since_ms)
        return self.queue_end(spec.filter)

    def hold(self, spec: FilterSpec) -> None:
        """A subscription (live or persistent) needs the light queue of `spec.filter`."""
        filt = spec.filter
        n = self._holds.get(filt, 0)
        self._holds[filt] = n + 1
        if n == 0 and self.queues is not None:
            self.queues.acquire(filt)

    def release(self, spec: FilterSpec) -> None:
        filt = spec.filter
        n = self._holds.get(filt, 0) - 1
        if n > 0:
            self._holds[filt] = n
            return
        self._holds.pop(filt, None)
        if self.queues is not None:
            self.queues.release(filt)

    def bound_replay(self, spec: FilterSpec, max_depth_ms: int) -> FilterSpec:
        """Apply `max_replay_depth_ms`: a replay never reaches further back than that."""
        floor = int(time.time() * 1000) - max_depth_ms
        since = spec.replay_since_ms
        if since is not None and since < floor:
            return replace(spec, replay_since_ms=floor)
        return spec

    # -- retained --------------------------------------------------------------------------
    def retain(self, msg: Any, offset: tuple[str, int, int]) -> None:
        if self.queues is None:
            return
        if msg.payload:
            self.queues.retained.set(msg.topic, offset)
        else:
            self.queues.retained.clear(msg.topic)

    def retained_for(self, filt: str) -> list[Any]:
        if self.queues is None:
            return []
        return self.queues.retained_messages(filt)

    # -- sessions --------------------------------------------------------------------------
    def load_sessions(self) -> list[dict[str, Any]]:
        if self.queues is None:
            return []
        return list(self.queues.sessions.load_all())

    def save_session(self, client_id: str, state: dict[str, Any]) -> None:
        if self.queues is not None:
            self.queues.sessions.save(client_id, state)

    def delete_session(self, client_id: str) -> None:
        if self.queues is not None:
            self.queues.sessions.delete(client_id)

    def close(self) -> None:
        if self.notifier is not None:
            try:
                self.notifier.unregister(self.proxy_id, None)
            except Exception:  # pragma: no cover - best effort on shutdown
                pass
