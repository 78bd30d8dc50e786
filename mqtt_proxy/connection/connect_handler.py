"""CONNECT: credentials, client id, keep alive, will, session, CONNACK.

The first packet's handler, out of handlers.py for its size: the checks that may refuse a
client (TLS identity, password file and hooks, connection limits, keep alive, will ACL), then,
with several proxies, the core's claim of the client id, then the session and the CONNACK.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from mqtt_proxy.codec import EMPTY_PROPERTIES, Connect, Properties, ReasonCode
from mqtt_proxy.delivery.topic_aliases import OutAliases
from mqtt_proxy.messages import message_properties
from mqtt_proxy.sessions.state import Will
from store.auth import ConnectVerdict
from store.auth.jwt_auth import Grant, looks_like_jwt
from store.bans import Ban
from store.mapping import internal_password, is_internal_client

if TYPE_CHECKING:
    from mqtt_proxy.connection.connection import MqttConnection

SUCCESS = ReasonCode.SUCCESS
PROTOCOL_ERROR = ReasonCode.PROTOCOL_ERROR
BAD_CLIENT_ID = ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
BAD_CREDENTIALS = ReasonCode.BAD_USER_NAME_OR_PASSWORD
NOT_AUTHORIZED = ReasonCode.NOT_AUTHORIZED
BAD_AUTH_METHOD = ReasonCode.BAD_AUTHENTICATION_METHOD
SERVER_BUSY = ReasonCode.SERVER_BUSY
CONNECTION_RATE_EXCEEDED = ReasonCode.CONNECTION_RATE_EXCEEDED
BANNED = ReasonCode.BANNED

log = logging.getLogger("lightgate.mqtt.bans")

# Refused CONNECTs by cause, for `lightgate_mqtt_connect_refused_total{reason}`: the two
# authentication failures apart, as an alert on them watches for password guessing.
REFUSAL_LABELS: dict[int, str] = {
    BAD_CREDENTIALS: "bad_credentials",
    NOT_AUTHORIZED: "not_authorized",
    BAD_AUTH_METHOD: "bad_auth_method",
    BAD_CLIENT_ID: "bad_client_id",
    SERVER_BUSY: "server_busy",
    CONNECTION_RATE_EXCEEDED: "rate_exceeded",
    BANNED: "banned",
}


class Refuse(Exception):
    """CONNECT refused with a reason code (CONNACK, then close); `logged`: said already."""

    def __init__(self, reason: int, detail: str, logged: bool = False) -> None:
        super().__init__(detail)
        self.reason = reason
        self.logged = logged


def certificate_identity(conn: MqttConnection, required: bool, as_username: bool) -> str | None:
    """On a TLS connection (mqtts, wss): the client certificate's CN when it is the user name
    (`tls_identity_as_username`), else None. Refuses (0x87 / 0x05) a client without a verified
    certificate when one is required (docs/security.md, "TLS"); plain listeners are not concerned.
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
    ctx = conn.ctx
    if conn.connected or conn.session is not None:
        conn.protocol_error(PROTOCOL_ERROR, "second CONNECT [MQTT-3.1.0-2]")
        return
    version = c.protocol_level
    conn.version = version
    conn.v5 = version == 5
    try:
        # Overload is answered (v5 0x9F / 0x89, 3.1.1 0x03 Server unavailable), never fatal.
        if conn.over_conn_rate:
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
        internal = is_internal_client(client_id)
        if internal and not hmac.compare_digest(
            c.password or b"", internal_password(ctx.settings.internal_secret, client_id)
        ):
            raise Refuse(NOT_AUTHORIZED, "an internal client id without the gateway's credential")
        ban = None if internal else ctx.bans.banned(client_id, conn.remote.rpartition(":")[0])
        if ban is not None:
            raise _banned(conn, client_id, ban)
        s = ctx.settings
        identity = certificate_identity(conn, s.tls_require_client_cert, s.tls_identity_as_username)
    except Refuse as r:
        _refuse(conn, c, r)
        return
    if identity is not None:  # tls_identity_as_username: the verified CN is the user, no password
        _connect_checked(conn, c, client_id, assigned, ConnectVerdict.OK, False, identity)
        return
    if internal:  # proven above: the gateway's own probe, past users' credentials and rights
        _connect_checked(conn, c, client_id, assigned, ConnectVerdict.OK, False, c.username or "")
        return
    security = ctx.access.security
    jwt_auth = security.jwt
    if jwt_auth is not None and looks_like_jwt(c.password):
        # A token: checked on the loop (a JWKS fetch for an unknown kid is awaited, not blocked on).
        conn.block()
        token = (c.password or b"").decode("latin-1")
        task = ctx.loop.create_task(jwt_auth.verify_async(token, client_id))
        task.add_done_callback(lambda t: _token_checked(conn, c, client_id, assigned, t))
        return
    http = security.http
    if http is not None and http.settings.connect_url:
        conn.block()
        ask = http.authenticate(c.username, c.password, client_id, conn.remote.rpartition(":")[0])
        asked = ctx.loop.create_task(ask)
        asked.add_done_callback(lambda t: _hook_checked(conn, c, client_id, assigned, t))
        return
    if security.passwords is not None and c.username is not None:
        conn.block()
        fut = ctx.loop.run_in_executor(None, security.check_connect, c.username, c.password)
        fut.add_done_callback(
            lambda f: _connect_checked(conn, c, client_id, assigned, f.result(), True)
        )
        return
    verdict = security.check_connect(c.username, c.password)
    _connect_checked(conn, c, client_id, assigned, verdict, False)


