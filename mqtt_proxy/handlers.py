"""Packet handlers: what the server does with each MQTT packet of a connection.

The codec (`mqtt_proxy.codec`) turns bytes into packet events and checks the wire rules; these
functions hold the broker rules: CONNECT negotiation, PUBLISH to the store, acks,
SUBSCRIBE/UNSUBSCRIBE with ACLs and `$share`/`$replay`, DISCONNECT. `DISPATCH` maps each event
type to its handler; `MqttConnection._handle` calls PUBLISH's directly (the hot path).
"""

from __future__ import annotations

import logging
import secrets
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
    Properties,
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
from mqtt_proxy.ports import Acquired
from mqtt_proxy.session import Will
from mqtt_proxy.subscriptions import FilterError, FilterSpec, parse_filter
from mqtt_proxy.topic_aliases import OutAliases
from store.auth import ConnectVerdict
from store.mapping import MqttMessage, untrack_messages

if TYPE_CHECKING:
    from mqtt_proxy.connection import MqttConnection

log = logging.getLogger("lightgate.mqtt")

# The MQTT 5 reason codes used here (codec.ReasonCode; the codec maps them for 3.1.1).
SUCCESS = ReasonCode.SUCCESS
PROTOCOL_ERROR = ReasonCode.PROTOCOL_ERROR
BAD_CLIENT_ID = ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
BAD_CREDENTIALS = ReasonCode.BAD_USER_NAME_OR_PASSWORD
NOT_AUTHORIZED = ReasonCode.NOT_AUTHORIZED
BAD_AUTH_METHOD = ReasonCode.BAD_AUTHENTICATION_METHOD
TOPIC_FILTER_INVALID = ReasonCode.TOPIC_FILTER_INVALID
PACKET_ID_NOT_FOUND = ReasonCode.PACKET_IDENTIFIER_NOT_FOUND
UNSPECIFIED = ReasonCode.UNSPECIFIED_ERROR
SERVER_BUSY = ReasonCode.SERVER_BUSY
CONNECTION_RATE_EXCEEDED = ReasonCode.CONNECTION_RATE_EXCEEDED


