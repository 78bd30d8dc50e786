"""Packet handlers: what the server does with each MQTT packet of a connection.

The codec (`mqtt_proxy.codec`) turns bytes into packet events and checks the wire rules; these
functions hold the broker rules: CONNECT negotiation (in connect_handler.py), PUBLISH to the
store, acks, SUBSCRIBE/UNSUBSCRIBE with ACLs and `$share`/`$replay`, DISCONNECT. `DISPATCH` maps
each event type to its handler; `MqttConnection._handle` calls PUBLISH's directly (the hot path).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import time as _time
from typing import TYPE_CHECKING, Any

from mqtt_proxy.codec import (
    EMPTY_PROPERTIES,
    PINGRESP,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    ReasonCode,
    Suback,
    Subscribe,
    Unsuback,
    Unsubscribe,
)
from mqtt_proxy.connection.connect_handler import handle_connect
from mqtt_proxy.messages import make_message
from mqtt_proxy.ports import Acquired
from mqtt_proxy.sessions.topic_filters import FilterError, FilterSpec, parse_filter
from store.mapping import MqttMessage, untrack_messages
from store.twins import twin

if TYPE_CHECKING:
    from mqtt_proxy.connection.connection import MqttConnection
    from mqtt_proxy.delivery.delivery import Delivery
    from mqtt_proxy.sessions.state import Inflight, Session

log = logging.getLogger("lightgate.mqtt")

# The MQTT 5 reason codes used here (codec.ReasonCode; the codec maps them for 3.1.1).
SUCCESS = ReasonCode.SUCCESS
PROTOCOL_ERROR = ReasonCode.PROTOCOL_ERROR
NOT_AUTHORIZED = ReasonCode.NOT_AUTHORIZED
TOPIC_FILTER_INVALID = ReasonCode.TOPIC_FILTER_INVALID
PACKET_ID_NOT_FOUND = ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
UNSPECIFIED = ReasonCode.UNSPECIFIED_ERROR


def handle_publish(conn: MqttConnection, p: Publish) -> bool:
    """Inbound PUBLISH (aliases already resolved and Receive Maximum checked by the codec):
    QoS 2 de-duplication, `$` topics, ACL, then into this tick's append batch. True: not handled
    yet, the auth hook is being asked about its topic (the caller holds it and what follows)."""
    ctx = conn.ctx
    topic, _payload, qos, _retain, _dup, pid, props = p
    if qos == 2:
        session = conn.session
        if pid in session.qos2_pending:  # type: ignore[union-attr]
            return False  # a resend while the first copy is being stored: PUBREC follows
        if pid in session.qos2_in:  # type: ignore[union-attr]
            # A resend of a QoS 2 message already stored: not stored twice [MQTT-4.3.3-10].
            conn.ack_durable(pid, 5)
            return False
    access = ctx.access
    if access.topic_hook is None:
        allowed = topic[0] != "$" and access.may_publish(conn, topic)
    else:
        verdict = access.may_publish_hooked(conn, topic)
        if verdict is None:
            return True  # the hook is asked: this PUBLISH is handled again with its answer
        allowed = verdict
    counters = conn.counters
    counters["messages_received"] += 1
    if not allowed:
        # `$` topics are never stored as device data; a refused topic is acked and dropped.
        counters["publish_dropped"] += 1
        if qos:
            reason = NOT_AUTHORIZED if topic[0] != "$" else SUCCESS
            if qos == 2 and (reason == SUCCESS or not conn.v5):
                # A successful PUBREC: the client's PUBREL must find the id (PUBCOMP 0x00).
                conn.session.qos2_in.add(pid)  # type: ignore[union-attr]
            conn.send((Puback if qos == 1 else Pubrec)(pid, reason if conn.v5 else 0))
        return False
    msg = make_message(topic, p.payload, qos, p.retain, props, conn.client_id)
    if qos:
        if qos == 2:
            session = conn.session
            session.qos2_in.add(pid)  # type: ignore[union-attr]
            session.qos2_pending.add(pid)  # type: ignore[union-attr]
            session.dirty = session.persistent  # type: ignore[union-attr]
        ctx.inbound.add(msg, conn, pid, qos)
    else:
        ctx.inbound.add(msg)
    return False


def handle_publishes(conn: MqttConnection, packets: list[Publish]) -> None:
    """A read chunk's PUBLISHes (no other packet among them), in order: one call per chunk.

    The common case of fan-in (QoS 0/1, not retained, no properties, not `$`, no ACL or hook) is done
    here in one loop: one receive timestamp for the chunk, the messages handed to `Inbound` in
    one call. Any other PUBLISH goes through `handle_publish`, in its place in the order."""
    ctx = conn.ctx
    access = ctx.access
    if conn.acl is not None or access.authorize_publish is not None or access.topic_hook:
        for i, p in enumerate(packets):  # per-topic decisions: the general path
            if conn.closed:
                return
            if handle_publish(conn, p):  # waits for the auth hook: it and the rest after it
                conn.hold(packets[i:])
                return
        return
    inbound = ctx.inbound
    cid = conn.client_id
    now_ms = int(_time() * 1000)  # read together: received together
    n = len(packets)
    i = 0
    while i < n:
        msgs, pids, i = _publish_messages(packets, i, cid, now_ms, EMPTY_PROPERTIES, MqttMessage)
        if msgs:
            untrack_messages(msgs)
            conn.counters["messages_received"] += len(msgs)
            inbound.add_many(msgs, conn, pids)
        if i < n:  # QoS 2, retained, properties or `$`: the general path, in its place
            if conn.closed:
                return
            if handle_publish(conn, packets[i]):
                conn.hold(packets[i:])
                return
            i += 1


def publish_messages_py(
    packets: list[Publish], i: int, cid: str, now_ms: int, empty: Any, cls: type[MqttMessage]
) -> tuple[list[MqttMessage], list[int], int]:
    """From `packets[i]` on, the plain PUBLISHes (QoS 0/1, not retained, no properties, topic
    not `$...`) as messages, until the first other one: (messages, the QoS 1 ones' packet ids,
    its index or len(packets)). The pure twin of `mqtt_proxy.connection._chandlers.publish_messages`."""
    msgs: list[MqttMessage] = []
    pids: list[int] = []
    n = len(packets)
    while i < n:
        topic, payload, qos, retain, _dup, pid, props = packets[i]
        if props is not empty or qos == 2 or retain or not topic or topic[0] == "$":
            break
        msgs.append(cls(topic, payload, qos, cid, False, None, now_ms))
        if qos:
            pids.append(pid)
        i += 1
    return msgs, pids, i


_publish_messages = twin(
    publish_messages_py,
    "mqtt_proxy.connection._chandlers",
    "publish_messages",
    what="a read chunk's plain PUBLISHes as `MqttMessage`s",
)


def _on_puback(conn: MqttConnection, p: Puback) -> None:
    _outbound_done(conn, p.packet_id, 1)


def handle_pubacks(conn: MqttConnection, packets: list[Puback]) -> None:
    """A read chunk of PUBACKs only (a QoS 1 subscriber's answers to one write): each takes its
    message out of flight (as `_credit`), their subscriptions are credited in one call and the
    session's queues marked for delivery once, not per ack."""
    session = conn.session
    assert session is not None
    inflight = session.inflight
    done: list[Inflight] = []
    for p in packets:
        pid = p[0]
        inf = inflight.get(pid)
        if inf is None or inf.qos != 1:
            continue
        del inflight[pid]
        done.append(inf)
    if done:
        delivery = conn.ctx.delivery
        delivery.acked_many(session, done)
        delivery.mark_session(session)


def _on_pubcomp(conn: MqttConnection, p: Pubcomp) -> None:
    _outbound_done(conn, p.packet_id, 2)


def _outbound_done(conn: MqttConnection, pid: int, qos: int) -> None:
    session = conn.session
    assert session is not None
    delivery = conn.ctx.delivery
    if _credit(session, delivery, pid, qos):
        delivery.mark_session(session)


def _credit(session: Session, delivery: Delivery, pid: int, qos: int) -> bool:
    """The outbound QoS `qos` message `pid` completed (PUBACK, or PUBCOMP after PUBREL): out of
    flight, its subscription credited. False: no such message in flight at that stage."""
    inf = session.inflight.get(pid)
    if inf is None or inf.qos != qos or (qos == 2 and not inf.released):
        return False
    del session.inflight[pid]
    delivery.acked(session, inf)
    return True


def _on_pubrec(conn: MqttConnection, p: Pubrec) -> None:
    session = conn.session
    assert session is not None
    pid = p.packet_id
    inf = session.inflight.get(pid)
    if inf is None:
        conn.send(Pubrel(pid, PACKET_ID_NOT_FOUND if conn.v5 else 0))  # MQTT 5 §4.3.3
        return
    if inf.qos != 2:
        return
    if p.reason_code >= 0x80:
        # MQTT 5 §4.3.3: an error PUBREC ends the exchange; the message counts as handled.
        _outbound_done_now(conn, pid)
        return
    inf.released = True
    if session.persistent:
        # After a PUBREL the PUBLISH is never sent again (3.1.1 §4.3.3): the session says so
        # before the PUBREL goes out, so a restart resends the PUBREL, not a second copy.
        conn.ctx.sessions.after_write(session, lambda: conn.send(Pubrel(pid)))
    else:
        conn.send(Pubrel(pid))


def _outbound_done_now(conn: MqttConnection, pid: int) -> None:
    session = conn.session
    assert session is not None
    inf = session.inflight.pop(pid)
    conn.ctx.delivery.acked(session, inf)
    conn.ctx.delivery.mark_session(session)


def _on_pubrel(conn: MqttConnection, p: Pubrel) -> None:
    """PUBREL of an inbound QoS 2: forget the id (de-dup ends), PUBCOMP."""
    session = conn.session
    assert session is not None
    pid = p.packet_id
    if pid in session.qos2_pending:
        return  # not durable yet: PUBREC has not been sent, so this PUBREL is premature
    found = pid in session.qos2_in
    if found:
        session.qos2_in.discard(pid)
        if session.persistent:
            # After its PUBCOMP the client may use the id for a new message: the session
            # forgets it before, or after a restart that message would be taken for a resend.
            conn.ctx.sessions.after_write(session, lambda: conn.send(Pubcomp(pid, 0)))
            return
    conn.send(Pubcomp(pid, PACKET_ID_NOT_FOUND if conn.v5 and not found else 0))


def handle_subscribe(conn: MqttConnection, p: Subscribe) -> None:
    ctx = conn.ctx
    access = ctx.access
    session = conn.session
    assert session is not None
    hooked = access.topic_hook is not None and not conn.internal
    if hooked and access.subscribe_pending(conn, p, handle_subscribe):
        return
    v5 = conn.v5
    props = p.properties
    sub_id = props.subscription_identifiers[0] if props.subscription_identifiers else None
    replay_since = None
    for k, v in props.user_properties:
        if k == "replay-since":
            replay_since = v
    codes = []
    accepted = []
    for ts in p.subscriptions:
        raw = ts.filter
        try:
            spec = parse_filter(raw, replay_since)
        except FilterError as exc:
            log.info("client %r: SUBSCRIBE %r refused: %s", conn.client_id, raw, exc)
            codes.append(TOPIC_FILTER_INVALID if v5 else 0x80)
            continue
        if not access.may_subscribe(conn, spec.filter):
            codes.append(NOT_AUTHORIZED if v5 else 0x80)
            continue
        if spec.replay_since_ms is not None:
            spec = ctx.backend.bound_replay(spec, ctx.settings.max_replay_depth_ms)
        accepted.append((spec, ts, len(codes)))
        codes.append(ts.qos)
    sessions = ctx.sessions
    # New queue-backed subscriptions need their light queue held first (a call into the core
    # when the proxy runs in its own process): the connection handles nothing else until the
    # SUBACK and the retained messages are out, so packets behind this SUBSCRIBE see it done.
    need: dict[str, FilterSpec] = {}
    for spec, _ts, _i in accepted:
        if sessions.needs_queue(session, spec):
            need.setdefault(spec.raw, spec)
    conn.block()

    def acquired(got: list[Acquired]) -> None:
        if sessions.sessions.get(session.client_id) is not session:
            # The session ended while the core answered (a clean session whose connection
            # closed): nothing to subscribe, give back what was held for it.
            for x in got:
                if not isinstance(x, str):
                    ctx.backend.release(x[0])
            return
        held = dict(zip(need, got, strict=True))
        initial = []
        stored = False
        for spec, ts, i in accepted:
            a = held.pop(spec.raw, None)
            if isinstance(a, str):  # the queue could not be held (e.g. a replay gone)
                codes[i] = UNSPECIFIED if v5 else 0x80
                continue
            sub = sessions.subscribe(
                session, spec, ts.qos, ts.no_local, ts.retain_as_published, ts.retain_handling,
                sub_id, a,
            )  # fmt: skip
            stored = True
            if sub is not None:
                initial.append(sub)

        def saved() -> None:
            conn.send(Suback(p.packet_id, codes))
            sessions.send_initial(initial, conn.unblock)

        if stored:
            sessions.save(session, saved)  # a persistent subscription survives a crash once acked
        else:
            saved()

    ctx.backend.acquire_many(list(need.values()), acquired)


def handle_unsubscribe(conn: MqttConnection, p: Unsubscribe) -> None:
    session = conn.session
    assert session is not None
    sessions = conn.ctx.sessions
    codes = [0x00 if sessions.unsubscribe(session, f) else 0x11 for f in p.filters]

    def saved() -> None:
        conn.send(Unsuback(p.packet_id, codes if conn.v5 else ()))
        conn.unblock()

    conn.block()
    if 0x00 in codes:
        sessions.save(session, saved)
    else:
        saved()


def handle_disconnect(conn: MqttConnection, p: Disconnect) -> None:
    session = conn.session
    reason = p.reason_code
    session_expiry = p.properties.session_expiry_interval
    if session_expiry is not None and session is not None:
        if session.expiry == 0 and session_expiry > 0:
            # MQTT 5 §3.14.2.2.2: a session that was not persistent cannot become so now.
            conn.protocol_error(PROTOCOL_ERROR, "session expiry set on DISCONNECT after 0")
            return
        session.expiry = min(session_expiry, conn.ctx.settings.max_session_expiry)
        session.persistent = session.expiry > 0
    # MQTT 5 §3.1.2.5: only reason 0x00 discards the will (0x04 and errors publish it).
    conn.will_on_close = reason != 0
    conn.disconnect_reason = "disconnect" if reason in (0, 4) else f"client reason 0x{reason:02x}"
    conn.close_with(0, send_disconnect=False, linger=False)  # nothing of ours to read


def _on_pingreq(conn: MqttConnection, p: Pingreq) -> None:
    conn.write(PINGRESP)


def _on_auth(conn: MqttConnection, p: Auth) -> None:
    # We offer no enhanced authentication, so no AUTH exchange was ever started [MQTT-4.12.0-1].
    conn.protocol_error(PROTOCOL_ERROR, "AUTH without enhanced authentication")


def _unexpected(conn: MqttConnection, p: Packet) -> None:
    conn.protocol_error(PROTOCOL_ERROR, f"{type(p).__name__} is not sent to a server")


# The codec's state table already refused anything out of order, so handlers need no state check.
# Keyed by packet type, each handler taking that type: Any is the one honest parameter type here.
DISPATCH: dict[type, Callable[[MqttConnection, Any], object]] = {
    Connect: handle_connect,
    Publish: handle_publish,
    Puback: _on_puback,
    Pubrec: _on_pubrec,
    Pubrel: _on_pubrel,
    Pubcomp: _on_pubcomp,
    Subscribe: handle_subscribe,
    Unsubscribe: handle_unsubscribe,
    Pingreq: _on_pingreq,
    Disconnect: handle_disconnect,
    Auth: _on_auth,
}
for _t in (Connack, Suback, Unsuback, Pingresp):
    DISPATCH[_t] = _unexpected
