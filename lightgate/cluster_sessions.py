"""Client-id ownership and session hand-over between nodes on one Kafka cluster (`log = "kafka"`).

Every node of a Kafka-backed deployment reads and writes one topic of the cluster,
`cluster_sessions_topic` (one partition, keyed by client id): the log's order is the only
arbiter, so nothing here votes or elects. Theory of operation:

- **Claim.** Before a node answers a CONNECT it appends `claim` {node, id} for the client id and
  reads the topic until it sees its own record. The owner before it, in the topic's order, is
  the node that must let go. The latest claim wins: a node that reads another node's claim for
  an id it owns (or has a connection or session of) ends that connection (v5 DISCONNECT 0x8E,
  3.1.1 close) and hands the session over. While a claim of its own for that id is in
  progress, the order decides what goes: a claim read after ours waits until ours is done and
  ends the connection ours opened; one read before ours (ours comes later in the topic) gets
  what the node has now at once, and ours then takes it back from that claimer.
- **Hand-over.** The old owner writes the session's final state in log positions
  (lightgate.session_positions) as `state` {node, for: claim id, s} (or `gone` when it has no
  persistent session) and forgets its own copy. The claimer waits for that record at most
  `cluster_handover_wait_ms`, then installs the newest stored state it has read for the id (or
  none), mapped onto its own light queues. A claim whose previous owner is this node needs no
  wait: the local session store is current.
- **Start.** A node reads the topic from its start before it serves, so it knows every owner and
  stored state. The topic is meant to be compacted (`cleanup.policy=compact`): only the newest
  record per client id matters once its hand-over is done. A cluster that does not compact
  (Tansu) keeps every record; the topic then grows by one claim per CONNECT and a state per move
  and the start-up read gets longer (docs/deployment.md).

Node ids are kept in the data dir (NODE_ID), so a restarted node recognises its own claims.
Everything runs on the node's event loop; `LocalOwner` is this node's side (the in-process MQTT
server, or the core's registry of proxies).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from lightgate.node_deaths import NODE_KEY, NodeWatch
from lightgate.session_positions import localize, portable

log = logging.getLogger("lightgate.cluster_sessions")

CLAIM_READ_TIMEOUT = 5.0  # s: our own claim must come back from the cluster this fast
SEEN_CLAIMS = 100_000  # claim ids remembered to know a retried copy (it follows within seconds)
LEAVE_TIMEOUT = 15.0  # s a stopping node may spend writing its sessions for the others


class LocalOwner(Protocol):
    def has(self, client_id: str) -> bool:
        """A connection or a session of `client_id` is on this node."""
        ...

    async def take(self, client_id: str, now: bool = False) -> dict[str, Any] | None:
        """End its connection here (0x8E), forget its session (local copy and queue holds
        released) and return the session's last state (this node's sequences), or None.
        `now`: a claim of this node for the id is in progress; do not wait for it."""
        ...

    def adopt(self, client_id: str, state: dict[str, Any], due: float | None) -> None:
        """Hold the session of a dead node's client here (its queues held once) as a
        disconnected one, its will published at `due` (wall clock) unless it comes back."""
        ...


def node_id(data_dir: Path) -> str:
    path = Path(data_dir) / "NODE_ID"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        nid = uuid.uuid4().hex[:16]
        path.write_text(nid + "\n")
        return nid


def _kwargs_for(cls: Any, kw: dict[str, Any]) -> dict[str, Any]:
    import inspect

    names = set(inspect.signature(cls).parameters)
    return {k: v for k, v in kw.items() if k in names}


class ClusterSessions:
    """This node's view of the sessions topic: owners, stored states, claims in progress."""

    def __init__(
        self, bootstrap: str, client: dict[str, Any], topic: str, node: str, queues: Any,
        store: Any, handover_wait_s: float = 1.0, replication_factor: int = -1,
        poll_ms: int = 20, flush_s: float = 1.0, node_timeout_s: float = 6.0,
    ) -> None:  # fmt: skip
        self.bootstrap = bootstrap
        self.client = dict(client)
        self.client.pop("enable_idempotence", None)
        self.topic = topic
        self.node = node
        self.queues = queues
        self.store = store
        self.handover_wait_s = handover_wait_s
        self.replication_factor = replication_factor
        self.poll_ms = poll_ms
        self.local: LocalOwner | None = None
        self.owner: dict[str, str] = {}  # client id -> node, as of the last record read
        self.stored: dict[str, dict[str, Any]] = {}  # client id -> newest portable state
        self.stopped: set[str] = set()  # nodes that stopped gracefully and have not claimed since
        self._mine: dict[str, asyncio.Future[str | None]] = {}  # claim id -> previous owner
        self._answers: dict[str, asyncio.Future[None]] = {}  # claim id -> its hand-over read
        self._busy: dict[str, asyncio.Future[None]] = {}  # client id -> our claim in progress
        self._read_mine: set[str] = set()  # of those, the ones whose claim record we have read
        # Claim ids are `<node>.<n>`, n unique across restarts (nanoseconds at start, then +1).
        # A copy of a claim (a producer retry without idempotence) is known by its id, a record
        # read again after a reset of the reader by its offset; both are ignored.
        self._seq = time.time_ns()
        self._seen_claims: dict[str, None] = {}  # the latest claim ids read, oldest first
        self._next_offset = 0  # records below it were read already
        self._producer: Any = None
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()  # hand-overs and in-process claims
        self.counters = {"claims": 0, "handed_over": 0, "taken_over": 0, "handover_waits": 0,
                         "states_written": 0, "nodes_dead": 0, "adopted": 0}  # fmt: skip
        self.watch = NodeWatch(self, flush_s, node_timeout_s)

    # -- start / stop ----------------------------------------------------------------------
    async def start(self) -> None:
        """Make the topic, read it to its end (owners and states), then follow it."""
        kw = self.client
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap,
                                    **_kwargs_for(AIOKafkaAdminClient, kw))  # fmt: skip
        await admin.start()
        try:
            nt = NewTopic(self.topic, 1, 1, topic_configs={"cleanup.policy": "compact"})
            nt.replication_factor = self.replication_factor
            with contextlib.suppress(Exception):  # made by another node, or refused: see below
                await admin.create_topics([nt])
        finally:
            await admin.close()
        pkw: dict[str, Any] = {"acks": "all", "enable_idempotence": False, "linger_ms": 0}
        pkw.update(_kwargs_for(AIOKafkaProducer, kw))
        pkw["enable_idempotence"] = False  # records are keyed claims: a retried copy is harmless
        self._producer = AIOKafkaProducer(bootstrap_servers=self.bootstrap, **pkw)
        await self._producer.start()
        ckw: dict[str, Any] = {
            "fetch_max_wait_ms": self.poll_ms,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",  # a reset reads again (skipped), never skips
        }
        ckw.update(_kwargs_for(AIOKafkaConsumer, kw))
        self._consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, group_id=None, **ckw)
        await self._consumer.start()
        tp = TopicPartition(self.topic, 0)
        self._consumer.assign([tp])
        await self._consumer.seek_to_beginning(tp)
        end = (await self._consumer.end_offsets([tp]))[tp]
        n = 0
        while await self._consumer.position(tp) < end:
            for recs in (await self._consumer.getmany(tp, timeout_ms=200)).values():
                for r in recs:
                    if r.offset >= self._next_offset:
                        self._next_offset = r.offset + 1
                        self._read(r.key, r.value, starting=True)
                        n += 1
        log.info("sessions topic %s read: %d records, %d owned client ids, %d stored sessions",
                 self.topic, n, len(self.owner), len(self.stored))  # fmt: skip
        self._prune()
        self._task = asyncio.get_running_loop().create_task(self._follow(), name="cluster-sessions")
        self.watch.start()

    def _prune(self) -> None:
        """Drop this node's stored copies of sessions another node took while it was down:
        the latest CONNECT won there (a node that stopped handed its sessions over first)."""
        stored = self.queues.sessions
        gone = [cid for cid, _ in stored.items() if self.owner.get(cid, self.node) != self.node]
        for cid in gone:
            stored.delete(cid)
        if gone:
            log.info("%d stored sessions were taken over by other nodes meanwhile", len(gone))

    async def _leave(self) -> None:
        """A graceful stop: write every persistent session this node owns as a final state
        record, so a client that connects to another node meanwhile resumes it at once."""
        sends = []
        for cid, state in self.queues.sessions.items():
            if self.owner.get(cid, self.node) != self.node:
                continue
            try:
                value = {"k": "state", "node": self.node, "final": True,
                         "s": portable(state, self.queues, self.store)}  # fmt: skip
            except Exception:
                log.exception("session %r cannot be written for other nodes", cid)
                continue
            body = json.dumps(value).encode()
            sends.append(await self._producer.send(self.topic, body, key=cid.encode("utf-8")))
        sends.append(await self._producer.send(
            self.topic, json.dumps({"k": "bye", "node": self.node}).encode(),
            key=(NODE_KEY + self.node).encode("utf-8")))  # fmt: skip
        await asyncio.gather(*sends)
        log.info("%d persistent sessions written for the other nodes", len(sends) - 1)

    async def close(self) -> None:
        await self.watch.stop()
        if self._producer is not None and self._task is not None:
            try:
                await asyncio.wait_for(self._leave(), LEAVE_TIMEOUT)
            except Exception as exc:
                log.warning("writing sessions for the other nodes at stop failed: %r", exc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for c in (self._producer, self._consumer):
            if c is not None:
                with contextlib.suppress(Exception):
                    await c.stop()

    async def _follow(self) -> None:
        while True:
            try:
                got = await self._consumer.getmany(timeout_ms=500)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reading the sessions topic failed: %r; retrying", exc)
                await asyncio.sleep(0.5)
                continue
            for recs in got.values():
                for r in recs:
                    if r.offset < self._next_offset:
                        continue  # read again after a reset of the consumer's position
                    self._next_offset = r.offset + 1
                    try:
                        self._read(r.key, r.value)
                    except Exception:
                        log.exception("bad record in the sessions topic at %d", r.offset)

    # -- records ---------------------------------------------------------------------------
    def _read(self, key: bytes | None, value: bytes | None, starting: bool = False) -> None:
        if key is None:
            return
        cid = key.decode("utf-8")
        if value is None:  # a tombstone: nothing stored, nobody owns it
            self.stored.pop(cid, None)
            self.owner.pop(cid, None)
            return
        v = json.loads(value)
        kind, node = v.get("k"), v.get("node")
        if kind in ("alive", "bye"):
            self.watch.heartbeat(node, kind)
            return
        if kind == "adopt":
            prev = self.watch.adopted(cid, v, starting)
            if prev == self.node and not starting and node != self.node and self._ours(cid, prev):
                # this node was taken for dead (cut off from the cluster): its client goes
                self._spawn(self._hand_over(cid, v["id"], False))
            return
        if kind == "claim":
            seen = self._seen_claims
            if v["id"] in seen:
                return  # a copy of a claim read before (a producer retry)
            seen[v["id"]] = None
            if len(seen) > SEEN_CLAIMS:
                del seen[next(iter(seen))]
            prev = self.owner.get(cid)
            self.owner[cid] = node
            self.stopped.discard(node)
            mine = self._mine.pop(v["id"], None)
            if node == self.node:
                self.watch.owned_claimed(cid)
            if mine is not None:
                self._read_mine.add(cid)
                if not mine.done():
                    mine.set_result(prev)
            elif not starting and node != self.node and self._ours(cid, prev):
                log.info("client %r claimed by node %s: handing it over", cid, node)
                # Our own claim of it, if one is in progress, comes after this one in the
                # topic's order unless we have read it already: then this node owns it until
                # that claim is done, and what is handed over is what it opens.
                after_ours = cid in self._read_mine
                self._spawn(self._hand_over(cid, v["id"], after_ours))
            return
        if v.get("live") and self.owner.get(cid) != node:
            return  # a periodic state written before a hand-over read already: older than it
        if kind == "state":
            self.stored[cid] = v["s"]
            if v.get("final"):
                self.stopped.add(node)
        elif kind == "gone":
            self.stored.pop(cid, None)
        answer = self._answers.pop(v.get("for", ""), None)
        if answer is not None and not answer.done():
            answer.set_result(None)

    def _ours(self, cid: str, prev: str | None) -> bool:
        """This node owned `cid` until this claim, or has a connection or session of it."""
        local = self.local
        return local is not None and (prev == self.node or local.has(cid))

    async def _send(self, cid: str, value: dict[str, Any] | None) -> None:
        body = None if value is None else json.dumps(value).encode()
        await self._producer.send_and_wait(self.topic, body, key=cid.encode("utf-8"))

    # -- this node claims ------------------------------------------------------------------
    async def claim(self, cid: str) -> tuple[bool, dict[str, Any] | None]:
        """Make `cid` this node's. (moved, state): moved=False when the local store is
        current (this node owned it last); else the state handed over (this node's
        sequences, its queues held once each) or None (no session to resume)."""
        while (busy := self._busy.get(cid)) is not None:
            await asyncio.shield(busy)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._busy[cid] = done
        try:
            return await self._claim(cid)
        except Exception:
            log.exception("claiming client %r on the cluster failed; serving it locally", cid)
            return False, None
        finally:
            self._release(cid, done)

    def claim_then(self, cid: str, then: Any) -> None:
        """`claim`, then `then(moved, state)` before any hand-over of `cid` from this node
        runs (the in-process server opens the session in `then`)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        async def run() -> None:
            while (busy := self._busy.get(cid)) is not None:
                await asyncio.shield(busy)
            self._busy[cid] = done
            try:
                try:
                    moved, state = await self._claim(cid)
                except Exception:
                    log.exception("claiming client %r on the cluster failed", cid)
                    moved, state = False, None
                then(moved, state)
            finally:
                self._release(cid, done)

        self._spawn(run())

    def _spawn(self, coro: Any) -> None:
        """A task kept referenced until it ends (the loop holds only weak references)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _release(self, cid: str, done: asyncio.Future[None]) -> None:
        if self._busy.get(cid) is done:
            del self._busy[cid]
            self._read_mine.discard(cid)
        done.set_result(None)

    async def _claim(self, cid: str) -> tuple[bool, dict[str, Any] | None]:
        loop = asyncio.get_running_loop()
        self._seq += 1
        claim_id = f"{self.node}.{self._seq}"
        mine: asyncio.Future[str | None] = loop.create_future()
        answer: asyncio.Future[None] = loop.create_future()
        self._mine[claim_id] = mine
        self._answers[claim_id] = answer
        self.counters["claims"] += 1
        try:
            # Bounded: with the cluster unreachable the CONNECT is served here (its PUBLISHes
            # cannot be acknowledged anyway) rather than held for the client's timeout.
            await asyncio.wait_for(
                self._send(cid, {"k": "claim", "node": self.node, "id": claim_id}),
                CLAIM_READ_TIMEOUT,
            )
            prev = await asyncio.wait_for(mine, CLAIM_READ_TIMEOUT)
            adopted = self.watch.pending.pop(cid, None) if prev == self.node else None
            if adopted is not None:  # adopted from a dead node a moment ago, not held yet
                self.counters["taken_over"] += 1
                local, _held = await localize(adopted[0], self.queues)
                return True, local
            if prev is None or prev == self.node:
                return False, None
            t0 = time.monotonic()
            try:
                if prev in self.stopped:  # it wrote its sessions when it stopped: no answer comes
                    answer.set_result(None)
                await asyncio.wait_for(answer, self.handover_wait_s)
            except TimeoutError:
                self.counters["handover_waits"] += 1
                log.warning("node %s did not hand client %r over within %.1f s; resuming its "
                            "last stored state", prev, cid, self.handover_wait_s)  # fmt: skip
            log.debug("client %r handed over by %s in %.3f s", cid, prev, time.monotonic() - t0)
        finally:
            self._mine.pop(claim_id, None)
            self._answers.pop(claim_id, None)
        state = self.stored.get(cid)
        if state is None:
            return True, None
        self.counters["taken_over"] += 1
        local, _held = await localize(state, self.queues)
        return True, local

    # -- another node claims ---------------------------------------------------------------
    async def _hand_over(self, cid: str, claim_id: str, after_ours: bool) -> None:
        """`after_ours`: the claim came after ours, in progress: its connection, once open,
        is what ends. Else what this node has now goes (a claim of ours still to be read
        will take it back through the claimer)."""
        if after_ours:
            while (busy := self._busy.get(cid)) is not None:
                await asyncio.shield(busy)
        assert self.local is not None
        try:
            adopted = self.watch.pending.pop(cid, None)  # adopted here, not held yet
            if adopted is not None:
                await self._send(cid, {"k": "state", "node": self.node, "for": claim_id,
                                       "s": adopted[0]})  # fmt: skip
                self.counters["handed_over"] += 1
                return
            state = await self.local.take(cid, not after_ours and cid in self._busy)
            if state is not None:
                state = portable(state, self.queues, self.store)
                await self._send(cid, {"k": "state", "node": self.node, "for": claim_id,
                                       "s": state})  # fmt: skip
            else:
                await self._send(cid, {"k": "gone", "node": self.node, "for": claim_id})
            self.counters["handed_over"] += 1
        except Exception:
            log.exception("handing client %r over failed", cid)


class ServerOwner:
    """This node's side when its MQTT server runs in this process (`mqtt_processes = 0`)."""

    def __init__(self, server: Any, stored: Any) -> None:
        self.server = server
        self.stored = stored  # the light-queue DB's session store

    def has(self, client_id: str) -> bool:
        return client_id in self.server.sessions.sessions or client_id in self.server.conns

    async def take(self, client_id: str, now: bool = False) -> dict[str, Any] | None:
        server = self.server
        for queue in server.sessions.hand_off(client_id):  # ends the connection, writes it
            server.backend.release(queue)
        state: dict[str, Any] | None = self.stored.get(client_id)
        if state is not None:
            self.stored.delete(client_id)
        return state

    def adopt(self, client_id: str, state: dict[str, Any], due: float | None) -> None:
        self.stored.put(client_id, state)
        self.server.sessions.adopt(state, due)
