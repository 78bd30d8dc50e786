"""One MQTT connection: a slotted asyncio.Protocol around the sans-IO codec `Connection`; its
reading side (this module: packets in, publish rate, keep alive) over its writing and closing
side (endpoint.py).

`data_received` feeds the whole chunk to the codec and handles the list of packets it returns
(one call per chunk, no await per packet); the codec checks the state table, resolves inbound
topic aliases and enforces our v5 Receive Maximum. Writes go straight to the transport;
`pause_writing` marks the connection
unwritable so delivery skips it, and `resume_writing` asks delivery to pump its queues again
(no drain per write). Keep alive uses one lazily rescheduled timer: `data_received` only stores the
time, and the timer, when it fires, re-arms itself for the real deadline
(no cancel and re-arm per packet).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING

from mqtt_proxy.codec import (
    PROTOCOL_MAX_PACKET_SIZE,
    SERVER,
    Connection,
    Packet,
    Puback,
    Publish,
    Pubrec,
    RemoteProtocolError,
    chunk_kind,
)
from mqtt_proxy.connection import handlers
from mqtt_proxy.connection.endpoint import Endpoint
from mqtt_proxy.connection.limits import PublishLimit
from mqtt_proxy.connection.linger import LINGER_BYTES
from mqtt_proxy.delivery.topic_aliases import OutAliases

if TYPE_CHECKING:
    from mqtt_proxy.context import ProxyContext
    from mqtt_proxy.ports import ClientPort
    from mqtt_proxy.sessions.state import Session
    from store.auth import ClientAcl


class MqttConnection(Endpoint):
    __slots__ = (
        "keepalive",
        "last_rx",
        "ka_slot",
        "out_window",
        "max_out_packet",
        "session_overlap",
        "username",
        "_blocked",
        "_held",
        "paused_since",
        "acl",
        "token_acl",
        "rate",
        "_rate_timer",
        "opened_at",
        "over_conn_rate",
        "out_aliases",
        "_drained",
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

    def _detach(self, reason: str) -> None:
        self.ctx.sessions.disconnected(self, reason)

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
