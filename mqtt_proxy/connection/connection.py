"""One MQTT connection: a slotted asyncio.Protocol around the sans-IO codec `Connection`.

`data_received` feeds the whole chunk to the codec and handles the list of packets it returns
(one call per chunk, no await per packet); the codec checks the state table, resolves inbound
topic aliases and enforces our v5 Receive Maximum. Writes go straight to the transport;
`pause_writing` marks the connection
unwritable so delivery skips it, and `resume_writing` asks delivery to pump its queues again
(no drain per write). Keep alive uses one lazily rescheduled timer: `data_received` only stores the
time, and the timer, when it fires, re-arms itself for the real deadline
(no cancel and re-arm per packet).

Bypassing `codec.send` on two hot paths, on purpose: shared PUBLISH templates are written as
bytes (encode once, write many; our own window limits them, see delivery.py), and 3.1.1
PUBACK/PUBREC are four fixed bytes (the codec tracks inbound flight only for v5, so for v5 the
acks do go through `codec.send`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mqtt_proxy.codec import (
    EMPTY_PROPERTIES,
    PROTOCOL_MAX_PACKET_SIZE,
    SERVER,
    Connack,
    Connection,
    LocalProtocolError,
    Packet,
    Puback,
    Publish,
    Pubrec,
    RemoteProtocolError,
    State,
    chunk_kind,
)
from mqtt_proxy.codec.reason_codes import ReasonCode, v3_connack_code
from mqtt_proxy.connection import handlers
from mqtt_proxy.connection.limits import PublishLimit
from mqtt_proxy.connection.linger import LINGER_BYTES, linger_close
from mqtt_proxy.delivery.outbound import acks
from mqtt_proxy.delivery.topic_aliases import OutAliases

if TYPE_CHECKING:
    from mqtt_proxy.codec import Properties
    from mqtt_proxy.context import ProxyContext
    from mqtt_proxy.ports import ClientPort
    from mqtt_proxy.sessions.state import Session
    from store.auth import ClientAcl

log = logging.getLogger("lightgate.mqtt.conn")
PACKET_TOO_LARGE = 0x95


class MqttConnection(asyncio.Protocol):
    __slots__ = (
        "ctx",
        "transport",
        "codec",
        "session",
        "client_id",
        "v5",
        "version",
        "writable",
        "closed",
        "keepalive",
        "last_rx",
        "ka_slot",
        "out_window",
        "max_out_packet",
        "session_overlap",
        "will_on_close",
        "remote",
        "username",
        "disconnect_reason",
        "_loop",
        "connected",
        "_blocked",
        "_held",
        "paused_since",
        "acl",
        "token_acl",
        "_expiry",
        "rate",
        "_rate_timer",
        "opened_at",
        "over_conn_rate",
        "conn_id",
        "out_aliases",
        "_linger",
        "_drained",
        "counters",
        "internal",
    )

    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx  # what this connection uses of the proxy around it (context.py)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        # max_packet_size 0 = no limit of ours (as in Mosquitto): MQTT's own 256 MiB still applies.
        limit = ctx.settings.max_packet_size or PROTOCOL_MAX_PACKET_SIZE
        self.codec = Connection(SERVER, max_packet_size=limit)
        self.session: Session | None = None
        self.client_id = ""
        self.v5 = False
        self.version = 4
        self.writable = True
        self.closed = False
        self.keepalive = 0.0
        self.last_rx = 0.0
        self.ka_slot = 0  # the KeepaliveWheel files us here
        self.out_window = ctx.settings.receive_maximum
        self.max_out_packet = 0  # v5 client's Maximum Packet Size; 0 = unlimited
        self.session_overlap = False
        self.will_on_close = True
        self.remote = ""
        self.username: str | None = None  # as CONNECT gave it, or the certificate's CN
        self.disconnect_reason = ""
        self.connected = False
        self._loop = ctx.loop
        self._blocked = False  # an operation of this connection waits for the core (block())
        self._held: list[Packet] = []  # packets received meanwhile, handled on unblock()
        self.paused_since = 0.0  # loop time of the last pause_writing (delivery's slow check)
        # max_publish_(bytes_)rate (limits.py): this client's buckets, armed at CONNECT; None:
        # no limit.
        # While `_rate_timer` is set the connection is blocked for lack of tokens (_rate_block).
        self.rate: PublishLimit | None = None
        self._rate_timer: asyncio.TimerHandle | None = None
        self.opened_at = 0.0
        self.over_conn_rate = False  # max_connection_rate: its CONNECT gets 0x9F / 0x03
        # This client's compiled ACL (store.auth.ClientAcl); None when everything is allowed,
        # so the hot paths pay one `is None` test. Replaced on reload (refresh_acl).
        self.acl: ClientAcl | None = None
        # The rights a JWT carried (its ACL claim), which the acl_file does not replace on reload;
        # `_expiry` closes the connection when that token expires.
        self.token_acl: ClientAcl | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self.conn_id = ctx.conn_log.new_id()
        # Server-assigned outbound topic aliases (topic_aliases.py), set at CONNECT for a v5
        # client that announced a Topic Alias Maximum; per connection, so a reconnect starts over.
        self.out_aliases: OutAliases | None = None
        # Closed with an answer in flight: the timer that ends the linger (linger.py), and the
        # bytes read and dropped meanwhile.
        self._linger: asyncio.TimerHandle | None = None
        self._drained = 0
        # The counters this connection's traffic goes to: users', or `internal_counters`
        # once CONNECT names an internal client (a probe), so that users' figures never count it
        # and the hot paths pay nothing for the choice.
        self.counters: dict[str, int] = ctx.counters
        self.internal = False  # a proven internal client (a probe): no ACL, no auth hook

    # -- asyncio.Protocol ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.remote = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        self.last_rx = self.opened_at = self._loop.time()
        self.over_conn_rate = not self.ctx.connection_allowed(peer)
        transport.set_write_buffer_limits(high=self.ctx.settings.write_high_water)  # type: ignore[attr-defined]
        # A client must send CONNECT promptly: the keep alive timer doubles as CONNECT timeout.
        timeout = self.ctx.settings.connect_timeout_s
        self.keepalive = timeout / 1.5
        self.ctx.keepalive.add(self, self.last_rx + timeout)

    def data_received(self, data: bytes) -> None:
        if self.closed:  # lingering after our last answer (linger.py): read and drop
            self._drained += len(data)
            if self._drained > LINGER_BYTES:
                self.transport.close()
            return
        # The bytes are counted after the chunk is handled: a CONNECT's chunk goes to the
        # counters that CONNECT chose (an internal client's bytes never reach users' figures).
        try:
            packets = self.codec.receive_data(data)
            if packets:
                # Keep alive counts whole packets (MQTT 5 §3.1.2.10), not bytes: a client
                # dribbling one byte a second of a packet it never finishes is not alive.
                self.last_rx = self._loop.time()
        except RemoteProtocolError as exc:
            # Act on the packets completed before the bad one (as a broker would have), then close.
            if self._blocked:
                self._held += exc.packets
            else:
                self._handle(exc.packets)
            self.counters["bytes_received"] += len(data)
            self.protocol_error(exc, str(exc))
            return
        if self._blocked:
            self.counters["bytes_received"] += len(data)
            if self._rate_timer is not None:
                packets = self._over_quota(packets)
            self._held += packets
            return
        published = self._handle(packets)
        self.counters["bytes_received"] += len(data)
        if published and self.ctx.inbound.throttled and not self.closed:
            # Only publishers are held back: a subscriber's PUBACKs are what frees delivery.
            self.ctx.inbound.throttle(self)

    def _handle(
        self, packets: list[Packet], _Publish: type[Publish] = Publish, _Puback: type = Puback
    ) -> bool:
        """Act on `packets` in order; True if one was a PUBLISH."""
        rate = self.rate
        kind = chunk_kind(packets)
        if kind is _Publish:
            if not self.closed and (rate is None or rate.take_all(packets, self._loop.time())):
                # A chunk of PUBLISHes only (fan-in): one call for all of them.
                handlers.handle_publishes(self, packets)  # type: ignore[arg-type]
                return True
        elif kind is _Puback:
            # A chunk of PUBACKs only (a QoS 1 subscriber): one call, one delivery mark.
            if not self.closed:
                handlers.handle_pubacks(self, packets)  # type: ignore[arg-type]
            return False
        on_publish = handlers.handle_publish
        dispatch = handlers.DISPATCH
        published = False
        for i, p in enumerate(packets):
            if self.closed:
                return published
            if type(p) is _Publish:
                if rate is not None and not rate.take(len(p.payload), self._loop.time()):
                    self._rate_block(packets[i:])
                    return published
                if on_publish(self, p):  # waits for the auth hook: it and the rest after it
                    self.hold(packets[i:])
                    return published
                published = True
            else:
                dispatch[type(p)](self, p)
                if self._blocked:  # a SUBSCRIBE waits for the core: the rest comes after it
                    self._held = packets[i + 1 :] + self._held
                    self.transport.pause_reading()
                    return published
        return published

    # -- max_publish_rate, max_publish_bytes_rate ----------------------------------------------
    def _rate_block(self, rest: list[Packet]) -> None:
        """Out of publish tokens: stop reading the socket (TCP pushes back on the client), keep
        the packets already read and handle them as tokens come back. What was read beyond one
        second's worth (`burst`) cannot wait honestly in memory: _over_quota answers it."""
        self._blocked = True
        self._held = self._over_quota(rest) + self._held
        if self.closed:
            return
        self.transport.pause_reading()
        self.counters["publish_rate_pauses"] += 1
        self._arm_rate_timer()

    def _arm_rate_timer(self) -> None:
        rate = self.rate
        assert rate is not None
        held = [p for p in self._held if type(p) is Publish]
        size = sum([len(p.payload) for p in held])  # type: ignore[attr-defined]
        wait = rate.wait_for(max(1, len(held)), size, self._loop.time())
        self._rate_timer = self._loop.call_later(wait, self._rate_refilled)

    def _rate_refilled(self) -> None:
        self._rate_timer = None
        self.last_rx = self._loop.time()  # we did not read: the client was not silent
        self.unblock()

    def _over_quota(self, packets: list[Packet]) -> list[Packet]:
        """Hold at most one second's worth of PUBLISH (messages and bytes); past that a v5
        QoS 1/2 gets PUBACK/PUBREC 0x97 Quota exceeded (not stored; the spec allows 0x96 in
        DISCONNECT only), a v5 QoS 0 ends the connection with DISCONNECT 0x96 Message rate too
        high (it has no ack to refuse, so this is how the client learns), a 3.1.1 QoS 0 is
        dropped and counted, and a 3.1.1 QoS 1/2 stays held (3.1.1 has no refusal but closing;
        memory stays bounded by the read that brought it, since reading is paused)."""
        rate = self.rate
        assert rate is not None
        held = [p for p in self._held if type(p) is Publish]
        n, size = len(held), sum([len(p.payload) for p in held])  # type: ignore[attr-defined]
        out: list[Packet] = []
        counters = self.counters
        too_fast = False
        for p in packets:
            if type(p) is not Publish:
                out.append(p)
            elif rate.holds(n + 1, size + len(p.payload)) or (p.qos and not self.v5):
                n, size = n + 1, size + len(p.payload)
                out.append(p)
            else:
                counters["publish_quota_exceeded"] += 1
                if p.qos:
                    self.send((Puback if p.qos == 1 else Pubrec)(p.packet_id, 0x97))
                elif self.v5:
                    too_fast = True
        if too_fast:
            counters["publish_rate_disconnects"] += 1
            self.disconnect_reason = "message rate too high (max_publish_rate)"
            self.close_with(0x96)
        return out

    def block(self) -> None:
        """Handle no further packet of this connection until `unblock` (see _handle)."""
        self._blocked = True

    def unblock(self) -> None:
        """The blocking operation finished: handle what arrived meanwhile, read again."""
        if not self._blocked:
            return
        self._blocked = False
        held, self._held = self._held, []
        if self.closed:
            return
        published = bool(held) and self._handle(held)
        if not self._blocked and not self.closed:
            self.resume_reading()
            if published and self.ctx.inbound.throttled:
                self.ctx.inbound.throttle(self)

    def resume_reading(self) -> None:
        """Read again, unless this connection is blocked (a SUBSCRIBE, the publish rate)."""
        if not self._blocked and not self.closed:
            self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.writable = False
        self.paused_since = self._loop.time()
        self.counters["write_pauses"] += 1

    def resume_writing(self) -> None:
        self.writable = True
        if self.session is not None and self.connected:
            self.ctx.delivery.mark_session(self.session)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ka_slot:
            self.ctx.keepalive.remove(self)
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._rate_timer is not None:
            self._rate_timer.cancel()
            self._rate_timer = None
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        self.closed = True
        self.writable = False
        if self.connected:
            self.connected = False
            reason = self.disconnect_reason or "connection lost"
            self.ctx.sessions.disconnected(self, reason)

    # -- keep alive ----------------------------------------------------------------------------
    def start_keepalive(self, seconds: int) -> None:
        self.keepalive = seconds
        if seconds:
            self.ctx.keepalive.add(self, self.last_rx + seconds * 1.5)
        else:
            self.ctx.keepalive.remove(self)

    def _keepalive_check(self) -> None:
        """Called by the KeepaliveWheel at (or just after) our deadline."""
        if self.closed:
            return
        now = self._loop.time()
        if self._blocked:  # we are not reading it (publish rate, SUBSCRIBE): not its silence
            self.last_rx = now
        if self.connected:
            deadline = self.last_rx + self.keepalive * 1.5
        else:  # CONNECT must be complete this long after accept, however slowly it trickles
            deadline = self.opened_at + self.ctx.settings.connect_timeout_s
        if now >= deadline:
            what = "keep alive timeout" if self.connected else "no CONNECT in time"
            self.disconnect_reason = what
            if not self.connected:  # never said a word of MQTT: a bad connection (scanner)
                self._bad(what)  # (a connected one: the conn log's `closed` line says why)
            self.close_with(0x8D, linger=False)  # MQTT 5 §3.1.2.10: v5 clients learn why
            return
        self.ctx.keepalive.add(self, deadline)

    # -- writing -------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if not self.closed:
            self.counters["bytes_sent"] += len(data)
            self.transport.write(data)

    def write_delivery(self, data: bytes, n: int, nbytes: int) -> None:
        """Delivery's write: `n` PUBLISH packets, `nbytes` long, already joined."""
        c = self.counters
        c["messages_sent"] += n
        c["bytes_sent"] += nbytes
        self.transport.write(data)

    def send(self, packet: Packet) -> None:
        """Encode through the codec (state table, limits) and write.

        Nothing once the client's DISCONNECT is parsed: the codec reads a whole chunk before the
        handlers act on it, so the answer to a packet that came in one chunk with the DISCONNECT
        (CONNACK, SUBACK, ...) would break the state table; the client has closed anyway
        [MQTT-3.14.4-1].
        """
        if self.closed or self.codec.state is State.DISCONNECTED:
            return
        try:
            data = self.codec.send(packet)
        except LocalProtocolError as exc:
            if exc.reason_code != PACKET_TOO_LARGE:
                raise
            # Over the client's Maximum Packet Size: not sent [MQTT-3.1.2-24]. A CONNACK sheds
            # its properties (the client takes the defaults); one that still does not fit ends
            # the connection, as nothing can follow without it.
            if type(packet) is Connack and packet.properties != EMPTY_PROPERTIES:
                self.send(Connack(packet.session_present, packet.reason_code))
            elif type(packet) is Connack:
                self.protocol_error(PACKET_TOO_LARGE, str(exc))
            return
        self.write(data)

    def send_connack(self, present: bool, reason: int, props: Properties) -> None:
        if self.version != 5 and reason and v3_connack_code(reason) is None:
            reason = 0x87  # v3 has no such code: "not authorized" is the closest refusal
        self.send(Connack(present, reason, props))

    def ack_durable(self, pid: int, ptype: int) -> None:
        """The store made a QoS 1/2 publish durable: PUBACK (4) or PUBREC (5) it now."""
        data = self.acks_bytes([pid], ptype)
        if data:
            self.write(data)

    def acks_bytes(self, pids: list[int], ptype: int) -> bytes:
        """The PUBACKs/PUBRECs for durable publishes, joined for one write (Inbound gathers a
        connection's acks of one fsync); b"" once closed."""
        session = self.session
        if ptype == 5 and session is not None:
            for pid in pids:
                session.qos2_pending.discard(pid)
        if self.closed or self.codec.state is State.DISCONNECTED:
            return b""
        if self.v5:
            send = self.codec.send
            if ptype == 4:
                return b"".join([send(Puback(pid)) for pid in pids])
            return b"".join([send(Pubrec(pid)) for pid in pids])
        return acks(ptype, pids)

    # -- closing -------------------------------------------------------------------------------
    def close_with(self, reason: int, send_disconnect: bool = True, linger: bool = True) -> None:
        """Close; a v5 client first gets a DISCONNECT with `reason` (codec.error_bytes).
        `linger`: half-close and drain first so that the answer is read (linger.py); not after
        the client's own DISCONNECT, nor for a client silent past its keep alive: neither has
        anything in flight to read."""
        if self.closed:
            return
        self.closed = True
        self.writable = False
        if send_disconnect and reason and self.connected:
            data = self.codec.error_bytes(reason)
            if data:
                self.transport.write(data)
        if linger:
            self._linger_close()
        else:
            self.transport.close()

    def _linger_close(self) -> None:
        """Close after the client has read our answer (linger.py); the session ends now, not
        when the socket does (up to LINGER_S later): its will, its takeover, its count."""
        self._linger = linger_close(self.transport, self._loop)
        if self.connected:
            self.connected = False
            self.ctx.sessions.disconnected(self, self.disconnect_reason or "closed")

    def protocol_error(self, err: RemoteProtocolError | int, detail: str) -> None:
        """Bad input: log once, CONNACK/DISCONNECT with the reason where the spec allows, close."""
        if self.closed:
            return
        code = err if isinstance(err, int) else err.reason_code
        self.counters["protocol_errors"] += 1
        self.disconnect_reason = f"protocol error 0x{code:02x}: {detail}"
        self._bad(self.disconnect_reason)
        data = self.codec.error_bytes(err)
        self.closed = True
        self.writable = False
        if data:
            self.transport.write(data)
        self._linger_close()

    def _bad(self, reason: str) -> None:
        listener = "websocket" if self.transport.get_extra_info("websocket") else "mqtt"
        self.ctx.bad_clients.bad(
            listener, self.remote, reason, client_id=self.client_id, conn=self.conn_id
        )

    def fail(self, reason: int, detail: str) -> None:
        """An internal failure affecting this connection (store down): close it, log once."""
        if self.closed:
            return
        self.disconnect_reason = detail
        log.error("client %r (%s): %s", self.client_id, self.remote, detail)
        self.close_with(reason)

    def slow_consumer(self, stuck_s: float) -> None:
        """Its socket stayed full past `slow_consumer_timeout_s`: drop it. `abort`, not `close`:
        close would wait for a buffer it never reads. The session keeps its acked position in
        the light queues; what was not acked is sent again when it reconnects."""
        if self.closed:
            return
        self.counters["slow_consumers_closed"] += 1
        self.disconnect_reason = f"slow consumer (socket full for {stuck_s:.0f} s)"
        log.info("client %r (%s): %s", self.client_id, self.remote, self.disconnect_reason)
        self.closed = True
        self.writable = False
        self.transport.abort()

    def shutdown(self) -> None:
        """Server going down: no will (v5 0x8B server shutting down)."""
        self.will_on_close = False
        self.disconnect_reason = "server shutdown"
        self.close_with(0x8B)

    def taken_over(self) -> None:
        """Another connection took this client id (v5 0x8E); the session stays."""
        self.disconnect_reason = "session taken over"
        self.counters["takeovers"] += 1
        self.close_with(0x8E)
        if self.connected:  # closed already (without linger) but not yet lost: detach now
            self.connected = False
            self.ctx.sessions.disconnected(self, "session taken over")

    def expire_at(self, delay_s: float) -> None:
        """Close this connection in `delay_s` seconds, when its credential (a JWT) expires."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = self._loop.call_later(max(0.0, delay_s), self._credential_expired)

    def _credential_expired(self) -> None:
        """MQTT 5 has no reason code named for an expired credential. 0xA0 Maximum connect time
        ("connected longer than the maximum allowed time", server only) is the spec's code for
        a connection ended by a time limit the server set, which `exp` is; 0x87 Not authorized
        answers a request the client made, and the client made none. A 3.1.1 client is just
        closed. The will is published, as for any close the client did not ask for."""
        self._expiry = None
        self.disconnect_reason = "token expired"
        self.ctx.counters["tokens_expired"] += 1
        self.close_with(ReasonCode.MAXIMUM_CONNECT_TIME)

    def hold(self, packets: Sequence[Packet]) -> None:
        """Blocked by a check still running (the auth hook): handle `packets` after it, first."""
        self._held = [*packets, *self._held]
        if not self.closed:
            self.transport.pause_reading()

    def refresh_acl(self) -> None:
        """Take the current rules of `security` for this user and client id (the rights of
        its token instead when the token carried some)."""
        if self.token_acl is not None or self.internal:
            self.acl = self.token_acl
            return
        security = self.ctx.access.security
        acl = security.acl
        self.acl = None if acl.allows_everything else acl.for_client(self.username, self.client_id)

    def accepted(self, session: Session, client_id: str, version: int, keepalive: int) -> None:
        """CONNECT accepted: bind the session, arm keep alive (before CONNACK is written)."""
        self.session = session
        self.client_id = client_id
        self.version = version
        self.v5 = version == 5
        self.connected = True
        self.session_overlap = session.overlapping
        self.start_keepalive(keepalive)
        s = self.ctx.settings
        if s.max_publish_rate > 0 or s.max_publish_bytes_rate > 0:
            now = self._loop.time()
            self.rate = PublishLimit(s.max_publish_rate, s.max_publish_bytes_rate, now)


if TYPE_CHECKING:

    def _is_a_peer(conn: MqttConnection) -> ClientPort:
        return conn  # mypy: a connection is what delivery and the sessions take it for
