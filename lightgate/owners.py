"""What must be one across MQTT proxies, kept by the core: client-id owners, held sessions, wills.

With several proxies (`mqtt_processes = N`, or `lightgate proxy` elsewhere) a client may reach
any of them, so the core decides who holds a client id (docs/architecture.md, "Processes and
cores"). Theory of operation:

- **Claim.** A proxy asks CLAIM before it answers a CONNECT. If another proxy owns the id, the
  core asks it to TAKE: that proxy ends the connection (v5 DISCONNECT 0x8E), writes the
  session's state (subscriptions with positions, QoS 1/2 in flight, QoS 2 ids received) to the
  session store and forgets the session, keeping its queue holds, which the core moves to the
  claiming link. The core then answers with the stored state: the new proxy resumes exactly
  where the old one stopped (in-flight messages re-sent with DUP, a QoS 2 PUBREL re-sent, no
  message read twice). Claims of one client id are handled one at a time.
- **Held sessions.** Persistent sessions that no proxy holds (every stored one when the core
  starts, those of a proxy whose link dropped) are held by the core: it keeps their queues
  held, so their messages wait, and expires them. A claim hands them over.
- **Wills.** A proxy registers the will of each connection (WILL, cleared when no longer due).
  When its link drops, the core publishes those wills after their delay (min(will delay,
  session expiry)) unless the client reconnects first, on any proxy.

Every method runs on the core's event loop; the session store and the light queues are local.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mqtt_proxy.backends.cluster import CLAIM, GONE, TAKE, WILL, decode_will
from notify.link import RpcPeer
from store.bans import BanList, encode_bans
from store.mapping import MqttMessage
from store.wire import get_str

log = logging.getLogger("lightgate.owners")

NEVER_EXPIRES = 0xFFFFFFFF
MOVED_QUEUE = "$replay/@"  # a replay queue from log offsets: a session that came from another node
TAKE_TIMEOUT = 5.0  # s a proxy has to hand a session over before the core stops waiting


@dataclass(slots=True, eq=False)
class Held:
    """A persistent session no proxy holds: the queues the core holds for it, its timers."""

    holds: list[str] = field(default_factory=list)
    expiry: asyncio.TimerHandle | None = None
    will: asyncio.TimerHandle | None = None


class ClientRegistry:
    """Client-id ownership, held sessions and wills across every proxy on the core link."""

    def __init__(self, store: Any, queues: Any, bans: BanList | None = None) -> None:
        self.store = store
        # Checked again at CLAIM: a ban the core made a moment ago (flapping) may not have
        # reached the claiming proxy's copy yet.
        self.bans = bans if bans is not None else BanList()
        self.queues = queues
        self.owners: dict[str, RpcPeer] = {}
        self.held: dict[str, Held] = {}
        self._claims: dict[str, asyncio.Future[None]] = {}  # the claim in progress per client id
        self.counters: Counter[str] = Counter()
        # Other nodes on the same Kafka cluster (lightgate.cluster_sessions), or None.
        self.node: Any = None

    def methods(self) -> dict[int, Any]:
        return {CLAIM: self._claim, WILL: self._will, GONE: self._gone}

    # -- start ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Hold every stored session: none is on a proxy yet (a proxy's CLAIM takes it over)."""
        now = time.time()
        for state in self.queues.sessions.load_all():
            cid = state.get("client_id")
            if not isinstance(cid, str):
                continue
            offline = bool(state.get("disconnected_at"))
            if not offline:
                state["disconnected_at"] = now  # it was online when the gateway stopped
            will = state.get("will") if offline else None
            if will is not None:
                # a will waiting out its delay: still due when it was due before
                delay = min(will.get("delay", 0), state.get("expiry", 0))
                will = {**will, "due": state["disconnected_at"] + delay}
            self._hold(cid, state, will)
        if self.held:
            log.info("holding %d persistent MQTT sessions until their clients return",
                     len(self.held))  # fmt: skip

    # -- claims --------------------------------------------------------------------------------
    async def _claim(self, peer: RpcPeer, body: bytes) -> bytes:
        cid, _, address = body.decode("utf-8").partition("\0")  # NUL is not in a client id
        ban = self.bans.banned(cid, address)
        if ban is not None:
            return b"B" + encode_bans([ban])
        done = await self._lock(cid)
        try:
            if self.node is not None:
                await self._claim_node(cid)
            return await self._claim_one(peer, cid)
        finally:
            self._unlock(cid, done)

    async def _lock(self, cid: str) -> asyncio.Future[None]:
        while (busy := self._claims.get(cid)) is not None:
            await asyncio.shield(busy)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._claims[cid] = done
        return done

    def _unlock(self, cid: str, done: asyncio.Future[None]) -> None:
        del self._claims[cid]
        done.set_result(None)

    async def _claim_node(self, cid: str) -> None:
        """Own `cid` across the nodes first; a session another node handed over becomes a held
        session here (its queues held), which the local claim then hands to the proxy."""
        moved, state = await self.node.claim(cid)
        if not moved:
            return
        stale = self.held.pop(cid, None)  # what this node kept of it before it left is old
        if stale is not None:
            self._drop_held(stale)
        if state is None:
            self.queues.sessions.delete(cid)
            return
        self.queues.sessions.put(cid, state)
        self.held[cid] = Held([d["queue"] for d in state["subs"] if not d.get("local")])

    def adopt(self, cid: str, state: dict[str, Any], due: float | None) -> None:
        """A dead node's session, its queues held once (lightgate.cluster_sessions.LocalOwner):
        held here as a disconnected one, its will armed for `due`."""
        stale = self.held.pop(cid, None)
        if stale is not None:
            self._drop_held(stale)
        now = time.time()
        state = {**state, "disconnected_at": state.get("disconnected_at") or now}
        self.queues.sessions.put(cid, state)
        held = Held([d["queue"] for d in state["subs"] if not d.get("local")])
        self.held[cid] = held
        expiry = state.get("expiry", 0)
        if expiry < NEVER_EXPIRES:
            left = max(now, state["disconnected_at"]) + expiry - now
            held.expiry = asyncio.get_running_loop().call_later(left, self._expire, cid, held)
        will = state.get("will")
        if will is not None and due is not None:
            self._arm_will(cid, held, {**will, "due": due})

    def _drop_held(self, held: Held) -> None:
        for t in (held.expiry, held.will):
            if t is not None:
                t.cancel()
        for q in held.holds:
            self.queues.release_filter(q)

    # -- another node claims (lightgate.cluster_sessions.LocalOwner) ---------------------------
    def has(self, cid: str) -> bool:
        return cid in self.owners or cid in self.held

    async def take(self, cid: str, now: bool = False) -> dict[str, Any] | None:
        """Another node claimed `cid`: its proxy here ends the connection (0x8E) and writes
        the session; the session, its holds and its will leave this node. `now`: a claim of
        `cid` here waits for the cluster (it holds the lock and has touched nothing yet)."""
        done = None if now else await self._lock(cid)
        try:
            owner = self.owners.get(cid)
            if owner is not None:
                self.counters["takeovers"] += 1
                moved: list[str] = []
                try:
                    reply = await asyncio.wait_for(owner.call(TAKE, cid.encode()), TAKE_TIMEOUT)
                    moved = json.loads(reply) if reply else []
                except Exception as exc:
                    log.warning("proxy %s did not hand over client %r: %r", owner.name, cid, exc)
                theirs: Counter[str] = owner.state.setdefault("holds", Counter())
                for q in moved:
                    if theirs[q] > 0:
                        theirs[q] -= 1
                        self.queues.release_filter(q)
                self._disown(owner, cid)
            held = self.held.pop(cid, None)
            if held is not None:
                self._drop_held(held)
            state = self.queues.sessions.get(cid)
            if state is not None:
                self.queues.sessions.delete(cid)
            return state
        finally:
            if done is not None:
                self._unlock(cid, done)

    async def _claim_one(self, peer: RpcPeer, cid: str) -> bytes:
        owner = self.owners.get(cid)
        if owner is peer:
            return b"L"
        mine: Counter[str] = peer.state.setdefault("holds", Counter())
        if owner is not None:
            self.counters["takeovers"] += 1
            moved: list[str] = []
            try:
                reply = await asyncio.wait_for(owner.call(TAKE, cid.encode()), TAKE_TIMEOUT)
                moved = json.loads(reply) if reply else []
            except Exception as exc:  # its link is going: its holds go with it, the state stays
                log.warning("proxy %s did not hand over client %r: %r", owner.name, cid, exc)
            theirs: Counter[str] = owner.state.setdefault("holds", Counter())
            for q in moved:
                if theirs[q] > 0:
                    theirs[q] -= 1
                    mine[q] += 1
                else:  # the link dropped meanwhile and released it: hold it anew
                    self._acquire_queue(q, mine)
            self._disown(owner, cid)
        held = self.held.pop(cid, None)
        if held is not None:
            for t in (held.expiry, held.will):
                if t is not None:
                    t.cancel()
            for q in held.holds:
                mine[q] += 1
        if peer.is_closing():
            # The claimer is gone: its holds were released already; hold the session again.
            state = self.queues.sessions.get(cid)
            if state is not None:
                self._hold(cid, state, None)
            return b"N"
        self.owners[cid] = peer
        peer.state.setdefault("owned", set()).add(cid)
        state = self.queues.sessions.get(cid)
        if state is None:
            for q in held.holds if held is not None else ():
                mine[q] -= 1
                self.queues.release_filter(q)
            return b"N"
        return b"S" + json.dumps(state).encode()

    def _acquire_queue(self, queue: str, holds: Counter[str]) -> None:
        try:
            a = self.queues.acquire_filter(queue, None)
        except Exception as exc:
            log.warning("cannot hold queue %r: %s", queue, exc)
            return
        holds[a.queue] += 1

    def _disown(self, peer: RpcPeer, cid: str) -> None:
        if self.owners.get(cid) is peer:
            del self.owners[cid]
        peer.state.setdefault("owned", set()).discard(cid)
        peer.state.setdefault("wills", {}).pop(cid, None)

    def _gone(self, peer: RpcPeer, body: bytes) -> None:
        """The session ended on that proxy (clean, or expired): nobody owns the id."""
        cid, _ = get_str(body, 0)
        self._disown(peer, cid)

    def _will(self, peer: RpcPeer, body: bytes) -> None:
        cid, pos = get_str(body, 0)
        wills: dict[str, dict[str, Any]] = peer.state.setdefault("wills", {})
        if pos >= len(body):
            wills.pop(cid, None)
        else:
            wills[cid] = json.loads(body[pos:])

    # -- a proxy went away ---------------------------------------------------------------------
    def peer_lost(self, peer: RpcPeer) -> None:
        """Hold the persistent sessions the proxy had and arm the wills it registered (its
        link's holds were released; the stored state is what it last wrote)."""
        wills: dict[str, dict[str, Any]] = peer.state.pop("wills", {})
        owned: set[str] = peer.state.pop("owned", set())
        now = time.time()
        for cid in owned:
            if self.owners.get(cid) is peer:
                del self.owners[cid]
            will = wills.pop(cid, None)
            if will is not None and "due" not in will:
                delay = min(will.get("delay", 0), will.get("expiry", 0))
                will = {**will, "due": now + delay}
            state = self.queues.sessions.get(cid)
            if state is not None:
                if not state.get("disconnected_at"):
                    state["disconnected_at"] = now
                self._hold(cid, state, will)
            elif will is not None:
                self._arm_will(cid, Held(), will)

    def _hold(self, cid: str, state: dict[str, Any], will: dict[str, Any] | None) -> None:
        held = Held()
        for d in state.get("subs", ()):
            if d.get("local"):
                continue
            try:
                queue = d.get("queue") or ""
                if queue.startswith(MOVED_QUEUE):  # came from another node: its own queue
                    a = self.queues.acquire_filter(queue)
                else:
                    a = self.queues.acquire_filter(d["filter"], d.get("since"))
            except Exception as exc:
                log.warning("session %r: cannot hold %r: %s", cid, d.get("raw"), exc)
                continue
            held.holds.append(a.queue)
        self.held[cid] = held
        expiry = state.get("expiry", 0)
        if expiry < NEVER_EXPIRES:
            left = state["disconnected_at"] + expiry - time.time()
            loop = asyncio.get_running_loop()
            held.expiry = loop.call_later(max(0.0, left), self._expire, cid, held)
        if will is not None:
            self._arm_will(cid, held, will)

    def _arm_will(self, cid: str, held: Held, will: dict[str, Any]) -> None:
        left = will.get("due", 0) - time.time()
        loop = asyncio.get_running_loop()
        held.will = loop.call_later(max(0.0, left), self._will_due, cid, held, will)
        if cid not in self.held:
            self.held[cid] = held  # a will alone (clean session): a claim cancels it too

    def _will_due(self, cid: str, held: Held, will: dict[str, Any]) -> None:
        held.will = None
        if self.held.get(cid) is not held:
            return
        if not held.holds and held.expiry is None:
            del self.held[cid]
        self.publish_will(will)

    def _expire(self, cid: str, held: Held) -> None:
        held.expiry = None
        if self.held.get(cid) is not held:
            return
        del self.held[cid]
        if held.will is not None:
            held.will.cancel()
            state = self.queues.sessions.get(cid) or {}
            if state.get("will"):
                self.publish_will(state["will"])
        for q in held.holds:
            self.queues.release_filter(q)
        self.queues.sessions.delete(cid)
        self.counters["sessions_expired"] += 1
        log.info("held session %r expired", cid)

    def publish_will(self, state: dict[str, Any]) -> None:
        """Append the will as the proxy would (empty client id) and set it retained if asked."""
        topic, payload, qos, retain, props = decode_will(state)
        now_ms = int(time.time() * 1000)
        try:
            res = self.store.append_mqtt(
                [MqttMessage(topic, payload, qos, "", retain, props, now_ms)], True
            )
        except Exception:
            log.exception("publishing the will on %r failed", topic)
            return
        self.counters["wills_published"] += 1
        if retain:
            res.when_staged(
                lambda: self.queues.retained.set(
                    topic, payload, qos, "", props, now_ms, res.offsets[0]
                )
            )
