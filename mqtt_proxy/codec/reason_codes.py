"""MQTT 5 reason codes (§2.4), which packets may carry each, and the v3 CONNACK return codes.

Reason codes are plain ints on the wire and in events (an IntEnum member compares equal to its
int, so `ReasonCode.NOT_AUTHORIZED == 0x87`). `ALLOWED` says which packet types may carry which
code, so `Connection.error_bytes` can pick a legal one; `v3_connack_code` maps a v5 CONNACK reason
to the 3.1/3.1.1 return code (§3.2.2.3 of 3.1.1), or None where v3 has no code and the server
just closes.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = [
    "ReasonCode",
    "ConnackReturnCode",
    "ALLOWED",
    "is_error",
    "v3_connack_code",
    "v5_from_v3_connack",
    "reason_name",
]


class ReasonCode(IntEnum):
    SUCCESS = 0x00
    NORMAL_DISCONNECTION = 0x00
    GRANTED_QOS_0 = 0x00
    GRANTED_QOS_1 = 0x01
    GRANTED_QOS_2 = 0x02
    DISCONNECT_WITH_WILL_MESSAGE = 0x04
    NO_MATCHING_SUBSCRIBERS = 0x10
    NO_SUBSCRIPTION_EXISTED = 0x11
    CONTINUE_AUTHENTICATION = 0x18
    RE_AUTHENTICATE = 0x19
    UNSPECIFIED_ERROR = 0x80
    MALFORMED_PACKET = 0x81
    PROTOCOL_ERROR = 0x82
    IMPLEMENTATION_SPECIFIC_ERROR = 0x83
    UNSUPPORTED_PROTOCOL_VERSION = 0x84
    CLIENT_IDENTIFIER_NOT_VALID = 0x85
    BAD_USER_NAME_OR_PASSWORD = 0x86
    NOT_AUTHORIZED = 0x87
    SERVER_UNAVAILABLE = 0x88
    SERVER_BUSY = 0x89
    BANNED = 0x8A
    SERVER_SHUTTING_DOWN = 0x8B
    BAD_AUTHENTICATION_METHOD = 0x8C
    KEEP_ALIVE_TIMEOUT = 0x8D
    SESSION_TAKEN_OVER = 0x8E
    TOPIC_FILTER_INVALID = 0x8F
    TOPIC_NAME_INVALID = 0x90
    PACKET_IDENTIFIER_IN_USE = 0x91
    PACKET_IDENTIFIER_NOT_FOUND = 0x92
    RECEIVE_MAXIMUM_EXCEEDED = 0x93
    TOPIC_ALIAS_INVALID = 0x94
    PACKET_TOO_LARGE = 0x95
    MESSAGE_RATE_TOO_HIGH = 0x96
    QUOTA_EXCEEDED = 0x97
    ADMINISTRATIVE_ACTION = 0x98
    PAYLOAD_FORMAT_INVALID = 0x99
    RETAIN_NOT_SUPPORTED = 0x9A
    QOS_NOT_SUPPORTED = 0x9B
    USE_ANOTHER_SERVER = 0x9C
    SERVER_MOVED = 0x9D
    SHARED_SUBSCRIPTIONS_NOT_SUPPORTED = 0x9E
    CONNECTION_RATE_EXCEEDED = 0x9F
    MAXIMUM_CONNECT_TIME = 0xA0
    SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED = 0xA1
    WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED = 0xA2


class ConnackReturnCode(IntEnum):
    """MQTT 3.1 / 3.1.1 CONNACK return codes (3.1.1 §3.2.2.3)."""

    ACCEPTED = 0
    UNACCEPTABLE_PROTOCOL_VERSION = 1
    IDENTIFIER_REJECTED = 2
    SERVER_UNAVAILABLE = 3
    BAD_USER_NAME_OR_PASSWORD = 4
    NOT_AUTHORIZED = 5


# Packet type numbers (fixed header high nibble), repeated here to keep this module leaf-level.
_CONNACK, _PUBACK, _PUBREC, _PUBREL, _PUBCOMP = 2, 4, 5, 6, 7
_SUBACK, _UNSUBACK, _DISCONNECT, _AUTH = 9, 11, 14, 15

# Which packet types may carry which reason code: MQTT 5 §2.4 table 2-6.
ALLOWED: dict[int, frozenset[int]] = {
    _CONNACK: frozenset(
        (0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A, 0x8C)
        + (0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F)
    ),
    _PUBACK: frozenset((0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99)),
    _PUBREC: frozenset((0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99)),
    _PUBREL: frozenset((0x00, 0x92)),
    _PUBCOMP: frozenset((0x00, 0x92)),
    _SUBACK: frozenset((0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2)),
    _UNSUBACK: frozenset((0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91)),
    _DISCONNECT: frozenset(
        (0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F, 0x90)
        + (0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9E, 0x9F)
        + (0xA0, 0xA1, 0xA2)
    ),
    _AUTH: frozenset((0x00, 0x18, 0x19)),
}


def is_error(code: int) -> bool:
    """Codes 0x80 and above are failures (§2.4)."""
    return code >= 0x80


# v5 CONNACK reason -> v3 return code. Where v3 has no equivalent the server just closes the
# network connection (3.1.1 §3.2.2.3: "If none of the return codes are deemed applicable, the
# Server MUST close the Network Connection without sending a CONNACK").
_V5_TO_V3: dict[int, int] = {
    0x00: 0,
    0x84: 1,
    0x85: 2,
    0x88: 3,
    0x89: 3,
    0x9C: 3,
    0x9D: 3,
    0x9F: 3,
    0x86: 4,
    0x87: 5,
    0x8A: 5,
    0x8C: 5,
}

_V3_TO_V5: dict[int, int] = {0: 0x00, 1: 0x84, 2: 0x85, 3: 0x88, 4: 0x86, 5: 0x87}


def v3_connack_code(reason_code: int) -> int | None:
    """The v3 CONNACK return code for a v5 CONNACK reason code, or None (close, no CONNACK)."""
    return _V5_TO_V3.get(reason_code)


def v5_from_v3_connack(return_code: int) -> int:
    """The v5 reason code for a v3 CONNACK return code (unknown codes -> 0x80)."""
    return _V3_TO_V5.get(return_code, 0x80)


def reason_name(code: int) -> str:
    """Human name for logs: 'TOPIC_NAME_INVALID (0x90)'."""
    try:
        return f"{ReasonCode(code).name} (0x{code:02X})"
    except ValueError:
        return f"UNKNOWN (0x{code:02X})"
