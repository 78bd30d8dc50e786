"""MQTT session state: what outlives a connection when the session is persistent.

A `Session` holds the subscriptions (each with its light-queue position), the outbound QoS 1/2
messages in flight, the inbound QoS 2 packet ids awaiting PUBREL (de-duplication), the will and the
expiry. It is plain data; `manager.py` and `delivery/` drive it. Persistence is a JSON-able dict
(`to_state` / `from_state`) written to the light-queue DB's session store, so a gateway restart
resumes every persistent subscriber from its last stored position.

Position rule: a subscription's stored position is the start of the contiguous
acknowledged prefix: `sub.acked_pos()` = the lowest in-flight sequence, else the read position.
Anything at or after it may be re-sent after a restart, which QoS 1/2 allows (with DUP).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from mqtt_proxy.ports import PeerPort, SessionState
from mqtt_proxy.sessions.topic_filters import FilterSpec
from store.auth import ClientAcl
from store.mapping import MqttProperties


@dataclass(slots=True, eq=False)
class Subscription:
    """One filter of one session (or of a shared group's member)."""

    session: Session
    spec: FilterSpec
    qos: int
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0
    sub_id: int | None = None
    queue: str = ""  # the light queue read (the filter; `$replay/<ms>/<filter>` for a replay)
    pos: int = 0  # next light-queue sequence to read
    pending: dict[int, int] = field(default_factory=dict)  # seq -> packet id, unacked QoS 1/2
    local: bool = False  # `$SYS/...`: served by the proxy, no light queue
    held: bool = False  # delivery waits: its retained messages are still to be sent
    # Delivery's ACL cache: the connection's ClientAcl it was computed for, and that ACL when
    # this filter reaches topics the client may not read (each message is then checked), else None.
    acl_of: ClientAcl | None = None
    acl_check: ClientAcl | None = None

    def acked_pos(self) -> int:
        return min(self.pending) if self.pending else self.pos


def free_pid(inflight: dict[int, Any], pid: int) -> int:
    """The first packet id from `pid` on (1..65535, wrapping) not in `inflight`."""
    for _ in range(65535):
        if pid not in inflight:
            return pid
        pid = pid + 1 if pid < 65535 else 1
    raise RuntimeError("no free packet id")  # pragma: no cover - the window is far below 65535


@dataclass(slots=True)
class Inflight:
    """An outbound QoS 1/2 PUBLISH awaiting PUBACK, PUBREC or (after PUBREL) PUBCOMP."""

    queue: str
    seq: int
    qos: int
    data: bytes  # exact bytes sent (packet id in place); DUP is set on resend
    released: bool = False  # QoS 2: PUBREC received, PUBREL sent
    filter_raw: str = ""  # which subscription (or shared group key) to credit on ack


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    delay: int = 0
    properties: MqttProperties | None = None
    # Who set it, so the ACL of the moment it is published decides (rules change on reload):
    # the user, the client id and, for a token with rights of its own, those rights.
    user: str | None = None
    owner: str = ""
    acl: Any = None  # store.auth.ClientAcl from a token's ACL claim; not kept across restarts


@dataclass(slots=True, eq=False)
class Session:
    client_id: str
    persistent: bool = False
    expiry: int = 0  # seconds after disconnect (v5); v3 persistent sessions get the configured cap
    version: int = 4
    subs: dict[str, Subscription] = field(default_factory=dict)  # raw filter -> sub
    inflight: dict[int, Inflight] = field(default_factory=dict)  # packet id -> message
    qos2_in: set[int] = field(default_factory=set)  # inbound QoS 2 ids stored, awaiting PUBREL
    qos2_pending: set[int] = field(default_factory=set)  # of those, not yet durable (no PUBREC)
    will: Will | None = None
    conn: PeerPort | None = None
    next_pid: int = 1
    disconnected_at: float = 0.0
    expiry_timer: asyncio.TimerHandle | None = None
    will_timer: asyncio.TimerHandle | None = None
    dirty: bool = False
    feeds: list[Any] = field(default_factory=list)  # RetainedFeeds waiting for room to write

    def alloc_pid(self) -> int:
        """Next free packet id (1..65535) not in flight."""
        pid = free_pid(self.inflight, self.next_pid)
        self.next_pid = pid + 1 if pid < 65535 else 1
        return pid

    @property
    def overlapping(self) -> bool:
        """More than one queue-backed, non-shared subscription: deliveries need de-duplication."""
        n = 0
        for sub in self.subs.values():
            if not sub.local and sub.spec.share_group is None:
                n += 1
        return n > 1

    # -- persistence -------------------------------------------------------------------------
    def to_state(self) -> SessionState:
        return {
            "client_id": self.client_id,
            "expiry": self.expiry,
            "version": self.version,
            "disconnected_at": self.disconnected_at,
            "next_pid": self.next_pid,
            # Not the ids whose message is not stored yet: after a crash their resend must be
            # stored, not taken for a copy of something stored.
            "qos2_in": sorted(self.qos2_in - self.qos2_pending),
            "subs": [
                {
                    "raw": s.spec.raw,
                    "filter": s.spec.filter,
                    "group": s.spec.share_group,
                    "since": s.spec.replay_since_ms,
                    "queue": s.queue,
                    "qos": s.qos,
                    "nl": s.no_local,
                    "rap": s.retain_as_published,
                    "rh": s.retain_handling,
                    "sid": s.sub_id,
                    "pos": s.acked_pos(),
                    "local": s.local,
                }
                for s in self.subs.values()
            ],
            "inflight": [
                [pid, m.queue, m.seq, m.qos, m.data.hex(), m.released, m.filter_raw]
                for pid, m in self.inflight.items()
            ],
            "will": None
            if self.will is None
            else {
                "topic": self.will.topic,
                "payload": self.will.payload.hex(),
                "qos": self.will.qos,
                "retain": self.will.retain,
                "delay": self.will.delay,
                "props": _props_state(self.will.properties),
                "user": self.will.user,
            },
        }

    @classmethod
    def from_state(cls, state: SessionState) -> Session:
        s = cls(
            client_id=state["client_id"],
            persistent=True,
            expiry=state.get("expiry", 0),
            version=state.get("version", 4),
            disconnected_at=state.get("disconnected_at", 0.0),
            next_pid=state.get("next_pid", 1),
            qos2_in=set(state.get("qos2_in", ())),
        )
        for d in state.get("subs", ()):
            spec = FilterSpec(d["raw"], d["filter"], d.get("group"), d.get("since"))
            s.subs[d["raw"]] = Subscription(
                session=s,
                spec=spec,
                qos=d["qos"],
                no_local=d.get("nl", False),
                retain_as_published=d.get("rap", False),
                retain_handling=d.get("rh", 0),
                sub_id=d.get("sid"),
                queue=d.get("queue") or d["filter"],
                pos=d.get("pos", 0),
                local=d.get("local", False),
            )
        for pid, queue, seq, qos, data, released, fraw in state.get("inflight", ()):
            s.inflight[pid] = Inflight(queue, seq, qos, bytes.fromhex(data), released, fraw)
        w = state.get("will")
        if w:
            s.will = Will(
                w["topic"],
                bytes.fromhex(w["payload"]),
                w["qos"],
                w["retain"],
                w["delay"],
                _props_from_state(w.get("props")),
                w.get("user"),
                state["client_id"],
            )
        return s


def _props_state(p: MqttProperties | None) -> list[Any] | None:
    if p is None:
        return None
    cd = p.correlation_data.hex() if p.correlation_data is not None else None
    return [
        p.payload_format,
        p.message_expiry,
        p.content_type,
        p.response_topic,
        cd,
        [list(kv) for kv in p.user_properties],
    ]


def _props_from_state(v: list[Any] | None) -> MqttProperties | None:
    if not v:
        return None
    pf, me, ct, rt, cd, up = v
    return MqttProperties(
        pf,
        me,
        ct,
        rt,
        bytes.fromhex(cd) if cd is not None else None,
        tuple((k, val) for k, val in up),
    )
