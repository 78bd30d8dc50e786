"""MQTT 5 properties (§2.2.2): every property, its type, where it may appear, and its codec.

A `Properties` value is one immutable named tuple holding every property (None when absent), so
`props.topic_alias` is a C-level field read and an empty set is the shared `EMPTY_PROPERTIES`.
The two repeatable properties are tuples: `user_properties` (pairs, order kept, §3.1.2.11.8) and
`subscription_identifiers` (several in a PUBLISH, at most one in a SUBSCRIBE).

Rules enforced on decode (`decode_properties`):
* unknown identifier, or one not allowed in this packet -> Malformed Packet 0x81 (§2.2.2.2);
* a property other than User Property / PUBLISH Subscription Identifier twice -> 0x82;
* out-of-range values (Receive Maximum 0, Topic Alias 0, byte flags not 0/1, ...) -> 0x82;
* strings follow the code point policy of `_wire.check_str`.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, NamedTuple

from ._wire import (
    decode_varint,
    enc_bin,
    enc_str,
    encode_varint,
    pack_u16,
    pack_u32,
    read_bin,
    read_str,
)
from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "Properties",
    "PropertyId",
    "PropertySpec",
    "PROPERTY_SPECS",
    "EMPTY_PROPERTIES",
    "WILL",
    "decode_properties",
    "encode_properties",
]

# Packet type numbers; WILL is the pseudo packet for CONNECT's Will Properties.
CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, DISCONNECT, AUTH = 8, 9, 10, 11, 14, 15
WILL = 16


class PropertyId(IntEnum):
    PAYLOAD_FORMAT_INDICATOR = 0x01
    MESSAGE_EXPIRY_INTERVAL = 0x02
    CONTENT_TYPE = 0x03
    RESPONSE_TOPIC = 0x08
    CORRELATION_DATA = 0x09
    SUBSCRIPTION_IDENTIFIER = 0x0B
    SESSION_EXPIRY_INTERVAL = 0x11
    ASSIGNED_CLIENT_IDENTIFIER = 0x12
    SERVER_KEEP_ALIVE = 0x13
    AUTHENTICATION_METHOD = 0x15
    AUTHENTICATION_DATA = 0x16
    REQUEST_PROBLEM_INFORMATION = 0x17
    WILL_DELAY_INTERVAL = 0x18
    REQUEST_RESPONSE_INFORMATION = 0x19
    RESPONSE_INFORMATION = 0x1A
    SERVER_REFERENCE = 0x1C
    REASON_STRING = 0x1F
    RECEIVE_MAXIMUM = 0x21
    TOPIC_ALIAS_MAXIMUM = 0x22
    TOPIC_ALIAS = 0x23
    MAXIMUM_QOS = 0x24
    RETAIN_AVAILABLE = 0x25
    USER_PROPERTY = 0x26
    MAXIMUM_PACKET_SIZE = 0x27
    WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
    SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
    SHARED_SUBSCRIPTION_AVAILABLE = 0x2A


class Properties(NamedTuple):
    """All MQTT 5 properties of one packet; field order is property-id order."""

    payload_format_indicator: int | None = None  # 0x01 byte 0/1
    message_expiry_interval: int | None = None  # 0x02 u32 seconds
    content_type: str | None = None  # 0x03
    response_topic: str | None = None  # 0x08
    correlation_data: bytes | None = None  # 0x09
    subscription_identifiers: tuple[int, ...] = ()  # 0x0B varint 1..268435455
    session_expiry_interval: int | None = None  # 0x11 u32
    assigned_client_identifier: str | None = None  # 0x12
    server_keep_alive: int | None = None  # 0x13 u16
    authentication_method: str | None = None  # 0x15
    authentication_data: bytes | None = None  # 0x16
    request_problem_information: int | None = None  # 0x17 byte 0/1
    will_delay_interval: int | None = None  # 0x18 u32
    request_response_information: int | None = None  # 0x19 byte 0/1
    response_information: str | None = None  # 0x1A
    server_reference: str | None = None  # 0x1C
    reason_string: str | None = None  # 0x1F
    receive_maximum: int | None = None  # 0x21 u16 1..65535
    topic_alias_maximum: int | None = None  # 0x22 u16
    topic_alias: int | None = None  # 0x23 u16 1..65535
    maximum_qos: int | None = None  # 0x24 byte 0/1
    retain_available: int | None = None  # 0x25 byte 0/1
    user_properties: tuple[tuple[str, str], ...] = ()  # 0x26 string pairs
    maximum_packet_size: int | None = None  # 0x27 u32 1..
    wildcard_subscription_available: int | None = None  # 0x28 byte 0/1
    subscription_identifier_available: int | None = None  # 0x29 byte 0/1
    shared_subscription_available: int | None = None  # 0x2A byte 0/1

    def __bool__(self) -> bool:
        """True when any property is present (a tuple of 27 Nones would otherwise be truthy)."""
        return self != EMPTY_PROPERTIES

    def __repr__(self) -> str:
        """Only the properties that are present: `Properties(topic_alias=3)`."""
        d = EMPTY_PROPERTIES
        items = [f"{k}={v!r}" for k, v, e in zip(self._fields, self, d, strict=True) if v != e]
        return f"Properties({', '.join(items)})"


EMPTY_PROPERTIES = Properties()

# Types
BYTE, U16, U32, VARINT, STR, BIN, PAIR = "byte", "u16", "u32", "varint", "str", "bin", "pair"

_ALL_ACKS = frozenset(
    (CONNACK, PUBACK, PUBREC, PUBREL, PUBCOMP, SUBACK, UNSUBACK, DISCONNECT, AUTH)
)
_EVERY = frozenset((CONNECT, PUBLISH, SUBSCRIBE, UNSUBSCRIBE, WILL)) | _ALL_ACKS
_MSG = frozenset((PUBLISH, WILL))


class PropertySpec(NamedTuple):
    id: int
    name: str  # Properties field name
    type: str
    packets: frozenset[int]
    min: int = 0  # smallest legal value for integer types (0x82 below it)
    max: int | None = None  # largest legal value for BYTE flags (0x82 above it)


PROPERTY_SPECS: dict[int, PropertySpec] = {
    s.id: s
    for s in (
        PropertySpec(0x01, "payload_format_indicator", BYTE, _MSG, max=1),
        PropertySpec(0x02, "message_expiry_interval", U32, _MSG),
        PropertySpec(0x03, "content_type", STR, _MSG),
        PropertySpec(0x08, "response_topic", STR, _MSG),
        PropertySpec(0x09, "correlation_data", BIN, _MSG),
        PropertySpec(0x0B, "subscription_identifiers", VARINT, frozenset((PUBLISH, SUBSCRIBE)), 1),
        PropertySpec(
            0x11, "session_expiry_interval", U32, frozenset((CONNECT, CONNACK, DISCONNECT))
        ),
        PropertySpec(0x12, "assigned_client_identifier", STR, frozenset((CONNACK,))),
        PropertySpec(0x13, "server_keep_alive", U16, frozenset((CONNACK,))),
        PropertySpec(0x15, "authentication_method", STR, frozenset((CONNECT, CONNACK, AUTH))),
        PropertySpec(0x16, "authentication_data", BIN, frozenset((CONNECT, CONNACK, AUTH))),
        PropertySpec(0x17, "request_problem_information", BYTE, frozenset((CONNECT,)), max=1),
        PropertySpec(0x18, "will_delay_interval", U32, frozenset((WILL,))),
        PropertySpec(0x19, "request_response_information", BYTE, frozenset((CONNECT,)), max=1),
        PropertySpec(0x1A, "response_information", STR, frozenset((CONNACK,))),
        PropertySpec(0x1C, "server_reference", STR, frozenset((CONNACK, DISCONNECT))),
        PropertySpec(0x1F, "reason_string", STR, _ALL_ACKS),
        PropertySpec(0x21, "receive_maximum", U16, frozenset((CONNECT, CONNACK)), 1),
        PropertySpec(0x22, "topic_alias_maximum", U16, frozenset((CONNECT, CONNACK))),
        PropertySpec(0x23, "topic_alias", U16, frozenset((PUBLISH,)), 1),
        PropertySpec(0x24, "maximum_qos", BYTE, frozenset((CONNACK,)), max=1),
        PropertySpec(0x25, "retain_available", BYTE, frozenset((CONNACK,)), max=1),
        PropertySpec(0x26, "user_properties", PAIR, _EVERY),
        PropertySpec(0x27, "maximum_packet_size", U32, frozenset((CONNECT, CONNACK)), 1),
        PropertySpec(0x28, "wildcard_subscription_available", BYTE, frozenset((CONNACK,)), max=1),
        PropertySpec(0x29, "subscription_identifier_available", BYTE, frozenset((CONNACK,)), max=1),
        PropertySpec(0x2A, "shared_subscription_available", BYTE, frozenset((CONNACK,)), max=1),
    )
}
_FIELD_INDEX = {pid: Properties._fields.index(s.name) for pid, s in PROPERTY_SPECS.items()}
_SPEC_BY_NAME = {s.name: s for s in PROPERTY_SPECS.values()}
_UP = 0x26
_SUBID = 0x0B
_N_FIELDS = len(Properties._fields)
_tnew = tuple.__new__


def decode_properties(
    buf: bytes, pos: int, end: int, packet_type: int, strict: bool = True
) -> tuple[Properties, int]:
    """Decode a property block (varint length + properties) at `pos` -> (Properties, next pos).

    `packet_type` is the fixed-header type (or `WILL`); `end` bounds the enclosing packet.
    """
    length, pos = decode_varint(buf, pos, end)
    if not length:  # the common case: no properties at all
        return EMPTY_PROPERTIES, pos
    stop = pos + length
    if stop > end:
        raise RemoteProtocolError("property length runs past the end of the packet")
    values: list[Any] = [None] * _N_FIELDS
    values[5] = ()  # subscription_identifiers
    values[22] = ()  # user_properties
    seen: set[int] = set()
    user: list[tuple[str, str]] = []
    subids: list[int] = []
    while pos < stop:
        pid, pos = decode_varint(buf, pos, stop)
        spec = PROPERTY_SPECS.get(pid)
        if spec is None:
            raise RemoteProtocolError(f"unknown property identifier 0x{pid:02X}")
        if packet_type not in spec.packets:
            raise RemoteProtocolError(f"property {spec.name} not allowed in packet {packet_type}")
        t = spec.type
        value: Any
        if t == BYTE:
            if pos >= stop:
                raise RemoteProtocolError(f"property {spec.name} truncated")
            value = buf[pos]
            pos += 1
        elif t in (U16, U32):
            n = 2 if t == U16 else 4
            if pos + n > stop:
                raise RemoteProtocolError(f"property {spec.name} truncated")
            value = int.from_bytes(buf[pos : pos + n], "big")
            pos += n
        elif t == VARINT:
            value, pos = decode_varint(buf, pos, stop)
        elif t == STR:
            value, pos = read_str(buf, pos, stop, strict)
        elif t == BIN:
            value, pos = read_bin(buf, pos, stop)
        else:  # PAIR
            k, pos = read_str(buf, pos, stop, strict)
            v, pos = read_str(buf, pos, stop, strict)
            user.append((k, v))
            continue
        if (
            t != STR
            and t != BIN
            and (value < spec.min or (spec.max is not None and value > spec.max))
        ):
            # Topic Alias 0 is "Topic Alias invalid" (0x94), as above the maximum (Mosquitto too).
            code = 0x94 if pid == 0x23 else 0x82
            raise RemoteProtocolError(f"property {spec.name} = {value} is invalid", code)
        if pid == _SUBID:
            if subids and packet_type != PUBLISH:
                raise RemoteProtocolError("subscription identifier more than once", 0x82)
            subids.append(value)
            continue
        if pid in seen:
            raise RemoteProtocolError(f"property {spec.name} more than once", 0x82)
        seen.add(pid)
        values[_FIELD_INDEX[pid]] = value
    if pos != stop:
        raise RemoteProtocolError("property runs past the property length")
    if user:
        values[22] = tuple(user)
    if subids:
        values[5] = tuple(subids)
    return _tnew(Properties, values), pos


def encode_properties(props: Properties | None, packet_type: int | None = None) -> bytes:
    """Encode a property block including its varint length (b"\\x00" when empty).

    With `packet_type`, a property not allowed in that packet raises LocalProtocolError.
    """
    if not props or props == EMPTY_PROPERTIES:
        return b"\x00"
    out: list[bytes] = []
    for pid, spec in PROPERTY_SPECS.items():
        value: Any = props[_FIELD_INDEX[pid]]
        if value is None or value == ():
            continue
        if packet_type is not None and packet_type not in spec.packets:
            raise LocalProtocolError(f"property {spec.name} not allowed in packet {packet_type}")
        head = bytes((pid,))
        t = spec.type
        try:
            if t == PAIR:
                for k, v in value:
                    out.append(head + enc_str(k) + enc_str(v))
            elif t == VARINT:
                if packet_type == SUBSCRIBE and len(value) > 1:
                    raise LocalProtocolError("SUBSCRIBE takes at most one subscription identifier")
                for v in value:
                    if v < 1:
                        raise LocalProtocolError(f"subscription identifier {v} < 1")
                    out.append(head + encode_varint(v))
            elif t == STR:
                out.append(head + enc_str(value))
            elif t == BIN:
                out.append(head + enc_bin(value))
            else:
                if value < spec.min or (spec.max is not None and value > spec.max):
                    raise LocalProtocolError(f"property {spec.name} = {value} is invalid")
                if t == BYTE:
                    if value > 255:
                        raise LocalProtocolError(f"property {spec.name} = {value} > 255")
                    out.append(head + bytes((value,)))
                elif t == U16:
                    out.append(head + pack_u16(value))
                else:
                    out.append(head + pack_u32(value))
        except (OverflowError, TypeError, ValueError, AttributeError) as e:
            raise LocalProtocolError(f"property {spec.name} = {value!r}: {e}") from None
        except Exception as e:  # struct.error
            if isinstance(e, LocalProtocolError):
                raise
            raise LocalProtocolError(f"property {spec.name} = {value!r}: {e}") from None
    body = b"".join(out)
    return encode_varint(len(body)) + body


def make_properties(**kwargs: Any) -> Properties:
    """Validated construction: `make_properties(topic_alias=3, user_properties=[("a", "b")])`.

    Lists are turned into tuples; a value that could not be encoded raises LocalProtocolError.
    """
    for name, value in list(kwargs.items()):
        if name not in _SPEC_BY_NAME:
            raise LocalProtocolError(f"unknown property {name!r}")
        if isinstance(value, list):
            kwargs[name] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    props = Properties(**kwargs)
    encode_properties(props)  # validates every value
    return props
