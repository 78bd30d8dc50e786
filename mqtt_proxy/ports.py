"""The proxy's typed view of what it uses: the log, the light queues, the notifier, a peer.

Twins stand behind each seam (typed as aiokafka's `record/_protocols.py` types its two
record implementations, so no seam is `Any`): the in-process `Store` and the core link's
`RemoteStore`; the
in-process `InProcessNotifier` and the link's `LinkNotifier`; `LocalBackend` and
`RemoteBackend` in front of the light queues. The proxy code names the `Protocol` here, never
one twin, and mypy checks that every twin satisfies it (`_twins` at the end of
backends/backend.py; `_is_a_peer` at the end of connection/connection.py).

`PeerPort` is what delivery uses of a client connection, `ClientPort` what the session registry,
inbound batching and the rights use of it: they type it without importing
`connection/connection.py` (which imports the handlers, which hold the context of them all).
`GroupHostPort`, `WakePort` and `HandOffPort` are the slices of delivery and of the session
registry that `$share` group delivery and the cluster link use.

Only structure lives here: no behaviour.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from lightqueue.model import Position, ReadResult, StoredMessage
from mqtt_proxy.sessions.topic_filters import FilterSpec
from store.append_result import AppendResult, Run
from store.auth import ClientAcl
from store.mapping import MqttMessage

if TYPE_CHECKING:
    from mqtt_proxy.delivery.topic_aliases import OutAliases
    from mqtt_proxy.sessions.state import Session, Will
    from store.bans import Ban
    from store.latency import LatencyHistogram

# A message delivery reads: one this proxy appended (kept by `remember`), or a stored one.
Message: TypeAlias = MqttMessage | StoredMessage
# Light-queue entries: where each message is in the log, None for a void one.
Entries: TypeAlias = Sequence[Position | None]
# load(..., done): (the read, its messages aligned with its entries), or (None, None) on failure.
LoadDone: TypeAlias = Callable[[ReadResult | None, list[Message | None] | None], None]
Acquired: TypeAlias = tuple[str, int] | str  # (queue, start sequence) or the reason it was refused
# A session as JSON (Session.to_state): values are whatever JSON holds.
SessionState: TypeAlias = dict[str, Any]
EntriesSink: TypeAlias = Callable[[str, int, Entries], None]  # (queue, first sequence, entries)
# A whole dispatch round's pushes at once (in one process): delivery pumps them in the same pass.
RoundSink: TypeAlias = Callable[[Sequence[tuple[str, int, Entries]]], None]
Claimed: TypeAlias = Callable[[dict[str, Any] | None], None]  # the state handed over, or None
Banned: TypeAlias = Callable[["Ban"], None]
# Claims a client id on every node of a Kafka cluster, then `then(moved, handed-over state)`.
NodeClaim: TypeAlias = Callable[[str, Callable[[bool, Any], None]], None]
# One page of retained messages and the cursor of the next (None: that was the last page).
RetainedPageSink: TypeAlias = Callable[[list[StoredMessage], bytes | None], None]


class LogPort(Protocol):
    """The log as the proxy writes it: `Store` in-process, `RemoteStore` over the core link."""

    def append_mqtt(self, messages: Sequence[MqttMessage], sync: bool = True) -> AppendResult:
        """Append MQTT messages; `durable` resolves once they are (see Store.append_mqtt)."""
        ...

    def append_batch(
        self, topic: str, partition: int, batch: bytes, sync: bool = True
    ) -> AppendResult: ...

    def partitions(self, name: str) -> int | None:
        """Partition count of a log topic; None while unknown (in-process: not created yet)."""
        ...

    def ensure_topic(self, name: str) -> int | Awaitable[int]:
        """Create the log topic if needed: at once in-process, awaited over the core link."""
        ...


class NotifierPort(Protocol):
    """Notify as a proxy uses it: `InProcessNotifier`, or `LinkNotifier` over the core link."""

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = False) -> None:
        """Route events of `queues` here; `announce`: their current last sequence at once."""
        ...

    def unregister(self, proxy_id: str, queues: Iterable[str]) -> None: ...

    def drop(self, proxy_id: str) -> None:
        """Forget this proxy (it is closing); ends its `batches`."""
        ...

    def batches(self, proxy_id: str) -> AsyncIterator[dict[str, int]]:
        """Coalesced events, one dict queue -> last sequence per wake-up."""
        ...


class ClusterPort(Protocol):
    """What a proxy asks the core when several proxies share the client ids
    (`backends.cluster.ProxyCluster`): who owns a client id, the wills due if this proxy dies."""

    def claim(self, client_id: str, address: str, done: Claimed, banned: Banned) -> None:
        """Own `client_id` before answering its CONNECT; `done(handed-over state or None)`."""
        ...

    def will(
        self, client_id: str, will: Will | None, expiry: int = 0, due: float | None = None
    ) -> None: ...

    def gone(self, client_id: str) -> None: ...

    @property
    def others_lag(self) -> int:
        """The largest delivery lag of the other proxies (our publishers fill their queues)."""
        ...

    def sys_totals(self, done: Callable[[dict[str, Any]], None]) -> None:
        """The core's sums of every proxy's counters, for `$SYS`."""
        ...


class LeasesPort(Protocol):
    """`$share` group positions held by the core when there are several proxies: delivery takes
    leases of sequences, reports each one done, gives back what a leaving member held."""

    def ask(self, delivery: Any, qs: Any, g: Any) -> None:
        """Lease the group's next sequences; the answer marks the queue for delivery."""
        ...

    def done(self, key: str, seq: int) -> None: ...

    def give_back(self, key: str, seqs: list[int]) -> None: ...


