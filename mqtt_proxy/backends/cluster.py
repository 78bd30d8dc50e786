"""A proxy's half of what the core keeps one across proxies: client-id claims, hand-over, wills.

The core's half is `lightgate.owners` (its docstring has the theory of operation). On the core
link (method numbers 200-209, beside the light queues' and the wiring's):

    CLAIM  proxy → core, call: client id, NUL, the client's address. Reply "L" (this proxy
           holds it already), "N" (no stored session) or "S" + the session's stored state
           (JSON); either way the id is this proxy's now and the session's queue holds are
           counted on this link. Or "B" + the ban (JSON list of one): banned, nothing claimed.
    TAKE   core → proxy, call: client id. The proxy ends its connection (0x8E), writes the
           session's state and forgets it; reply: the queues whose holds leave with it (JSON).
    WILL   proxy → core, one-way: client id + the will (JSON, as `Session.to_state`, with the
           session's `expiry` and, while its delay runs, `due` in wall-clock seconds); a client
           id alone clears it. The core publishes these when the link drops.
    GONE   proxy → core, one-way: client id; the session ended here (not persistent, expired).
           Not sent while this proxy's own CLAIM of the id is out: that claim keeps it here.
    LEASE, DONE, RETURN, WAKE: `$share` groups across proxies (lightgate/shares.py).
    SYS    proxy → core, call: every proxy's MQTT counters summed (JSON), for `$SYS`.
    LAG    both ways, one-way: u32 delivery lag, this proxy's / the others' largest.
    BANS   core → proxy, one-way: every ban in force (JSON, store.bans), on HELLO and on change.
    FLAP   proxy → core, one-way: [client id, address] of a disconnect (flapping detection).

A CLAIM's answer is acted on as its frame is read (`call_then`), before any TAKE read after it,
so a proxy never hands over a session it has not installed yet.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mqtt_proxy.sessions.state import Will, _props_from_state, _props_state
from notify.link import RpcPeer
from notify.link_frames import RpcError
from store.bans import Ban, BanList, decode_bans
from store.mapping import MqttProperties
from store.wire import put_str

if TYPE_CHECKING:
    from mqtt_proxy.ports import HandOffPort, WakePort

log = logging.getLogger("lightgate.mqtt.cluster")

CLAIM, TAKE, WILL, GONE = 200, 201, 202, 203
LEASE, DONE, RETURN, WAKE = 204, 205, 206, 207  # `$share` groups (lightgate/shares.py)
SYS = 208  # proxy → core, call: the MQTT counters summed over every proxy (JSON), for `$SYS`
# both ways, one-way: a proxy's delivery lag (what it owes readers that can take data now);
# the core answers each proxy with the largest lag of the others, so publishers on every proxy
# slow down when delivery on one falls behind (mqtt_proxy/connection/inbound.py, flow control).
LAG = 209
BANS, FLAP = 210, 211  # the core's ban list, mirrored; disconnects counted by the core
LAG_STEP = 1000  # report a change of at least this many messages (and every fall to 0)
LAG_EVERY = 0.01  # s between looks at this proxy's lag
LEASE_N = 64  # sequences asked per lease: few round trips, yet shared out between proxies

Claimed = Callable[[dict[str, Any] | None], None]  # the stored state handed over, or None
Banned = Callable[[Ban], None]


def will_state(will: Will, expiry: int, due: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "topic": will.topic,
        "payload": will.payload.hex(),
        "qos": will.qos,
        "retain": will.retain,
        "delay": will.delay,
        "props": _props_state(will.properties),
        "expiry": expiry,
    }
    if due is not None:
        out["due"] = due
    return out


def decode_will(state: dict[str, Any]) -> tuple[str, bytes, int, bool, MqttProperties | None]:
    """(topic, payload, qos, retain, properties) of a will state."""
    return (
        state["topic"],
        bytes.fromhex(state["payload"]),
        int(state["qos"]),
        bool(state["retain"]),
        _props_from_state(state.get("props")),
    )


class ProxyCluster:
    """Claims before CONNACK, hands sessions over on TAKE, registers wills with the core."""

    def __init__(self) -> None:
        self.peer: Any = None
        # This proxy's delivery (woken by WAKE, its lag reported) and session registry (TAKE
        # hands a session over): set by the wiring once the MQTT server is built.
        self.delivery: WakePort | None = None
        self.sessions: HandOffPort | None = None
        self._wills: set[str] = set()  # client ids whose will the core has
        # Client ids with a CLAIM sent and not yet acted on (answer read and handled), how many.
        self._claiming: dict[str, int] = {}
        self._done: dict[str, list[int]] = {}  # group key -> sequences finished this tick
        self._flush_scheduled = False
        self.others_lag = 0  # the largest delivery lag of the other proxies (the core's LAG)
        self._sent_lag = 0
        self.bans = BanList()  # the core's, as last pushed (BANS); the server checks it

    def methods(self) -> dict[int, Any]:
        return {TAKE: self._take, WAKE: self._wake, LAG: self._on_lag, BANS: self._on_bans}

    # -- bans ------------------------------------------------------------------------------
    def _on_bans(self, peer: RpcPeer, body: bytes) -> None:
        self.bans.replace(decode_bans(body))

    def flapped(self, client_id: str, address: str) -> None:
        """A disconnect, for the core's flapping detection."""
        if self.peer is not None and not self.peer.is_closing():
            self.peer.send(FLAP, json.dumps([client_id, address]).encode())

    def attach(self, peer: RpcPeer) -> None:
        self.peer = peer
        asyncio.get_running_loop().call_later(LAG_EVERY, self._report_lag)

    # -- flow control across proxies -------------------------------------------------------
    def _report_lag(self) -> None:
        if self.peer is None or self.peer.is_closing():
            return
        if self.delivery is not None:
            lags = self.delivery.lag
            lag = max(lags.values()) if lags else 0
            if abs(lag - self._sent_lag) >= LAG_STEP or (lag == 0 and self._sent_lag):
                self._sent_lag = lag
                self.peer.send(LAG, lag.to_bytes(4, "big"))
        asyncio.get_running_loop().call_later(LAG_EVERY, self._report_lag)

    def _on_lag(self, peer: RpcPeer, body: bytes) -> None:
        self.others_lag = int.from_bytes(body[:4], "big")

    # -- `$share` groups -------------------------------------------------------------------
    def ask(self, delivery: Any, qs: Any, g: Any) -> None:
        """Lease the group's next sequences; the answer marks the queue for delivery."""
        if g.asking:
            g.again = True  # the answer may predate what made us ask now
            return
        # No more than the members can take now: a lease held by a member whose QoS 1/2 window
        # is full would keep those messages from the other proxies' members.
        room = 0
        for sub in g.members:
            conn = sub.session.conn
            if conn is None or not conn.writable or sub.held:
                continue
            if sub.qos == 0:
                room += LEASE_N
            else:
                room += max(0, conn.out_window - len(sub.session.inflight))
        n = min(LEASE_N, room)
        if n <= 0:
            return  # an ack or a resumed socket marks the queue again
        g.asking = True

        def answered(body: bytes, err: RpcError | None) -> None:
            g.asking = False
            if err is not None:
                g.again = False
                return
            seqs, low = json.loads(body)
            if qs.groups.get(g.key) is not g or delivery.queues.get(qs.name) is not qs:
                self.give_back(g.key, seqs)  # the group left this proxy meanwhile
                return
            g.lease.extend(seqs)
            g.pos = max(g.pos, low)
            if seqs or g.again:
                g.again = False
                delivery.mark(qs)

        body = json.dumps([g.key, g.queue, g.pos, n]).encode()
        self.peer.call_then(LEASE, body, answered)

    def done(self, key: str, seq: int) -> None:
        """A leased message is finished (acknowledged, sent at QoS 0 or passed over)."""
        self._done.setdefault(key, []).append(seq)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_done)

    def _flush_done(self) -> None:
        self._flush_scheduled = False
        done, self._done = self._done, {}
        for key, seqs in done.items():
            self.peer.send(DONE, json.dumps([key, seqs]).encode())

    def give_back(self, key: str, seqs: list[int]) -> None:
        """No member here can take these any more: the core hands them to other proxies."""
        if seqs:
            self._flush_done()
            self.peer.send(RETURN, json.dumps([key, seqs]).encode())

    def sys_totals(self, done: Callable[[dict[str, Any]], None]) -> None:
        """The core's sums of every proxy's counters, for this proxy's `$SYS` values."""

        def answered(body: bytes, err: RpcError | None) -> None:
            if err is None and body:
                done(json.loads(body))

        self.peer.call_then(SYS, b"", answered)

    def _wake(self, peer: RpcPeer, body: bytes) -> None:
        delivery = self.delivery
        if delivery is None:
            return
        (queue,) = json.loads(body)
        qs = delivery.queues.get(queue)
        if qs is not None:
            delivery.mark(qs)

    def claim(self, client_id: str, address: str, done: Claimed, banned: Banned) -> None:
        """Own `client_id` before answering its CONNECT; `done(state or None)` runs as the
        answer is read (a session handed over comes with its state), or `banned(ban)` when the
        core's ban list refuses the client (a ban this proxy's copy did not have yet)."""

        def answered(body: bytes, err: RpcError | None) -> None:
            try:
                if err is not None:
                    log.warning("claiming client %r failed: %s", client_id, err)
                    done(None)
                elif body[:1] == b"S":
                    done(json.loads(body[1:]))
                elif body[:1] == b"B":
                    banned(decode_bans(body[1:])[0])
                else:
                    done(None)
            finally:
                left = claiming[client_id] - 1
                if left:
                    claiming[client_id] = left
                else:
                    del claiming[client_id]

        claiming = self._claiming
        claiming[client_id] = claiming.get(client_id, 0) + 1
        self.peer.call_then(CLAIM, f"{client_id}\0{address}".encode(), answered)

    def will(
        self, client_id: str, will: Will | None, expiry: int = 0, due: float | None = None
    ) -> None:
        """Tell the core the will it must publish if this proxy dies (None: none is due)."""
        out: list[bytes] = []
        put_str(out, client_id)
        if will is None:
            if client_id not in self._wills:
                return
            self._wills.discard(client_id)
        else:
            self._wills.add(client_id)
            out.append(json.dumps(will_state(will, expiry, due)).encode())
        self.peer.send(WILL, b"".join(out))

    def gone(self, client_id: str) -> None:
        """The session of `client_id` ended here: nobody owns the id any more. Not while a
        CLAIM of it is out or being acted on: the core answers (or has answered) that claim
        with "the id is this proxy's" for the new connection, and this GONE, read after it,
        would disown the new connection (the next CONNECT elsewhere then gets no TAKE and
        this one stays open). The ended session's will is cleared instead; the new session
        registers its own."""
        if client_id in self._claiming:
            self.will(client_id, None)
            return
        self._wills.discard(client_id)
        out: list[bytes] = []
        put_str(out, client_id)
        self.peer.send(GONE, b"".join(out))

    def _take(self, peer: RpcPeer, body: bytes) -> bytes:
        cid = body.decode("utf-8")
        self._wills.discard(cid)
        if self.sessions is None:
            return b"[]"
        return json.dumps(self.sessions.hand_off(cid)).encode()
