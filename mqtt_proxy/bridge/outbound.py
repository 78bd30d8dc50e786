"""Out: forward from the log to the remote, one light queue per `out` rule, at least once.

Each rule's local filter is a light queue (the exact topic's or the wildcard filter's, held like
a subscription's); the bridge reads it from its committed position, which lives in LevelDB
(`LightQueues.bridges`) and advances over a run of entries only once each is settled: a QoS 1
message PUBACKed by the remote, a QoS 0 one written, a void or own message skipped. Nothing is
buffered beyond what is in flight: after a restart or an outage of either side, forwarding
starts again at the committed position (a message in flight then is sent again), so an outage
within retention loses nothing and per-topic order is kept.

In flight is bounded by the remote's Receive Maximum (v5) and `max_inflight` (both versions).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from lightqueue import LightQueues
from lightqueue.model import StoredMessage
from mqtt_proxy.bridge.settings import BridgeSettings, TopicRule
from mqtt_proxy.codec import make_properties
from mqtt_proxy.codec.properties import EMPTY_PROPERTIES, Properties

# send(topic, payload, qos, packet id, retain, properties): write one PUBLISH to the remote;
# False when the remote cannot take it (larger than its Maximum Packet Size).
Send = Callable[[str, bytes, int, int, bool, Properties], bool]
log = logging.getLogger("lightgate.bridge")
MARKER = "lightgate-bridge"  # user property naming the bridge a v5 message went out through


@dataclass(slots=True)
class Pending:
    """One entry read and not yet settled; `done` once it may be committed past."""

    seq: int
    timestamp_ms: int
    done: bool


@dataclass(slots=True)
class OutQueue:
    rule: TopicRule
    queue: str
    committed: int  # first sequence the remote has not settled (durable in LevelDB)
    next_seq: int = 0  # next sequence to read
    pending: deque[Pending] = field(default_factory=deque)
    head_ts_ms: int = 0  # receive time of the message at `committed` (0: unknown or none)


def v5_properties(m: StoredMessage, marker: str) -> Properties:
    """The MQTT 5 properties a stored message carries on, plus the bridge's loop marker."""
    p = m.properties
    users = ((MARKER, marker),)
    if p is None:
        return make_properties(user_properties=users)
    kw: dict[str, object] = {"user_properties": tuple(p.user_properties) + users}
    if p.payload_format is not None:
        kw["payload_format_indicator"] = p.payload_format
    if p.message_expiry is not None:
        left = p.message_expiry - (int(time.time() * 1000) - m.timestamp_ms) // 1000
        kw["message_expiry_interval"] = max(1, left)
    if p.content_type is not None:
        kw["content_type"] = p.content_type
    if p.response_topic is not None:
        kw["response_topic"] = p.response_topic
    if p.correlation_data is not None:
        kw["correlation_data"] = p.correlation_data
    return make_properties(**kw)