class QueuesPort(Protocol):
    """The light queues, the retained store and the session store as the proxy code calls them:
    `LocalBackend` (in-process, answers inside the call) or `RemoteBackend` (the answer comes
    on the core link's reply). Continuation style, so the callers are correct either way."""

    entries_sink: EntriesSink | None
    round_sink: RoundSink | None
    # With proxies in their own processes: the core's client-id claims, wills and `$share`
    # leases; None in one process.
    cluster: ClusterPort | None
    cache_hits: int
    cache_misses: int
    store: LogPort  # the log this proxy appends to (in process, or over the core link)
    proxy_id: str

    @property
    def recent_count(self) -> int: ...

    @property
    def recent_bytes(self) -> int: ...

    async def start(self) -> None: ...

    def close(self) -> None: ...

    def skip_known_events(self, known: Callable[[str, int], bool]) -> None:
        """Let the notifier drop events whose entries delivery already has (`known(queue,
        seq)`): rounds of this process push their entries before the event is published."""
        ...

    def remember(self, msgs: list[MqttMessage], runs: list[Run]) -> None: ...

    def publish(
        self,
        msgs: list[MqttMessage],
        retained: list[int],
        acked: Callable[[asyncio.Future[None]], None] | None,
        writes: list[asyncio.Future[bytes]],
    ) -> AppendResult:
        """A loop pass's PUBLISHes appended and seen on (`LocalBackend.publish`: the round)."""
        ...

    def set_interest(self, queue: str, on: bool) -> None: ...

    def batches(self) -> AsyncIterator[dict[str, int]]: ...

    def bound_replay(self, spec: FilterSpec, max_depth_ms: int) -> FilterSpec: ...

    def load(self, queue: str, from_seq: int, max_n: int, done: LoadDone) -> None: ...

    def load_entries(self, queue: str, from_seq: int, entries: Entries, done: LoadDone) -> None:
        """`load` for entries already known (pushed): only their messages are looked up."""
        ...

    def acquire_many(self, specs: list[FilterSpec], done: Callable[[list[Acquired]], None]) -> None:
        """Hold the light queue each subscription reads."""
        ...

    async def acquire_all(self, specs: list[FilterSpec]) -> list[Acquired]: ...

    def release(self, queue: str) -> None: ...

    def indexed(self) -> int:
        """Records the dispatcher has indexed (a monotonic counter)."""
        ...

    def retain(
        self, msg: MqttMessage, offset: tuple[str, int, int]
    ) -> asyncio.Future[bytes] | None:
        """Set or clear a retained message; None when done, else the core's answer."""
        ...

    def retained_page(
        self, filt: str, after: bytes | None, limit: int, done: RetainedPageSink
    ) -> None: ...

    async def load_sessions(self) -> list[SessionState]: ...

    def save_sessions(
        self, items: list[tuple[str, SessionState]], done: Callable[[], None] | None = None
    ) -> None: ...

    def delete_session(self, client_id: str) -> None: ...