def _token_checked(
    conn: MqttConnection,
    c: Connect,
    client_id: str,
    assigned: str | None,
    task: asyncio.Task[Grant],
) -> None:
    """A token verified or refused: refusals are bad credentials (0x86 / 0x04), as a wrong
    password is; the reason goes to the log only."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        conn.ctx.conn_log.event(
            "token_refused", conn.conn_id, "client %r from %s: %s", c.client_id, conn.remote, exc
        )
        _connect_checked(conn, c, client_id, assigned, ConnectVerdict.BAD_CREDENTIALS, True)
        return
    grant = task.result()
    _connect_checked(conn, c, client_id, assigned, ConnectVerdict.OK, True, grant=grant)


def _hook_checked(
    conn: MqttConnection, c: Connect, client_id: str, assigned: str | None, task: asyncio.Task[bool]
) -> None:
    if task.cancelled():
        return
    ok = task.exception() is None and task.result()
    verdict = ConnectVerdict.OK if ok else ConnectVerdict.BAD_CREDENTIALS
    if not ok and c.username is None:
        verdict = ConnectVerdict.NOT_AUTHORIZED
    _connect_checked(conn, c, client_id, assigned, verdict, True)


def _banned(conn: MqttConnection, client_id: str, ban: Ban) -> Refuse:
    """The refusal of a banned client (0x8A Banned, 0x05 in 3.1.1); logs the first refusal of
    each ban only: a banned device typically retries every few seconds while the ban lasts."""
    ctx = conn.ctx
    detail = f"banned {ban.kind} {ban.value!r} ({ban.reason or 'no reason given'})"
    if ctx.bans.first_refusal(ban):
        until = "until removed" if not ban.until else f"until {ban.until:.0f} (Unix time)"
        log.warning("client %r from %s refused: %s, %s; further refusals not logged",
                    client_id, conn.remote, detail, until)  # fmt: skip
    return Refuse(BANNED, detail, logged=True)


def refusal_label(reason: int) -> str:
    """The `reason` label of a refused CONNECT in the figures."""
    return REFUSAL_LABELS.get(reason, "other")


def _refuse(conn: MqttConnection, c: Connect, r: Refuse) -> None:
    ctx = conn.ctx
    if is_internal_client(c.client_id):  # a probe refused (no anonymous access): not a user's
        ctx.internal_counters["connect_refused"] += 1
    else:
        ctx.counters["connect_refused"] += 1
        refused = ctx.refused
        label = refusal_label(r.reason)
        refused[label] = refused.get(label, 0) + 1
    if not r.logged:
        ctx.conn_log.event(
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
    grant: Grant | None = None,
) -> None:
    """CONNECT once the credentials are decided: session, CONNACK, resume delivery. `grant`:
    what a token proved (the user name is its claim's, not CONNECT's, and it may carry rights)."""
    if conn.closed:
        return  # the client left while its password was checked
    ctx = conn.ctx
    s = ctx.settings
    v5 = conn.v5
    cp = c.properties
    username, password = (identity, None) if identity is not None else (c.username, c.password)
    if grant is not None:
        username = grant.user
    try:
        if verdict is not ConnectVerdict.OK:
            code = BAD_CREDENTIALS if verdict is ConnectVerdict.BAD_CREDENTIALS else NOT_AUTHORIZED
            raise Refuse(code, f"{verdict.value} (user {c.username!r})")
        if not ctx.access.check_auth(client_id, username, password):
            raise Refuse(
                BAD_CREDENTIALS if username is not None else NOT_AUTHORIZED,
                "authentication failed",
            )
        if ctx.server_busy(client_id):  # here, not earlier: no check in flight overtakes it
            raise Refuse(SERVER_BUSY, f"max_connections ({s.max_connections})")
        conn.username = username
        conn.client_id = client_id
        if grant is not None:
            conn.token_acl = grant.acl
            if grant.expires_at is not None:
                conn.expire_at(grant.expires_at - time.time())
        if is_internal_client(client_id):  # a probe: its traffic is counted apart from users'
            conn.internal = True
            conn.counters = ctx.internal_counters
            ctx.internal_ids.add(client_id)
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
            if w.topic.startswith("$") or not ctx.access.may_publish(conn, w.topic):
                raise Refuse(NOT_AUTHORIZED, f"will topic {w.topic!r} not authorized")
            wp = w.properties
            will = Will(
                w.topic,
                w.payload,
                w.qos,
                w.retain,
                wp.will_delay_interval or 0,
                message_properties(wp),
                username,
                client_id,
                conn.token_acl,
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
                ctx.delivery.aliases, cp.topic_alias_maximum, conn.max_out_packet
            )
    args = (client_id, assigned, expiry, will, keepalive, server_keepalive)
    cluster = ctx.backend.cluster
    if cluster is None:
        node_claim = ctx.sessions.node_claim
        if node_claim is None or assigned is not None:  # an id made here is unique
            _connect_open(conn, c, *args, blocked)
            return
        # Other nodes: the id is made this node's first (a connection of it on another node
        # ends, its session comes here); the connection waits.
        if not blocked:
            conn.block()

        def node_claimed(moved: bool, state: dict[str, Any] | None) -> None:
            if moved:
                ctx.sessions.moved_in(client_id, state)
            if not conn.closed:
                _connect_open(conn, c, *args, True)

        node_claim(client_id, node_claimed)
        return
    # Several proxies: the core makes this client id ours first (ending a connection of it on
    # another proxy, handing its session over) before the CONNACK; the connection waits.
    if not blocked:
        conn.block()

    def claimed(state: dict[str, Any] | None) -> None:
        if state is not None:
            ctx.sessions.install(state)
        if not conn.closed:
            _connect_open(conn, c, *args, True)

    def banned(ban: Ban) -> None:
        if not conn.closed:
            _refuse(conn, c, _banned(conn, client_id, ban))

    cluster.claim(client_id, conn.remote.rpartition(":")[0], claimed, banned)


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
    ctx = conn.ctx
    s = ctx.settings
    v5 = conn.v5
    version = conn.version
    cp = c.properties
    session, present = ctx.sessions.open(conn, client_id, c.clean_start, expiry, version, will)
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
    conn.counters["connects"] += 1
    ctx.events.connect(client_id, conn.remote)
    ctx.conn_log.event(
        "connected", conn.conn_id, "client %r from %s MQTT %s keepalive=%d session_present=%d",
        client_id, conn.remote, "5" if v5 else "3.1.1" if conn.version == 4 else "3.1",
        keepalive, int(present),
    )  # fmt: skip
    ctx.sessions.resume(session)
    if blocked:
        conn.unblock()