class Refuse(Exception):
    """CONNECT refused with a reason code (CONNACK, then close)."""

    def __init__(self, reason: int, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def certificate_identity(conn: MqttConnection, required: bool, as_username: bool) -> str | None:
    """On a TLS connection (mqtts, wss): the client certificate's CN when it is the user name
    (`tls_identity_as_username`), else None. Refuses (0x87 / 0x05) a client without a verified
    certificate when one is required, as INTERFACES.md says; plain listeners are not concerned.
    The TLS layer already checked the certificate against `tls_ca` (lightgate/tls.py)."""
    if not (required or as_username):
        return None
    tls = conn.transport.get_extra_info("ssl_object")
    if tls is None:
        return None
    cert = tls.getpeercert()
    if not cert:
        why = "tls_identity_as_username" if as_username else "tls_require_client_cert"
        raise Refuse(NOT_AUTHORIZED, f"no client certificate ({why})")
    if not as_username:
        return None
    cn = next((v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"), None)
    if not cn:
        raise Refuse(NOT_AUTHORIZED, "the client certificate has no CN (tls_identity_as_username)")
    return str(cn)


def handle_connect(conn: MqttConnection, c: Connect) -> None:
    """Negotiate and authenticate; a password check runs in a thread (PBKDF2, about 6 ms) while
    the connection holds its later packets (`block`), then `_connect_checked` goes on."""
    server = conn.server
    if conn.connected or conn.session is not None:
        conn.protocol_error(PROTOCOL_ERROR, "second CONNECT [MQTT-3.1.0-2]")
        return
    version = c.protocol_level
    conn.version = version
    conn.v5 = version == 5
    try:
        # Overload is answered (v5 0x9F / 0x89, 3.1.1 0x03 Server unavailable), never fatal.
        if conn.over_conn_rate:
            server.counters["connect_rate_exceeded"] += 1
            raise Refuse(CONNECTION_RATE_EXCEEDED, "max_connection_rate from this address")
        if c.properties.authentication_method is not None:
            raise Refuse(
                BAD_AUTH_METHOD, f"authentication method {c.properties.authentication_method!r}"
            )
        client_id = c.client_id
        assigned = None
        if not client_id:
            if not conn.v5 and not c.clean_start:
                raise Refuse(BAD_CLIENT_ID, "empty client id needs clean session [MQTT-3.1.3-8]")
            client_id = assigned = "lg-" + secrets.token_hex(8)
        s = server.settings
        identity = certificate_identity(conn, s.tls_require_client_cert, s.tls_identity_as_username)
    except Refuse as r:
        _refuse(conn, c, r)
        return
    if identity is not None:  # tls_identity_as_username: the verified CN is the user, no password
        _connect_checked(conn, c, client_id, assigned, ConnectVerdict.OK, False, identity)
        return
    security = server.security
    if security.passwords is not None and c.username is not None:
        conn.block()
        fut = server.loop.run_in_executor(None, security.check_connect, c.username, c.password)
        fut.add_done_callback(
            lambda f: _connect_checked(conn, c, client_id, assigned, f.result(), True)
        )
        return
    verdict = security.check_connect(c.username, c.password)
    _connect_checked(conn, c, client_id, assigned, verdict, False)


def _refuse(conn: MqttConnection, c: Connect, r: Refuse) -> None:
    server = conn.server
    server.counters["connect_refused"] += 1
    server.conn_log.event(
        "refused", conn.conn_id, "client %r from %s: 0x%02x %s",
        c.client_id, conn.remote, r.reason, r,
    )  # fmt: skip
    conn.disconnect_reason = str(r)
    conn.send_connack(False, r.reason, EMPTY_PROPERTIES)
    conn.close_with(0, send_disconnect=False)


def _connect_checked(
    conn: MqttConnection,
    c: Connect,
    client_id: str,
    assigned: str | None,
    verdict: ConnectVerdict,
    blocked: bool,
    identity: str | None = None,
) -> None:
    """CONNECT once the credentials are decided: session, CONNACK, resume delivery."""
    if conn.closed:
        return  # the client left while its password was checked
    server = conn.server
    s = server.settings
    v5 = conn.v5
    cp = c.properties
    username, password = (identity, None) if identity is not None else (c.username, c.password)
    try:
        if verdict is not ConnectVerdict.OK:
            code = BAD_CREDENTIALS if verdict is ConnectVerdict.BAD_CREDENTIALS else NOT_AUTHORIZED
            raise Refuse(code, f"{verdict.value} (user {c.username!r})")
        if not server.check_auth(client_id, username, password):
            raise Refuse(
                BAD_CREDENTIALS if username is not None else NOT_AUTHORIZED,
                "authentication failed",
            )
        if server.server_busy(client_id):  # here, not earlier: no check in flight overtakes it
            server.counters["connect_server_busy"] += 1
            raise Refuse(SERVER_BUSY, f"max_connections ({s.max_connections})")
        conn.username = username
        conn.client_id = client_id
        conn.refresh_acl()
        keepalive = c.keep_alive
        server_keepalive = None
        if v5:
            if keepalive == 0 or keepalive > s.max_keepalive:
                keepalive = server_keepalive = s.max_keepalive
        elif keepalive > s.max_keepalive:
            # 3.1.1 cannot be told a shorter keep alive; refuse it as Mosquitto does.
            raise Refuse(BAD_CLIENT_ID, f"keep alive {keepalive} > max_keepalive {s.max_keepalive}")
        if v5:
            expiry = min(cp.session_expiry_interval or 0, s.max_session_expiry)
        else:
            expiry = 0 if c.clean_start else s.max_session_expiry
        will = None
        w = c.will
        if w is not None:
            if w.topic.startswith("$") or not server.may_publish(conn, w.topic):
                raise Refuse(NOT_AUTHORIZED, f"will topic {w.topic!r} not authorized")
            wp = w.properties
            will = Will(
                w.topic,
                w.payload,
                w.qos,
                w.retain,
                wp.will_delay_interval or 0,
                server.message_properties(wp),
            )
    except Refuse as r:
        _refuse(conn, c, r)
        return
    if v5:
        if cp.receive_maximum:
            conn.out_window = min(conn.out_window, cp.receive_maximum)
        conn.max_out_packet = cp.maximum_packet_size or 0
        if cp.topic_alias_maximum and s.topic_alias_out and s.max_topic_alias_out:
            conn.out_aliases = OutAliases(
                server.delivery.aliases, cp.topic_alias_maximum, conn.max_out_packet
            )
    args = (client_id, assigned, expiry, will, keepalive, server_keepalive)
    cluster = server.backend.cluster
    if cluster is None:
        _connect_open(conn, c, *args, blocked)
        return
    # Several proxies: the core makes this client id ours first (ending a connection of it on
    # another proxy, handing its session over) before the CONNACK; the connection waits.
    if not blocked:
        conn.block()

    def claimed(state: dict[str, Any] | None) -> None:
        if state is not None:
            server.sessions.install(state)
        if not conn.closed:
            _connect_open(conn, c, *args, True)

    cluster.claim(client_id, claimed)


def _connect_open(
    conn: MqttConnection,
    c: Connect,
    client_id: str,
    assigned: str | None,
    expiry: int,
    will: Will | None,
    keepalive: int,
    server_keepalive: int | None,
    blocked: bool,
) -> None:
    """The client id is this proxy's: open or resume the session, CONNACK, resume delivery."""
    server = conn.server
    s = server.settings
    v5 = conn.v5
    version = conn.version
    cp = c.properties
    session, present = server.sessions.open(conn, client_id, c.clean_start, expiry, version, will)
    conn.accepted(session, client_id, version, keepalive)
    props = EMPTY_PROPERTIES
    if v5:
        props = Properties(
            receive_maximum=s.receive_maximum,
            maximum_packet_size=s.max_packet_size or None,  # 0: no limit, no property
            topic_alias_maximum=s.max_topic_alias,
            assigned_client_identifier=assigned,
            server_keep_alive=server_keepalive,
            session_expiry_interval=expiry
            if cp.session_expiry_interval not in (None, expiry)
            else None,
        )
    conn.send_connack(present, SUCCESS, props)
    server.counters["connects"] += 1
    server.events.connect(client_id, conn.remote)
    server.conn_log.event(
        "connected", conn.conn_id, "client %r from %s MQTT %s keepalive=%d session_present=%d",
        client_id, conn.remote, "5" if v5 else "3.1.1" if conn.version == 4 else "3.1",
        keepalive, int(present),
    )  # fmt: skip
    server.sessions.resume(session)
    if blocked:
        conn.unblock()


def handle_publish(conn: MqttConnection, p: Publish) -> None:
    """Inbound PUBLISH (aliases already resolved and Receive Maximum checked by the codec):
    QoS 2 de-duplication, `$` topics, ACL, then into this tick's append batch."""
    server = conn.server
    topic, _payload, qos, _retain, _dup, pid, props = p
    if qos == 2:
        session = conn.session
        if pid in session.qos2_pending:  # type: ignore[union-attr]
            return  # a resend while the first copy is being stored: PUBREC follows
        if pid in session.qos2_in:  # type: ignore[union-attr]
            # A resend of a QoS 2 message already stored: not stored twice [MQTT-4.3.3-10].
            conn.ack_durable(pid, 5)
            return
    counters = server.counters
    counters["messages_received"] += 1
    if topic[0] == "$" or not server.may_publish(conn, topic):
        # `$` topics are never stored as device data; a refused topic is acked and dropped.
        counters["publish_dropped"] += 1
        if qos:
            reason = NOT_AUTHORIZED if topic[0] != "$" else SUCCESS
            if qos == 2 and (reason == SUCCESS or not conn.v5):
                # A successful PUBREC: the client's PUBREL must find the id (PUBCOMP 0x00).
                conn.session.qos2_in.add(pid)  # type: ignore[union-attr]
            conn.send((Puback if qos == 1 else Pubrec)(pid, reason if conn.v5 else 0))
        return
    msg = server.make_message(topic, p.payload, qos, p.retain, props, conn.client_id)
    if qos:
        if qos == 2:
            session = conn.session
            session.qos2_in.add(pid)  # type: ignore[union-attr]
            session.qos2_pending.add(pid)  # type: ignore[union-attr]
            session.dirty = session.persistent  # type: ignore[union-attr]
        server.inbound.add(msg, conn, pid, qos)
    else:
        server.inbound.add(msg)


def handle_publishes(conn: MqttConnection, packets: list[Publish]) -> None:
    """A read chunk's PUBLISHes (no other packet among them), in order: one call per chunk.

    The common case of fan-in (QoS 0/1, not retained, no properties, not `$`, no ACL or hook) is done
    here in one loop: one receive timestamp for the chunk, the messages handed to `Inbound` in
    one call. Any other PUBLISH goes through `handle_publish`, in its place in the order."""
    server = conn.server
    if conn.acl is not None or server.authorize_publish is not None:
        for p in packets:  # per-topic decisions: the general path
            if conn.closed:
                return
            handle_publish(conn, p)
        return
    inbound = server.inbound
    cid = conn.client_id
    now_ms = int(_time() * 1000)  # read together: received together
    msgs: list[MqttMessage] = []
    acks: list[int] = []  # packet id per message, 0 for QoS 0
    EMPTY = EMPTY_PROPERTIES
    for p in packets:
        topic, payload, qos, retain, _dup, pid, props = p
        if qos == 2 or retain or props is not EMPTY or topic[0] == "$":
            if msgs:
                untrack_messages(msgs)
                server.counters["messages_received"] += len(msgs)
                inbound.add_many(msgs, conn, acks)
                msgs, acks = [], []
            if conn.closed:
                return
            handle_publish(conn, p)
            continue
        msgs.append(MqttMessage(topic, payload, qos, cid, retain, None, now_ms))
        acks.append(pid)
    if msgs:
        untrack_messages(msgs)
        server.counters["messages_received"] += len(msgs)
        inbound.add_many(msgs, conn, acks)


def _on_puback(conn: MqttConnection, p: Puback) -> None:
    _outbound_done(conn, p.packet_id, 1)


def _on_pubcomp(conn: MqttConnection, p: Pubcomp) -> None:
    _outbound_done(conn, p.packet_id, 2)


def _outbound_done(conn: MqttConnection, pid: int, qos: int) -> None:
    session = conn.session
    assert session is not None
    inf = session.inflight.get(pid)
    if inf is None or inf.qos != qos or (qos == 2 and not inf.released):
        return
    del session.inflight[pid]
    delivery = conn.server.delivery
    delivery.acked(session, inf)
    delivery.mark_session(session)


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
    session.dirty = session.persistent
    conn.send(Pubrel(pid))


def _outbound_done_now(conn: MqttConnection, pid: int) -> None:
    session = conn.session
    assert session is not None
    inf = session.inflight.pop(pid)
    conn.server.delivery.acked(session, inf)
    conn.server.delivery.mark_session(session)


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
        session.dirty = session.persistent
    conn.send(Pubcomp(pid, PACKET_ID_NOT_FOUND if conn.v5 and not found else 0))


def handle_subscribe(conn: MqttConnection, p: Subscribe) -> None:
    server = conn.server
    session = conn.session
    assert session is not None
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
        if not server.may_subscribe(conn, spec.filter):
            codes.append(NOT_AUTHORIZED if v5 else 0x80)
            continue
        if spec.replay_since_ms is not None:
            spec = server.backend.bound_replay(spec, server.settings.max_replay_depth_ms)
        accepted.append((spec, ts, len(codes)))
        codes.append(ts.qos)
    sessions = server.sessions
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
                    server.backend.release(x[0])
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

    server.backend.acquire_many(list(need.values()), acquired)


def handle_unsubscribe(conn: MqttConnection, p: Unsubscribe) -> None:
    session = conn.session
    assert session is not None
    sessions = conn.server.sessions
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
        session.expiry = min(session_expiry, conn.server.settings.max_session_expiry)
        session.persistent = session.expiry > 0
    # MQTT 5 §3.1.2.5: only reason 0x00 discards the will (0x04 and errors publish it).
    conn.will_on_close = reason != 0
    conn.disconnect_reason = "disconnect" if reason in (0, 4) else f"client reason 0x{reason:02x}"
    conn.close_with(0, send_disconnect=False)


def _on_pingreq(conn: MqttConnection, p: Pingreq) -> None:
    conn.write(PINGRESP)


def _on_auth(conn: MqttConnection, p: Auth) -> None:
    # We offer no enhanced authentication, so no AUTH exchange was ever started [MQTT-4.12.0-1].
    conn.protocol_error(PROTOCOL_ERROR, "AUTH without enhanced authentication")


def _unexpected(conn: MqttConnection, p: Packet) -> None:
    conn.protocol_error(PROTOCOL_ERROR, f"{type(p).__name__} is not sent to a server")


# The codec's state table already refused anything out of order, so handlers need no state check.
# Keyed by packet type, each handler taking that type: Any is the one honest parameter type here.
DISPATCH: dict[type, Callable[[MqttConnection, Any], None]] = {
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
