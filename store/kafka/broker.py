"""The broker: state shared by all connections, and request dispatch to the API handlers.

One `Broker` serves one `Store`. It owns the group coordinator (with its timer), committed offsets,
idempotent-producer state, and the waiters of long-polling fetches, woken by the store's append
listener. Handlers live in `handlers_log.py` and `handlers_produce.py` (data plane) and
`handlers_group.py` (groups); each is `async def handler(broker, request, conn) -> kio response |
None` and does all its log appends before its first `await`, so appends happen in request order
on a connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from store.latency import LatencyHistogram
from store.mapping import is_valid_log_topic

from . import handlers_admin, handlers_group, handlers_log, handlers_produce, handlers_txn
from .config import KafkaConfig
from .groups import Delivery, GroupCoordinator
from .handlers_sasl import SecurityView
from .offsets import OffsetStore
from .producers import ProducerStateManager
from .protocol import Request
from .txn import TransactionCoordinator

__all__ = ["Broker", "ConnInfo"]

if TYPE_CHECKING:
    from store.store import Store

log = logging.getLogger("lightgate.kafka")


@dataclass(frozen=True, slots=True)
class ConnInfo:
    """What handlers may know about the connection a request came on."""

    peer_host: str
    local_host: str
    local_port: int
    user: str | None = None  # proved by SASL; None: anonymous (or not yet authenticated)
    acl: Any = None  # an OAUTHBEARER token's own rights (store.auth.ClientAcl), else None


Handler = Callable[["Broker", Request, ConnInfo], Awaitable[Any]]

HANDLERS: dict[int, Handler] = {
    0: handlers_produce.produce,
    1: handlers_log.fetch,
    2: handlers_log.list_offsets,
    3: handlers_log.metadata,
    8: handlers_group.offset_commit,
    9: handlers_group.offset_fetch,
    10: handlers_group.find_coordinator,
    11: handlers_group.join_group,
    12: handlers_group.heartbeat,
    13: handlers_group.leave_group,
    14: handlers_group.sync_group,
    15: handlers_group.describe_groups,
    16: handlers_group.list_groups,
    18: handlers_log.api_versions,
    19: handlers_log.create_topics,
    20: handlers_admin.delete_topics,
    21: handlers_admin.delete_records,
    22: handlers_log.init_producer_id,
    32: handlers_admin.describe_configs,
    33: handlers_admin.alter_configs,
    35: handlers_admin.describe_log_dirs,
    37: handlers_admin.create_partitions,
    42: handlers_admin.delete_groups,
    44: handlers_admin.incremental_alter_configs,
    47: handlers_admin.offset_delete,
    60: handlers_admin.describe_cluster,
}
# Transactions (store/kafka/txn.py)
HANDLERS.update({
    24: handlers_txn.add_partitions_to_txn,
    25: handlers_txn.add_offsets_to_txn,
    26: handlers_txn.end_txn,
    28: handlers_txn.txn_offset_commit,
})  # fmt: skip


class Broker:
    """Event-loop-only."""

    def __init__(
        self,
        store: Store,
        config: KafkaConfig,
        state_dir: Path,
        security: SecurityView | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.security = security  # shared with the gateway: read at each use, never copied
        self._acl_seen: object = None
        self._acl_cache: dict[tuple[str | None, str, str, str], bool] = {}
        self.groups = GroupCoordinator(
            min_session_timeout_ms=config.group_min_session_timeout_ms,
            max_session_timeout_ms=config.group_max_session_timeout_ms,
            initial_rebalance_delay_ms=config.group_initial_rebalance_delay_ms,
        )
        self.offsets = OffsetStore(state_dir)
        for group in self.offsets.groups():
            self.groups.ensure_group(group)
        self.producers = ProducerStateManager(state_dir)
        self.txns = TransactionCoordinator(
            state_dir, store, self.producers, self.offsets, self.note_durable
        )
        self._waiters: dict[tuple[str, int], set[asyncio.Future[None]]] = {}
        self._last_durable: dict[tuple[str, int], asyncio.Future[None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._expire_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.port = 0
        # Prometheus-style counters, exported by KafkaServer.stats().
        self.counters = {"requests": 0, "produce_bytes": 0, "produce_records": 0,
                         "fetch_bytes": 0, "fetch_records": 0, "protocol_errors": 0,
                         "auth_failures": 0, "authorization_failures": 0,
                         "produce_throttled": 0, "connections_refused": 0}  # fmt: skip
        # (api key, error code) -> responses, and Produce request → response latency: /metrics
        self.responses: dict[tuple[int, int], int] = {}
        self.produce_latency = LatencyHistogram()

    async def start(self) -> None:
        topics = self.store.topics()
        n = self.producers.recover(
            topics, self.store.high_watermark, self.store.log_start_offset, self.store.read
        )
        self.producers.snapshot()
        log.info("kafka producer state recovered", extra={"batches_replayed": n})
        self.store.add_append_listener(self._on_append)
        self.store.add_topic_listener(self._on_topic_event)
        n = await self.txns.recover()  # before any client: no transaction stays half open
        if n:
            log.warning("kafka: %d transactions open at the last stop were ended", n)
        loop = asyncio.get_running_loop()
        self._snapshot_task = loop.create_task(self._snapshot_loop())
        self._expire_task = loop.create_task(self._expire_loop())

    async def close(self) -> None:
        with contextlib.suppress(ValueError):
            self.store.remove_topic_listener(self._on_topic_event)
        for t in list(self._tasks):
            await asyncio.gather(t, return_exceptions=True)
        for task in (self._snapshot_task, self._expire_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._timer is not None:
            self._timer.cancel()
        for waiters in self._waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        await self.txns.close()
        self.producers.snapshot()
        self.offsets.close()

    async def handle(self, request: Request, conn: ConnInfo) -> Any:
        """Run the request's handler; returns the kio response (None: send nothing)."""
        self.counters["requests"] += 1
        return await HANDLERS[request.api_key](self, request, conn)

    # --- authorization -----------------------------------------------------------------------

    def authorized(
        self, conn: ConnInfo, client_id: str | None, topic: str, access: str, count: bool = True
    ) -> bool:
        """May this connection `access` ("read" / "write") log topic `topic`?

        A log topic is one stream of every MQTT topic under it, so the ACL must allow the access
        on all of them (`Acl.covers_subtree`). "describe" (Metadata, ListOffsets, configs) is read
        or write, as Kafka implies Describe from Read and Write. Answers are cached per ACL
        object; a reload installs a new one, so the cache empties itself. `count`: add a refusal
        to the `authorization_failures` counter (not for topics merely left out of a listing).
        """
        own = conn.acl
        if own is not None:  # a token's rights replace the acl_file's
            if access == "describe":
                allowed = own.covers_subtree(topic, "read") or own.covers_subtree(topic, "write")
            else:
                allowed = own.covers_subtree(topic, access)
            if not allowed and count:
                self.counters["authorization_failures"] += 1
            return bool(allowed)
        sec = self.security
        acl = None if sec is None else sec.acl
        if acl is None or acl.allows_everything:
            return True
        if access == "describe":
            allowed = self._allowed(acl, conn.user, client_id or "", topic, "read")
            allowed = allowed or self._allowed(acl, conn.user, client_id or "", topic, "write")
        else:
            allowed = self._allowed(acl, conn.user, client_id or "", topic, access)
        if not allowed and count:
            self.counters["authorization_failures"] += 1
        return allowed

    def _allowed(self, acl: Any, user: str | None, client_id: str, topic: str, access: str) -> bool:
        cache = self._acl_cache
        if acl is not self._acl_seen or len(cache) > 100_000:
            cache.clear()
            self._acl_seen = acl
        key = (user, client_id, topic, access)
        allowed = cache.get(key)
        if allowed is None:
            allowed = cache[key] = bool(acl.covers_subtree(topic, access, user, client_id))
        return allowed

    def count_response(self, api_key: int, response: Any) -> None:
        """Count one response by API and error code (the first non-zero one it carries)."""
        key = (api_key, error_code_of(response))
        self.responses[key] = self.responses.get(key, 0) + 1

    # --- topics ----------------------------------------------------------------------------

    @staticmethod
    def legal_topic(name: str) -> bool:
        return is_valid_log_topic(name)

    def partitions(self, topic: str) -> int | None:
        return self.store.topics().get(topic)

    def topic_id(self, name: str) -> uuid.UUID:
        """The topic's id; a deleted and re-created topic has a new one, as in Kafka."""
        if self.store.partitions(name) is None:
            return uuid.UUID(int=0)
        return self.store.topic_uuid(name)

    def _on_topic_event(self, event: str, topic: str) -> None:
        """A deleted topic takes its producer state and committed offsets along; long polls
        waiting on it return (the next fetch says the topic is unknown)."""
        if event != "deleted":
            return
        self.producers.forget_topic(topic)
        t = asyncio.get_running_loop().create_task(self.offsets.delete(None, None, topic=topic))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        for key in [k for k in self._waiters if k[0] == topic]:
            for fut in self._waiters.pop(key):
                if not fut.done():
                    fut.set_result(None)

    # --- durability of duplicates ------------------------------------------------------------

    def note_durable(self, topic: str, partition: int, fut: asyncio.Future[None]) -> None:
        self._last_durable[(topic, partition)] = fut

    def last_durable(self, topic: str, partition: int) -> asyncio.Future[None] | None:
        """For a retried (duplicate) batch: durable once everything appended before it is."""
        fut = self._last_durable.get((topic, partition))
        return None if fut is None or fut.done() else fut

    # --- fetch long-poll ---------------------------------------------------------------------

    def _on_append(self, topic: str, partition: int, new_hwm: int) -> None:
        self.producers.advance(topic, partition, new_hwm)
        waiters = self._waiters.pop((topic, partition), None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    async def wait_for_append(self, keys: list[tuple[str, int]], timeout: float) -> None:
        """Return after an append to any of `keys`, or after `timeout` seconds."""
        if timeout <= 0:
            return
        fut = asyncio.get_running_loop().create_future()
        for key in keys:
            self._waiters.setdefault(key, set()).add(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            for key in keys:
                waiters = self._waiters.get(key)
                if waiters is not None:
                    waiters.discard(fut)
                    if not waiters:
                        del self._waiters[key]

    # --- group coordinator plumbing --------------------------------------------------------

    @staticmethod
    def now_ms() -> float:
        return time.monotonic() * 1000.0

    def deliver(self, deliveries: list[Delivery]) -> None:
        """Complete the futures the coordinator decided, then re-arm its timer."""
        for fut, result in deliveries:
            if not fut.done():
                fut.set_result(result)
        self._arm_timer()

    def _arm_timer(self) -> None:
        at = self.groups.next_deadline()
        if at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            delay = max(0.0, (at - self.now_ms()) / 1000.0) + 0.001
            self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = self._timer_at = None
        self.deliver(self.groups.poll(self.now_ms()))

    async def _expire_loop(self) -> None:
        """Abort transactions past their timeout (Kafka checks every 10 s; we check each second)."""
        while True:
            await asyncio.sleep(1.0)
            try:
                await self.txns.expire()
            except Exception:
                log.exception("kafka transaction expiry failed")

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.producer_snapshot_interval_s)
            if self.producers.dirty:
                doc = self.producers.export()
                try:
                    await asyncio.get_running_loop().run_in_executor(
                        None, self.producers.write_snapshot, doc
                    )
                except OSError:  # state stays rebuildable from the log; try again next time
                    log.exception("kafka producer snapshot failed")
                    self.producers.dirty = True


def error_code_of(response: Any) -> int:
    """The response's top-level error code, else the first non-zero one of its topics or their
    partitions (Produce, Fetch, ListOffsets, ...): enough to tell failing requests apart."""
    code = getattr(response, "error_code", None)
    if code:
        return int(code)
    for name in ("responses", "topics", "results"):
        for t in getattr(response, name, None) or ():
            code = getattr(t, "error_code", None)
            if code:
                return int(code)
            for pname in ("partition_responses", "partitions"):
                for p in getattr(t, pname, None) or ():
                    code = getattr(p, "error_code", None)
                    if code:
                        return int(code)
    return 0
