"""The proxy's view of the layers below: store, light queues, notify, sessions, retained.

One small adapter so the MQTT code names what it needs (positions, holds, retained lookups,
session state) once, and the calls into `lightqueue` / `notify` live in one place.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from itertools import islice
from typing import Any

from mqtt_proxy.subscriptions import FilterSpec

log = logging.getLogger("lightgate.mqtt.backend")

RECENT_MAX = 65536  # appended messages kept for delivery without a store read


class Backend:
    def __init__(self, store: Any, queues: Any, notifier: Any, proxy_id: str) -> None:
        self.store = store
        self.queues = queues
        self.notifier = notifier
        self.proxy_id = proxy_id
        self._recent: dict[tuple[str, int, int], Any] = {}

    # -- reading ---------------------------------------------------------------------------
    def read(self, queue: str, from_seq: int, max_n: int) -> Any:
        return self.queues.read(queue, from_seq, max_n)

    def resolve(self, entries: list[Any]) -> list[Any]:
        """Messages for light-queue entries: from this proxy's recent appends when it published
        them itself (no store read, no batch parse), else through the store in one batched read."""
        recent = self._recent
        out: list[Any] = [None] * len(entries)
        missing: list[int] = []
        for i, e in enumerate(entries):
            if e is None:
                continue
            m = recent.get(e)
            if m is None:
                missing.append(i)
            else:
                out[i] = m
        if missing:
            got = self.queues.resolve([entries[i] for i in missing])
            for i, m in zip(missing, got, strict=True):
                out[i] = m
        return out

    def remember(self, msgs: list[Any], offsets: list[tuple[str, int, int]]) -> None:
        """Keep what this proxy just appended, keyed by log position, for `resolve`. The
        MqttMessage itself serves: it has every field delivery reads (timestamp set at receipt)."""
        recent = self._recent
        recent.update(zip(offsets, msgs, strict=True))
        over = len(recent) - RECENT_MAX
        if over > 0:
            for k in list(islice(recent, over + RECENT_MAX // 8)):
                del recent[k]

    # -- notify ----------------------------------------------------------------------------
    def set_interest(self, queue: str, on: bool) -> None:
        if on:
            # announce: the notifier answers with the queue's current last sequence at once.
            self.notifier.register(self.proxy_id, [queue], announce=True)
        else:
            self.notifier.unregister(self.proxy_id, [queue])

    async def batches(self) -> AsyncIterator[dict[str, int]]:
        """Coalesced notify events, one dict queue -> last sequence per wake-up."""
        async for batch in self.notifier.batches(self.proxy_id):
            yield batch

    # -- subscriptions ---------------------------------------------------------------------
    def acquire(self, spec: FilterSpec) -> tuple[str, int]:
        """Hold the light queue a subscription reads; (queue name, where a new one starts).

        The live end for a plain filter, the first history entry for a replay (its own queue,
        `$replay/<since>/<filter>`, which goes live after the backfill). Each acquire needs one
        `release(queue)`; restoring a persistent session acquires again (the holds are in memory).
        """
        a = self.queues.acquire_filter(spec.filter, spec.replay_since_ms)
        return a.queue, a.start_seq

    def indexed(self) -> int:
        """Records the dispatcher has indexed since it opened (a monotonic counter)."""
        return int(self.queues.dispatcher.records)

    def release(self, queue: str) -> None:
        self.queues.release_filter(queue)

    def bound_replay(self, spec: FilterSpec, max_depth_ms: int) -> FilterSpec:
        """Apply `max_replay_depth_ms`: a replay never reaches further back than that."""
        floor = int(time.time() * 1000) - max_depth_ms
        since = spec.replay_since_ms
        if since is not None and since < floor:
            return replace(spec, replay_since_ms=floor)
        return spec

    # -- retained --------------------------------------------------------------------------
    def retain(self, msg: Any, offset: tuple[str, int, int]) -> None:
        """Set (or, with an empty payload, clear) the retained message of `msg.topic`."""
        self.queues.retained.set(
            msg.topic, msg.payload, msg.qos, msg.client_id, msg.properties, msg.timestamp_ms, offset
        )

    def retained_for(self, filt: str) -> list[Any]:
        """Unexpired retained messages matching `filt` (a tree walk, not a scan)."""
        return self.queues.retained.match(filt)

    # -- sessions --------------------------------------------------------------------------
    def load_sessions(self) -> list[dict[str, Any]]:
        return list(self.queues.sessions.load_all())

    def save_sessions(self, items: list[tuple[str, dict[str, Any]]]) -> None:
        if items:
            self.queues.sessions.put_many(items)

    def delete_session(self, client_id: str) -> None:
        self.queues.sessions.delete(client_id)

    def close(self) -> None:
        self.notifier.drop(self.proxy_id)