class PeerPort(Protocol):
    """A client connection as delivery and the session code see it (MqttConnection)."""

    session_overlap: bool  # the session has overlapping subscriptions (set by the sessions)
    out_aliases: OutAliases | None  # server-assigned topic aliases (v5 clients that take them)
    counters: dict[str, int]  # the server's counters, or its internal ones (a probe's connection)

    @property
    def writable(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def v5(self) -> bool: ...

    @property
    def acl(self) -> ClientAcl | None:
        """The client's compiled ACL; None when it may read everything."""
        ...

    @property
    def max_out_packet(self) -> int:
        """The client's Maximum Packet Size; 0 = unlimited."""
        ...

    @property
    def out_window(self) -> int:
        """QoS 1/2 messages the client takes in flight."""
        ...

    @property
    def paused_since(self) -> float:
        """Loop time of the last pause_writing."""
        ...

    def write(self, data: bytes) -> None: ...

    def taken_over(self) -> None:
        """Another connection took the client id: v5 DISCONNECT 0x8E, then close."""
        ...

    def write_delivery(self, data: bytes, n: int, nbytes: int) -> None:
        """`n` PUBLISH packets, `nbytes` long, already joined."""
        ...


class ClientPort(PeerPort, Protocol):
    """A client connection as the layers around it see it (MqttConnection): the session
    registry, inbound batching, the topic rights and the server's bookkeeping, so that none of
    them imports `connection/connection.py`."""

    session: Session | None
    client_id: str
    username: str | None
    remote: str  # "host:port" of the peer
    conn_id: str  # the connection log's id of it
    internal: bool  # a proven internal client (a probe)
    will_on_close: bool  # publish its will when it goes (not on server shutdown)
    transport: asyncio.Transport
    version: int

    def block(self) -> None: ...

    def unblock(self) -> None: ...

    def resume_reading(self) -> None: ...

    def fail(self, reason: int, detail: str) -> None: ...

    def acks_bytes(self, pids: list[int], ptype: int) -> bytes: ...

    def refresh_acl(self) -> None: ...

    def shutdown(self) -> None: ...

    def slow_consumer(self, stuck_s: float) -> None: ...


class GroupHostPort(Protocol):
    """What `$share` group delivery uses of the `Delivery` that drives it: its reads, its marks,
    the core's leases and the latency histogram (typed here, so the two stay out of a cycle)."""

    deliver_latency: LatencyHistogram
    leases: LeasesPort | None

    def mark(self, qs: Any) -> None: ...

    def read_range(self, qs: Any, pos: int) -> tuple[int, int]: ...

    def load(self, qs: Any, seq: int) -> Any: ...


class WakePort(Protocol):
    """What the cluster link uses of delivery: its lag per queue, and a queue to pump again."""

    lag: dict[str, int]
    queues: dict[str, Any]

    def mark(self, qs: Any) -> None: ...


class HandOffPort(Protocol):
    """What the cluster link uses of the session registry: hand a client's session over."""

    def hand_off(self, client_id: str) -> list[str]: ...
