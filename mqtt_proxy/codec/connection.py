"""Sans-IO MQTT connection: parser + encoder + the connection state machine, after h11.

Theory of operation
-------------------
One `Connection` per network connection, playing either role. `receive_data(bytes)` parses and
checks every packet the peer sent; `send(event)` checks and encodes one we send. Both run the same
table, `TRANSITIONS`, keyed by state and (sender role, event kind); a missing entry is illegal:
a RemoteProtocolError (0x82) when the peer sent it, a LocalProtocolError when we tried to.

    AWAIT_CONNECT --client CONNECT--> CONNECTING --server CONNACK 0x00--> CONNECTED
                                       |   ^  AUTH (v5, both ways)          |  PUBLISH, acks,
                                       |   |  early client packets          |  (UN)SUBSCRIBE,
                                       |                                    |  pings, AUTH
                                       +--CONNACK >= 0x80 / DISCONNECT--+   +--DISCONNECT--+
                                                                        v                  v
                                                                   DISCONNECTED (terminal)

Clients may send packets right after CONNECT without waiting for CONNACK (3.1.1 §3.1.4), so the
server receives them in CONNECTING; it must not act on them before it sends CONNACK. The protocol
version is fixed by the CONNECT (the parser decodes v5 properties from the next packet on).

Limits are read from the packets themselves, so there is no second source of truth: our CONNACK
(server) or CONNECT (client) sets what we accept (Topic Alias Maximum, Receive Maximum, Maximum
Packet Size, Maximum QoS, Retain Available); the peer's sets what we may send. Inbound v5 QoS 1/2
PUBLISHes count against our Receive Maximum until we send PUBACK / PUBCOMP (or a failing PUBREC); one more is 0x93. Inbound
topic aliases are resolved so received PUBLISH events always carry the full topic.

On any ProtocolError, `error_bytes(err)` gives the last bytes to write before closing: a CONNACK
(before CONNACK was sent, server side), a v5 DISCONNECT with the reason code, or b"" (v3: close).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from .encoder import _ENCODERS, encode
from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from .packets import Connack, Disconnect, Packet, Puback, Publish, chunk_kind
from .parser import DEFAULT_MAX_PACKET_SIZE, Parser
from .reason_codes import ALLOWED, v3_connack_code

__all__ = ["Connection", "Role", "State", "CLIENT", "SERVER", "TRANSITIONS"]


class Role(Enum):
    CLIENT = "client"
    SERVER = "server"


class State(Enum):
    AWAIT_CONNECT = "AWAIT_CONNECT"
    CONNECTING = "CONNECTING"
    CONNECTED = "CONNECTED"
    DISCONNECTED = "DISCONNECTED"


CLIENT, SERVER = Role.CLIENT, Role.SERVER
AWAIT_CONNECT, CONNECTING = State.AWAIT_CONNECT, State.CONNECTING
CONNECTED, DISCONNECTED = State.CONNECTED, State.DISCONNECTED

_BOTH = ("PUBLISH", "PUBACK", "PUBREC", "PUBREL", "PUBCOMP", "AUTH")
_CLIENT_ONLY = ("SUBSCRIBE", "UNSUBSCRIBE", "PINGREQ")
_SERVER_ONLY = ("SUBACK", "UNSUBACK", "PINGRESP")

# state -> {(sender, event kind): next state}. Event kind is the packet name, except that a
# failing CONNACK is "CONNACK_REFUSED".
TRANSITIONS: dict[State, dict[tuple[Role, str], State]] = {
    AWAIT_CONNECT: {(CLIENT, "CONNECT"): CONNECTING},
    CONNECTING: {
        (CLIENT, "AUTH"): CONNECTING,
        (SERVER, "AUTH"): CONNECTING,
        (SERVER, "CONNACK"): CONNECTED,
        (SERVER, "CONNACK_REFUSED"): DISCONNECTED,
        (CLIENT, "DISCONNECT"): DISCONNECTED,
        **{(CLIENT, k): CONNECTING for k in _BOTH[:5] + _CLIENT_ONLY},
    },
    CONNECTED: {
        **{(CLIENT, k): CONNECTED for k in _BOTH + _CLIENT_ONLY},
        **{(SERVER, k): CONNECTED for k in _BOTH + _SERVER_ONLY},
        (CLIENT, "DISCONNECT"): DISCONNECTED,
        (SERVER, "DISCONNECT"): DISCONNECTED,  # v5 only, checked in _step
    },
    DISCONNECTED: {},
}

_KIND = {cls: cls.__name__.upper() for cls in _ENCODERS}


def _kind(packet: Any) -> str:
    kind = _KIND.get(type(packet))
    if kind is None:
        raise LocalProtocolError(f"not a packet event: {packet!r}")
    if kind == "CONNACK" and packet.reason_code >= 0x80:
        return "CONNACK_REFUSED"
    return kind


class Connection:
    """The protocol state of one MQTT connection, for `our_role` (SERVER by default)."""

    __slots__ = (
        "our_role",
        "their_role",
        "state",
        "parser",
        "connack_sent",
        "topic_alias_maximum",
        "receive_maximum",
        "peer_topic_alias_maximum",
        "peer_receive_maximum",
        "peer_max_packet_size",
        "maximum_qos",
        "retain_available",
        "_zero_session_expiry",
        "_in_aliases",
        "_out_aliases",
        "_in_flight",
        "_out_flight",
    )

    def __init__(
        self,
        our_role: Role = SERVER,
        *,
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        strict_utf8: bool = True,
    ) -> None:
        self.our_role = our_role
        self.their_role = CLIENT if our_role is SERVER else SERVER
        self.state = AWAIT_CONNECT
        self.parser = Parser(max_packet_size=max_packet_size, strict_utf8=strict_utf8)
        self.connack_sent = False
        self.topic_alias_maximum = 0  # what we accept (set by the CONNACK/CONNECT we send)
        self.receive_maximum = 65535
        self.peer_topic_alias_maximum = 0  # what the peer accepts
        self.peer_receive_maximum = 65535
        self.peer_max_packet_size: int | None = None
        self.maximum_qos = 2  # v5 limits we announced in CONNACK (server role)
        self.retain_available = True
        self._zero_session_expiry = False  # CONNECT said 0: DISCONNECT may not raise it
        self._in_aliases: dict[int, str] = {}
        self._out_aliases: dict[str, int] = {}
        self._in_flight: set[int] = set()  # inbound QoS>0 packet ids not completed yet
        self._out_flight: set[int] = set()  # outbound QoS>0 packet ids not completed yet

    @property
    def version(self) -> int | None:
        """3, 4 or 5 once the CONNECT was seen (received or sent), else None."""
        return self.parser.version

    # ---------------------------------------------------------------------------------------
    # Receiving

    def receive_data(self, data: bytes) -> list[Packet]:
        """Parse `data` and run every packet through the state machine.

        Raises RemoteProtocolError; `err.packets` holds the packets accepted before the bad one.
        """
        if self.state is not CONNECTED:
            if self.state is DISCONNECTED:
                raise RemoteProtocolError("data after the connection ended", 0x82, self.version)
            if (
                self.state is AWAIT_CONNECT
                and data
                and data[0] != 0x10
                and self.our_role is SERVER
                and not self.parser.buffered
            ):
                # The first packet must be CONNECT [MQTT-3.1.0-1]: say so at its first byte
                # rather than wait for a "length" that HTTP or TLS garbage happens to spell.
                raise RemoteProtocolError(f"not MQTT: first bytes {bytes(data[:16])!r}", 0x82)
        try:
            packets = self.parser.feed(data)
        except RemoteProtocolError as e:
            good = self._receive_all(e.packets)  # may itself raise for an earlier packet
            e.packets = good
            raise
        return self._receive_all(packets)

    def _receive_all(
        self, packets: list[Any], _Publish: Any = Publish, _Puback: Any = Puback
    ) -> list[Packet]:
        v5 = self.version == 5
        if not v5 and self.state is CONNECTED:
            # A v3 chunk of PUBLISHes only (fan-in) needs no state or bookkeeping: as it is; so
            # does one of PUBACKs only (a QoS 1 reader) while nothing sent here is in flight
            # (the proxy writes 3.1.1 deliveries without `send`).
            kind = chunk_kind(packets)
            if kind is _Publish or (kind is _Puback and not self._out_flight):
                return packets
        out: list[Packet] = []
        append = out.append
        n = len(packets)
        try:
            for i, p in enumerate(packets):
                # Fast path: a PUBLISH where PUBLISH is legal leaves the state as it is and,
                # before v5, needs no bookkeeping. Measured on 64-byte QoS 0 PUBLISHes in
                # 64 KiB chunks: 0.56 M/s through the table, 1.14 M/s with this (v5: 0.91 M/s).
                if type(p) is _Publish and (
                    self.state is CONNECTED
                    or (self.state is CONNECTING and self.their_role is CLIENT)
                ):
                    append(self._receive_publish(p) if v5 else p)
                    continue
                if type(p) is _Puback and self.state is CONNECTED:
                    # PUBACK is legal in CONNECTED from either side and keeps the state: what
                    # `_receive` does for it, without the table (a QoS 1 subscriber's acks).
                    self._out_flight.discard(p[0])
                    append(p)
                    continue
                append(self._receive(p))
                if self.state is DISCONNECTED and i + 1 < n:
                    raise RemoteProtocolError("packets after DISCONNECT", 0x82, self.version)
        except RemoteProtocolError as e:
            e.packets = out
            if e.protocol_level is None:
                e.protocol_level = self.version
            raise
        return out

    def _receive(self, p: Any) -> Packet:
        self.state = self._next(self.their_role, p, RemoteProtocolError)
        if type(p) is Publish:
            return self._receive_publish(p)
        kind = _kind(p)
        if kind in ("PUBACK", "PUBCOMP") or (kind == "PUBREC" and p.reason_code >= 0x80):
            self._out_flight.discard(p.packet_id)
        elif kind in ("CONNECT", "CONNACK", "CONNACK_REFUSED"):
            self._peer_limits(p.properties)
            if kind == "CONNECT":
                self._zero_session_expiry = not p.properties.session_expiry_interval
        elif (
            kind == "DISCONNECT"
            and self._zero_session_expiry
            and self.our_role is SERVER
            and p.properties.session_expiry_interval
        ):
            raise RemoteProtocolError(
                "DISCONNECT sets a session expiry after CONNECT had 0 [MQTT-3.14.2-2]", 0x82
            )
        return p

    def _receive_publish(self, p: Publish) -> Publish:
        if self.version == 5:
            if p.qos > self.maximum_qos:
                raise RemoteProtocolError(f"QoS {p.qos} > maximum QoS {self.maximum_qos}", 0x9B)
            if p.retain and not self.retain_available:
                raise RemoteProtocolError("retain not available", 0x9A)
            alias = p.properties.topic_alias
            if alias is not None:
                if alias > self.topic_alias_maximum:
                    raise RemoteProtocolError(
                        f"topic alias {alias} > maximum {self.topic_alias_maximum}", 0x94
                    )
                if p.topic:
                    self._in_aliases[alias] = p.topic
                else:
                    topic = self._in_aliases.get(alias)
                    if topic is None:
                        raise RemoteProtocolError(f"unknown topic alias {alias}", 0x82)
                    p = p._replace(topic=topic)
            if p.qos:
                flight = self._in_flight
                if p.packet_id not in flight:
                    if len(flight) >= self.receive_maximum:
                        raise RemoteProtocolError(
                            f"more than {self.receive_maximum} QoS>0 PUBLISH in flight", 0x93
                        )
                    flight.add(p.packet_id)
        return p

    def _peer_limits(self, props: Any) -> None:
        if props.topic_alias_maximum is not None:
            self.peer_topic_alias_maximum = props.topic_alias_maximum
        if props.receive_maximum is not None:
            self.peer_receive_maximum = props.receive_maximum
        if props.maximum_packet_size is not None:
            self.peer_max_packet_size = props.maximum_packet_size

    # ---------------------------------------------------------------------------------------
    # Sending

    def send(self, packet: Any) -> bytes:
        """Check `packet` against the state machine and our limits, and encode it."""
        kind = _kind(packet)
        if kind == "CONNECT" and self.parser.version is None:
            self.parser.version = packet.protocol_level
        version = self.version
        if version is None:
            raise LocalProtocolError(f"cannot send {kind} before CONNECT")
        nxt = self._next(self.our_role, packet, LocalProtocolError)
        data = encode(packet, version)
        if self.peer_max_packet_size is not None and len(data) > self.peer_max_packet_size:
            raise LocalProtocolError(
                f"{kind} of {len(data)} bytes > peer maximum {self.peer_max_packet_size}", 0x95
            )
        self.state = nxt
        if kind == "PUBLISH":
            self._sent_publish(packet)
        elif kind in ("PUBACK", "PUBCOMP") or (kind == "PUBREC" and packet.reason_code >= 0x80):
            self._in_flight.discard(packet.packet_id)
        elif kind in ("CONNACK", "CONNACK_REFUSED", "CONNECT"):
            self.connack_sent = self.connack_sent or kind != "CONNECT"
            props = packet.properties
            if props.topic_alias_maximum is not None:
                self.topic_alias_maximum = props.topic_alias_maximum
            if props.receive_maximum is not None:
                self.receive_maximum = props.receive_maximum
            if props.maximum_packet_size is not None:
                self.parser.max_packet_size = props.maximum_packet_size
            if props.maximum_qos is not None:
                self.maximum_qos = props.maximum_qos
            if props.retain_available is not None:
                self.retain_available = bool(props.retain_available)
        return data

    def _sent_publish(self, p: Publish) -> None:
        alias = p.properties.topic_alias
        if alias is not None and alias > self.peer_topic_alias_maximum:
            raise LocalProtocolError(f"topic alias {alias} > peer maximum")
        if p.qos:
            self.publish_sent(p.packet_id, p.dup)

    def publish_sent(self, packet_id: int, dup: bool = False) -> None:
        """Account a QoS 1/2 PUBLISH written without `send` (a shared PublishTemplate)."""
        flight = self._out_flight
        if packet_id in flight:
            if not dup:
                raise LocalProtocolError(f"packet id {packet_id} already in flight", 0x91)
            return
        if self.version == 5 and len(flight) >= self.peer_receive_maximum:
            raise LocalProtocolError(f"peer receive maximum {self.peer_receive_maximum} reached")
        flight.add(packet_id)

    @property
    def send_quota(self) -> int:
        """How many more QoS 1/2 PUBLISHes the peer accepts now (v5 Receive Maximum)."""
        return self.peer_receive_maximum - len(self._out_flight)

    def outbound_topic_alias(self, topic: str) -> tuple[int | None, bool]:
        """(alias, first use) for a PUBLISH to the peer: on first use send topic + alias, then
        an empty topic + alias. (None, True) when aliases are off or all are taken."""
        alias = self._out_aliases.get(topic)
        if alias is not None:
            return alias, False
        if len(self._out_aliases) >= self.peer_topic_alias_maximum:
            return None, True
        alias = len(self._out_aliases) + 1
        self._out_aliases[topic] = alias
        return alias, True

    # ---------------------------------------------------------------------------------------

    def _next(self, role: Role, packet: Packet, err: type[ProtocolError]) -> State:
        """The state after `role` sends `packet`, or `err` naming the state and the event."""
        kind = _kind(packet)
        nxt = TRANSITIONS[self.state].get((role, kind))
        if nxt is None or (kind == "DISCONNECT" and role is SERVER and self.version != 5):
            raise err(
                f"{role.value} may not send {kind} in state {self.state.value}",
                0x82,
                self.version,
            )
        return nxt

    def error_bytes(self, err: ProtocolError | int) -> bytes:
        """The last bytes to send before closing for `err` (or a bare v5 reason code).

        Server before CONNACK: CONNACK with the reason (v3: its return code, or b"" when v3 has
        none). Otherwise v5: DISCONNECT with the reason; v3: b"" (just close). The state becomes
        DISCONNECTED.
        """
        code = err if isinstance(err, int) else err.reason_code
        level = self.version
        if level is None and not isinstance(err, int):
            level = err.protocol_level
        self.state = DISCONNECTED
        if self.our_role is SERVER and not self.connack_sent:
            self.connack_sent = True
            if level == 5:
                if code not in ALLOWED[2]:
                    code = 0x80
                return encode(Connack(reason_code=code), 5)
            v3 = v3_connack_code(code)
            return b"" if v3 is None else bytes((0x20, 2, 0, v3))
        if level == 5:
            if code not in ALLOWED[14]:
                code = 0x82 if code < 0x80 else 0x80
            return encode(Disconnect(code), 5)
        return b""
