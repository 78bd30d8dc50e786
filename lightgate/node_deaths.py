"""Surviving a node's death on one Kafka cluster: state that outlives the node, and who takes
over its sessions and wills (lightgate.cluster_sessions owns the topic; this is its timer side).

- **State.** The session store tells this node of every write. Every `cluster_state_flush_ms`
  (a tenth of it after a disconnect or an ended session: batched with what follows) a node
  writes a `state` record {live} for each persistent session it owns that the store changed
  since (at most STATES_PER_FLUSH, longest-waiting first), in log positions, with the pending
  will and the session expiry; a session it owned that ended gets `gone`. A claimer whose previous owner does not
  answer thus resumes state at most one flush old. A `state` {live} record counts only while
  its writer still owns the id in the topic's order (a late copy after a hand-over is ignored).
- **Heartbeats.** Each node writes `alive` every third of `cluster_node_timeout_ms` (key
  NUL "node:" id: never a client id) and `bye` when it stops gracefully. A node whose heartbeat
  has not been read for the timeout is dead (by this node's clock: no clock is compared), as
  long as this node reads its own heartbeats in time (else it is the one cut off).
- **Adoption.** Every survivor that finds a node dead writes `adopt` {node, dead, id, due}
  for each client id the dead node owns with a stored session; `due` is its will's time
  (wall clock: min(will delay, expiry) after the client's disconnect there, or after now for a
  client that was connected). An `adopt` counts only if the id's owner is still
  the dead node when it is read: the first one in the topic's order wins on every node alike,
  and a client that reconnected first (its claim earlier in the topic) is not adopted at all.
  The winner holds the session like a disconnected one: it publishes the will when due unless
  the client claims the id first (a claim from any node takes the session, will cancelled),
  and expires the session. So each will is published once, by one node, with no vote.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from typing import Any

log = logging.getLogger("lightgate.cluster_sessions")

NODE_KEY = "\0node:"  # heartbeat keys: NUL is never in a client id
STATES_PER_FLUSH = 2000  # state records per flush at most; the least recently written first


class NodeWatch:
    """Heartbeats, periodic session states and the adoption of a dead node's sessions."""

    def __init__(self, cs: Any, flush_s: float, timeout_s: float) -> None:
        self.cs = cs
        self.flush_s = flush_s
        self.timeout_s = timeout_s
        self.alive: dict[str, float] = {}  # node -> monotonic time its last heartbeat was read
        self.dead: set[str] = set()
        self.written: set[str] = set()  # client ids whose record in the topic is a state
        self.dirty: dict[str, None] = {}  # changed in the store since written, oldest first
        self.offline: set[str] = set()  # stored as disconnected (their disconnect was seen)
        self._wake = asyncio.Event()
        # client id -> (portable state, will due) adopted here, not yet installed
        self.pending: dict[str, tuple[dict[str, Any], float | None]] = {}
        self._task: asyncio.Task[None] | None = None
        self._seq = time.time_ns()

    # -- records read (cluster_sessions._read) -------------------------------------------------
    def heartbeat(self, node: str, kind: str) -> None:
        if kind == "bye":
            self.alive.pop(node, None)
            self.cs.stopped.add(node)
            return
        self.alive[node] = time.monotonic()
        self.dead.discard(node)

    def adopted(self, cid: str, v: dict[str, Any], starting: bool) -> str | None:
        """An `adopt` record: the previous owner when it counts, else None."""
        cs = self.cs
        prev = cs.owner.get(cid)
        if prev != v["dead"]:
            return None  # the client came back first, or another survivor adopted it first
        cs.owner[cid] = v["node"]
        if v["node"] == cs.node and not starting:
            state = cs.stored.get(cid)
            if state is not None:
                self.pending[cid] = (state, v.get("due"))
                cs._spawn(self._install(cid))
        return prev

    async def _install(self, cid: str) -> None:
        """Hold an adopted session here (a claim of this node's in progress goes first)."""
        cs = self.cs
        while (busy := cs._busy.get(cid)) is not None:
            await asyncio.shield(busy)
        entry = self.pending.pop(cid, None)
        if entry is None or cs.local is None:
            return  # claimed meanwhile: the claim took the state
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        cs._busy[cid] = done
        cs._read_mine.add(cid)  # a claim read now waits and takes what this installs
        try:
            from lightgate.session_positions import localize

            state, due = entry
            local, _held = await localize(state, cs.queues)
            cs.local.adopt(cid, local, due)
            cs.counters["adopted"] += 1
            log.info("client %r of a dead node adopted here (will due in %s s)", cid,
                     None if due is None else round(due - time.time(), 1))  # fmt: skip
        except Exception:
            log.exception("adopting client %r failed", cid)
        finally:
            cs._release(cid, done)

    # -- the timer ---------------------------------------------------------------------------
    def start(self) -> None:
        sessions = self.cs.queues.sessions
        sessions.changed = self.store_changed
        for cid, _state in sessions.items():  # once: what this node holds from before
            self.dirty.setdefault(cid, None)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="cluster-nodes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _run(self) -> None:
        beat_every = self.timeout_s / 3
        period = min(self.flush_s, beat_every)
        next_beat = 0.0
        while True:
            self._wake.clear()
            try:
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + beat_every
                    await self.cs._send(NODE_KEY + self.cs.node,
                                        {"k": "alive", "node": self.cs.node})  # fmt: skip
                await self.flush()
                await self.find_dead()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("writing session states / heartbeat failed: %r", exc)
            try:
                await asyncio.wait_for(self._wake.wait(), period)
            except TimeoutError:
                continue
            await asyncio.sleep(self.flush_s / 10)  # a disconnect: soon, with what follows it

    def store_changed(self, cid: str, state: dict[str, Any] | None) -> None:
        """The session store wrote `cid` (None: deleted). A disconnect or an end is written
        to the topic at the next short wake-up, anything else at the next period."""
        self.dirty.setdefault(cid, None)
        if state is not None and not state.get("disconnected_at"):
            self.offline.discard(cid)
            return
        if state is None:
            self.offline.discard(cid)
        elif cid in self.offline:
            return
        else:
            self.offline.add(cid)
        self._wake.set()

    async def flush(self) -> None:
        """Write the owned sessions the store changed since they were last written, the
        longest-waiting first; a session that ended gets `gone`."""
        from lightgate.session_positions import portable

        cs = self.cs
        sends = []
        take = list(itertools.islice(self.dirty, STATES_PER_FLUSH))
        for cid in take:
            del self.dirty[cid]
        for cid in take:
            if cs.owner.get(cid, cs.node) != cs.node:
                continue
            if cid in cs._busy:
                self.dirty[cid] = None  # moving now: the next flush sees where it went
                continue
            state = cs.queues.sessions.get(cid)
            if state is None:
                if cid in self.written:
                    self.written.discard(cid)
                    value = {"k": "gone", "node": cs.node, "live": True}
                    sends.append(await cs._producer.send(cs.topic, json.dumps(value).encode(),
                                                         key=cid.encode("utf-8")))  # fmt: skip
                continue
            try:
                value = {"k": "state", "node": cs.node, "live": True,
                         "s": portable(state, cs.queues, cs.store)}  # fmt: skip
            except Exception:
                log.exception("session %r cannot be written for other nodes", cid)
                continue
            self.written.add(cid)
            sends.append(await cs._producer.send(cs.topic, json.dumps(value).encode(),
                                                 key=cid.encode("utf-8")))  # fmt: skip
        if sends:
            await asyncio.gather(*sends)
            cs.counters["states_written"] += len(sends)

    def owned_claimed(self, cid: str) -> None:
        """This node's claim of `cid` was read: a stored state of it must be replaced or
        cleared by a flush (a clean start leaves no session here)."""
        if cid in self.cs.stored:
            self.written.add(cid)
            self.dirty.setdefault(cid, None)

    async def find_dead(self) -> None:
        cs = self.cs
        now = time.monotonic()
        mine = self.alive.get(cs.node)
        if mine is None or now - mine > self.timeout_s * 2 / 3:
            return  # this node's own heartbeat is not coming back: it is the one cut off
        for node, seen in list(self.alive.items()):
            if node == cs.node or node in self.dead or now - seen < self.timeout_s:
                continue
            self.dead.add(node)
            cs.counters["nodes_dead"] += 1
            theirs = [c for c, n in cs.owner.items() if n == node and c in cs.stored]
            log.warning("node %s wrote no heartbeat for %.1f s: taking over its %d sessions",
                        node, now - seen, len(theirs))  # fmt: skip
            sends = []
            for cid in theirs:
                state = cs.stored[cid]
                will, due = state.get("will"), None
                if will is not None:  # from its disconnect there, else from now
                    since = state.get("disconnected_at") or time.time()
                    due = since + min(will.get("delay", 0), state.get("expiry", 0))
                self._seq += 1
                value = {"k": "adopt", "node": cs.node, "dead": node,
                         "id": f"{cs.node}.a{self._seq}", "due": due}  # fmt: skip
                sends.append(await cs._producer.send(cs.topic, json.dumps(value).encode(),
                                                     key=cid.encode("utf-8")))  # fmt: skip
            if sends:
                await asyncio.gather(*sends)