class Forwarder:
    """The out half of one bridge: its queues, their positions, the QoS 1 window."""

    def __init__(self, settings: BridgeSettings, queues: LightQueues) -> None:
        self.settings = settings
        self.queues = queues
        self.out: list[OutQueue] = []
        self.inflight: dict[int, tuple[OutQueue, Pending]] = {}  # packet id -> its entry
        self._next_pid = 0
        self.forwarded = 0
        self.too_large = 0

    def acquire(self) -> list[str]:
        """Hold each out rule's light queue; a bridge seen before resumes at its position."""
        name = self.settings.name
        positions = self.queues.bridges
        fresh: list[tuple[str, int]] = []
        for rule in self.settings.out_rules:
            got = self.queues.acquire_filter(rule.local_filter)
            committed = positions.get(name, got.queue)
            if committed is None:  # a new bridge: from now on
                committed = got.start_seq
                fresh.append((got.queue, committed))
            self.out.append(OutQueue(rule, got.queue, committed, committed))
        if fresh:
            positions.put_many(name, fresh)
        return [oq.queue for oq in self.out]

    def release(self) -> None:
        for oq in self.out:
            self.queues.release_filter(oq.queue)

    def restart(self) -> None:
        """A new connection: everything not settled is sent again from the committed position."""
        self.inflight.clear()
        for oq in self.out:
            oq.pending.clear()
            oq.next_seq = oq.committed

    def _pid(self) -> int:
        pid = self._next_pid
        for _ in range(65536):
            pid = pid % 65535 + 1
            if pid not in self.inflight:
                self._next_pid = pid
                return pid
        raise RuntimeError("no free packet id")  # cannot happen: the window is < 65535

    def window(self, receive_maximum: int) -> int:
        """QoS 1 messages that may be sent now."""
        return min(receive_maximum, self.settings.max_inflight) - len(self.inflight)

    async def pump(self, send: Send, drain: Callable[[], Awaitable[None]], quota: int) -> int:
        """Read and send what the window `quota` allows, draining the socket after each batch
        read (a backlog of QoS 0 takes no window); returns how many messages were written."""
        lq = self.queues
        s = self.settings
        identity = s.identity
        v5 = s.protocol == 5
        written = 0
        now_ms = int(time.time() * 1000)
        for oq in self.out:
            rule = oq.rule
            while quota > 0:
                res = lq.read(oq.queue, oq.next_seq, min(quota, s.batch))
                if not res.entries:
                    if res.first_seq > oq.next_seq:  # retention trimmed what we had not read
                        oq.next_seq = res.first_seq
                    break
                if lq.remote_reads:
                    await lq.prefetch(res.entries)
                msgs = lq.resolve(res.entries)
                seq = res.first_seq
                for m in msgs:
                    if m is None or m.client_id == identity or m.expired(now_ms):
                        oq.pending.append(Pending(seq, 0, True))
                    else:
                        qos = min(m.qos, rule.qos, 1)
                        props = v5_properties(m, s.name) if v5 else EMPTY_PROPERTIES
                        entry = Pending(seq, m.timestamp_ms, qos == 0)
                        pid = self._pid() if qos else 0
                        if send(rule.to_remote(m.topic), m.payload, qos, pid, m.retain, props):
                            if qos:
                                self.inflight[pid] = (oq, entry)
                                quota -= 1
                            written += 1
                        else:
                            entry.done = True
                            self.too_large += 1
                            if self.too_large == 1:
                                log.warning("bridge %s: a message on %s is larger than the "
                                            "remote's maximum packet size; skipped", s.name,
                                            m.topic, extra={"bridge": s.name})  # fmt: skip
                        oq.pending.append(entry)
                    seq += 1
                oq.next_seq = seq
                await drain()
        self.forwarded += written
        return written

    def acked(self, packet_ids: Sequence[int]) -> None:
        for pid in packet_ids:
            got = self.inflight.pop(pid, None)
            if got is not None:
                got[1].done = True

    def settle(self) -> None:
        """Commit each queue's settled prefix (one LevelDB write for all that moved)."""
        moved: list[tuple[str, int]] = []
        for oq in self.out:
            pend = oq.pending
            start = oq.committed
            while pend and pend[0].done:
                pend.popleft()
            new = pend[0].seq if pend else oq.next_seq
            oq.head_ts_ms = pend[0].timestamp_ms if pend else 0
            if new != start:
                oq.committed = new
                moved.append((oq.queue, new))
        if moved:
            self.queues.bridges.put_many(self.settings.name, moved)

    async def prefetch_heads(self) -> None:
        """Cluster log: bring in the first unsettled record of each queue that is behind and
        whose time is unknown (the remote is away, nothing was read), so `lag` can age it."""
        lq = self.queues
        if not lq.remote_reads:
            return
        for oq in self.out:
            last = lq.last_seq(oq.queue)
            if not oq.head_ts_ms and last is not None and last >= oq.committed:
                res = lq.read(oq.queue, oq.committed, 1)
                if res.entries:
                    await lq.prefetch(res.entries)

    def lag(self) -> tuple[int, float]:
        """(messages the remote has not settled, seconds since the oldest of them arrived)."""
        lq = self.queues
        total = 0
        oldest = 0
        for oq in self.out:
            last = lq.last_seq(oq.queue)
            behind = 0 if last is None else max(0, last + 1 - oq.committed)
            total += behind
            if not behind:
                continue
            ts = oq.head_ts_ms
            if not ts:
                res = lq.read(oq.queue, oq.committed, 1)
                if res.entries:  # cluster log: known once `prefetch_heads` brought it in
                    m = lq.resolve(res.entries)[0]
                    ts = oq.head_ts_ms = m.timestamp_ms if m is not None else 0
            if ts and (not oldest or ts < oldest):
                oldest = ts
        secs = max(0.0, time.time() - oldest / 1000) if oldest else 0.0
        return total, round(secs, 3)
