"""The outward side of an MQTT connection: writing (through the codec, or bytes delivery and
the acks built ahead) and every way a connection ends (with a reason code, lingering so that
the client reads it, abruptly for a slow consumer, on takeover, when its token expires).

Bypassing `codec.send` on two hot paths, on purpose: shared PUBLISH templates are written as
bytes (encode once, write many; our own window limits them, see delivery.py), and 3.1.1
PUBACK/PUBREC are four fixed bytes (the codec tracks inbound flight only for v5, so for v5 the
acks do go through `codec.send`).

`MqttConnection` (connection.py) is this plus the reading side: it holds the state both use
(the slots below) and what ends a session on close (`_detach`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from mqtt_proxy.codec import (
    EMPTY_PROPERTIES,
    Connack,
    Connection,
    LocalProtocolError,
    Packet,
    Puback,
    Pubrec,
    RemoteProtocolError,
    State,
)
from mqtt_proxy.codec.reason_codes import ReasonCode, v3_connack_code
from mqtt_proxy.connection.linger import linger_close
from mqtt_proxy.delivery.outbound import acks

if TYPE_CHECKING:
    from mqtt_proxy.codec import Properties
    from mqtt_proxy.context import ProxyContext
    from mqtt_proxy.sessions.state import Session

log = logging.getLogger("lightgate.mqtt.conn")
PACKET_TOO_LARGE = 0x95


class Endpoint(asyncio.Protocol):
    """Writes and closes; its state is set by `MqttConnection.__init__`."""

    __slots__ = (
        "ctx", "transport", "codec", "session", "client_id", "v5", "version", "writable",
        "closed", "connected", "will_on_close", "remote", "disconnect_reason", "_loop",
        "_expiry", "conn_id", "_linger", "counters",
    )  # fmt: skip

    ctx: ProxyContext
    transport: asyncio.Transport
    codec: Connection
    session: Session | None
    client_id: str
    v5: bool
    version: int
    writable: bool
    closed: bool
    connected: bool
    will_on_close: bool
    remote: str
    disconnect_reason: str
    _loop: asyncio.AbstractEventLoop
    _expiry: asyncio.TimerHandle | None
    conn_id: str
    _linger: asyncio.TimerHandle | None
    counters: dict[str, int]

    def _detach(self, reason: str) -> None:
        """The session registry forgets this connection (`MqttConnection`)."""
        raise NotImplementedError

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
            self._detach(self.disconnect_reason or "closed")

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
            self._detach("session taken over")

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
