"""What every MQTT packet event is (`Packet`: type-aware equality, always truthy; `PacketType`
numbers) and the checks their constructors share (packets.py holds the fifteen packets)."""

from __future__ import annotations

from typing import Any

from .errors import LocalProtocolError
from .properties import Properties


class PacketType:
    """Fixed-header packet type numbers (high nibble of byte 0)."""

    CONNECT = 1
    CONNACK = 2
    PUBLISH = 3
    PUBACK = 4
    PUBREC = 5
    PUBREL = 6
    PUBCOMP = 7
    SUBSCRIBE = 8
    SUBACK = 9
    UNSUBSCRIBE = 10
    UNSUBACK = 11
    PINGREQ = 12
    PINGRESP = 13
    DISCONNECT = 14
    AUTH = 15


# protocol level -> protocol name in CONNECT
PROTOCOL_NAMES = {3: "MQIsdp", 4: "MQTT", 5: "MQTT"}


class Packet:
    """Mixin for every event: type-aware equality and hashing, always truthy.

    `TYPE` is the fixed-header packet type number.
    """

    __slots__ = ()
    TYPE: int = 0

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and tuple.__eq__(self, other)  # type: ignore[arg-type,operator]

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple.__hash__(self)))  # type: ignore[arg-type]

    def __bool__(self) -> bool:
        return True


def bad(msg: str) -> LocalProtocolError:
    return LocalProtocolError(msg)


def check_qos(qos: int, what: str = "QoS") -> None:
    if qos not in (0, 1, 2):
        raise bad(f"{what} must be 0, 1 or 2, not {qos!r}")


def check_pid(pid: int) -> None:
    if not isinstance(pid, int) or not 1 <= pid <= 0xFFFF:
        raise bad(f"packet id must be 1..65535, not {pid!r}")


def check_reason(code: int) -> None:
    if not isinstance(code, int) or not 0 <= code <= 0xFF:
        raise bad(f"reason code must be a byte, not {code!r}")


def check_props(props: Any) -> None:
    if not isinstance(props, Properties):
        raise bad(f"properties must be a Properties, not {type(props).__name__}")


tnew = tuple.__new__
