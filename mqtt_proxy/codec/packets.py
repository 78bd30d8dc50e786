"""One immutable event class per MQTT control packet (MQTT 3.1 / 3.1.1 / 5.0), after h11's
`_events.py`.

Each class is a slotted named tuple (`__slots__ = ()`, frozen by construction) whose constructor
validates every field and raises LocalProtocolError. The parser skips that validation by building
the tuple directly (`tuple.__new__(cls, fields)`): it has already checked each field against the
wire rules, which is the "fast path for parser-checked fields". Why named tuples rather than
frozen dataclasses: building a 7-field frozen slotted dataclass goes through object.__setattr__
per field (~0.9 µs on CPython 3.11 here); `tuple.__new__` costs ~0.1 µs, and field reads are C
`_tuplegetter`s. Equality compares the type too (`Puback(1) != Pubrec(1)`), and every event is
truthy (PINGREQ has no fields).

One vocabulary across versions: reason codes are MQTT 5 codes everywhere; for 3.1/3.1.1 the
encoder maps CONNACK reasons to v3 return codes (reason_codes.v3_connack_code) and the parser maps
back; `properties` is `EMPTY_PROPERTIES` for v3 and is dropped by the v3 encoders. The base
class and the field checks are in packet_base.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .packet_base import (
    PROTOCOL_NAMES,
    Packet,
    PacketType,
    bad,
    check_pid,
    check_props,
    check_qos,
    check_reason,
    tnew,
)
from .properties import EMPTY_PROPERTIES, Properties
from .topics import split_shared, topic_filter_error, topic_name_error

# --------------------------------------------------------------------------------------------
# Field tuples (typing.NamedTuple forbids overriding __new__ in the class itself, so each event
# subclasses its field tuple and adds the validating constructor).


class _Will(NamedTuple):
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    properties: Properties = EMPTY_PROPERTIES


class Will(Packet, _Will):
    """The will message carried in CONNECT (not a packet of its own; TYPE 0)."""

    __slots__ = ()

    def __new__(
        cls,
        topic: str,
        payload: bytes = b"",
        qos: int = 0,
        retain: bool = False,
        properties: Properties = EMPTY_PROPERTIES,
    ) -> Will:
        if not topic or (err := topic_name_error(topic)):
            raise bad(f"will topic: {'empty' if not topic else err}")
        check_qos(qos, "will QoS")
        check_props(properties)
        return tnew(cls, (topic, bytes(payload), qos, bool(retain), properties))


class _TopicSubscription(NamedTuple):
    filter: str
    qos: int = 0
    no_local: bool = False
    retain_as_published: bool = False
    retain_handling: int = 0


class TopicSubscription(Packet, _TopicSubscription):
    """One (filter, options) entry of a SUBSCRIBE (v5 §3.8.3.1 subscription options)."""

    __slots__ = ()

    def __new__(
        cls,
        filter: str,
        qos: int = 0,
        no_local: bool = False,
        retain_as_published: bool = False,
        retain_handling: int = 0,
    ) -> TopicSubscription:
        if err := topic_filter_error(filter):
            raise bad(err)
        check_qos(qos)
        if retain_handling not in (0, 1, 2):
            raise bad(f"retain handling must be 0, 1 or 2, not {retain_handling!r}")
        if no_local and filter.startswith("$share/"):
            raise bad("no local on a shared subscription [MQTT-3.8.3-4]")
        return tnew(cls, (filter, qos, bool(no_local), bool(retain_as_published), retain_handling))

    @property
    def share_group(self) -> str | None:
        """The share name of a `$share/group/filter` subscription, else None."""
        return split_shared(self.filter)[0]


class _Connect(NamedTuple):
    client_id: str
    clean_start: bool = True
    keep_alive: int = 60
    username: str | None = None
    password: bytes | None = None
    will: Will | None = None
    protocol_level: int = 4
    properties: Properties = EMPTY_PROPERTIES


class Connect(Packet, _Connect):
    """CONNECT. `clean_start` is 3.1.1's Clean Session; `protocol_level` 3 = MQTT 3.1 (MQIsdp),
    4 = 3.1.1, 5 = 5.0."""

    __slots__ = ()
    TYPE = PacketType.CONNECT

    def __new__(
        cls,
        client_id: str,
        clean_start: bool = True,
        keep_alive: int = 60,
        username: str | None = None,
        password: bytes | None = None,
        will: Will | None = None,
        protocol_level: int = 4,
        properties: Properties = EMPTY_PROPERTIES,
    ) -> Connect:
        if protocol_level not in PROTOCOL_NAMES:
            raise bad(f"unsupported protocol level {protocol_level!r}")
        if not isinstance(client_id, str):
            raise bad("client id must be a str")
        if not 0 <= keep_alive <= 0xFFFF:
            raise bad(f"keep alive must be 0..65535, not {keep_alive!r}")
        if password is not None and username is None and protocol_level < 5:
            raise bad("a password needs a user name before MQTT 5 [MQTT-3.1.2-22]")
        if will is not None and not isinstance(will, Will):
            raise bad("will must be a Will")
        check_props(properties)
        if password is not None:
            password = bytes(password)
        return tnew(
            cls,
            (client_id, bool(clean_start), keep_alive, username, password, will)
            + (protocol_level, properties),
        )


class _Connack(NamedTuple):
    session_present: bool = False
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


class Connack(Packet, _Connack):
    """CONNACK; `reason_code` in v5 terms (0x00 success, 0x84 unsupported version, ...)."""

    __slots__ = ()
    TYPE = PacketType.CONNACK

    def __new__(
        cls,
        session_present: bool = False,
        reason_code: int = 0,
        properties: Properties = EMPTY_PROPERTIES,
    ) -> Connack:
        check_reason(reason_code)
        if session_present and reason_code:
            raise bad("session present must be 0 on a failed CONNACK [MQTT-3.2.2-6]")
        check_props(properties)
        return tnew(cls, (bool(session_present), reason_code, properties))


class _Publish(NamedTuple):
    topic: str
    payload: bytes = b""
    qos: int = 0
    retain: bool = False
    dup: bool = False
    packet_id: int = 0
    properties: Properties = EMPTY_PROPERTIES


class Publish(Packet, _Publish):
    """PUBLISH. `packet_id` is 0 for QoS 0 and 1..65535 otherwise. An empty `topic` is legal
    only in v5 with a Topic Alias; `Connection` resolves aliases so received events always carry
    the full topic."""

    __slots__ = ()
    TYPE = PacketType.PUBLISH

    def __new__(
        cls,
        topic: str,
        payload: bytes = b"",
        qos: int = 0,
        retain: bool = False,
        dup: bool = False,
        packet_id: int = 0,
        properties: Properties = EMPTY_PROPERTIES,
    ) -> Publish:
        if err := topic_name_error(topic):
            raise bad(err)
        if not topic and properties.topic_alias is None:
            raise bad("empty topic name without a topic alias")
        check_qos(qos)
        if qos:
            check_pid(packet_id)
        elif packet_id:
            raise bad("QoS 0 PUBLISH has no packet id")
        elif dup:
            raise bad("DUP must be 0 for QoS 0 [MQTT-3.3.1-2]")
        check_props(properties)
        return tnew(
            cls, (topic, bytes(payload), qos, bool(retain), bool(dup), packet_id, properties)
        )


class _Ack(NamedTuple):
    packet_id: int
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


class _AckMixin(Packet):
    __slots__ = ()

    def __new__(
        cls, packet_id: int, reason_code: int = 0, properties: Properties = EMPTY_PROPERTIES
    ) -> Any:
        check_pid(packet_id)
        check_reason(reason_code)
        check_props(properties)
        return tnew(cls, (packet_id, reason_code, properties))  # type: ignore[type-var]


class Puback(_AckMixin, _Ack):
    """PUBACK (QoS 1 acknowledgement)."""

    __slots__ = ()
    TYPE = PacketType.PUBACK


class Pubrec(_AckMixin, _Ack):
    """PUBREC (QoS 2, step 1)."""

    __slots__ = ()
    TYPE = PacketType.PUBREC


class Pubrel(_AckMixin, _Ack):
    """PUBREL (QoS 2, step 2)."""

    __slots__ = ()
    TYPE = PacketType.PUBREL


class Pubcomp(_AckMixin, _Ack):
    """PUBCOMP (QoS 2, step 3)."""

    __slots__ = ()
    TYPE = PacketType.PUBCOMP


class _Subscribe(NamedTuple):
    packet_id: int
    subscriptions: tuple[TopicSubscription, ...]
    properties: Properties = EMPTY_PROPERTIES


class Subscribe(Packet, _Subscribe):
    """SUBSCRIBE: at least one TopicSubscription [MQTT-3.8.3-3]."""

    __slots__ = ()
    TYPE = PacketType.SUBSCRIBE

    def __new__(
        cls,
        packet_id: int,
        subscriptions: Any,
        properties: Properties = EMPTY_PROPERTIES,
    ) -> Subscribe:
        check_pid(packet_id)
        subs = tuple(subscriptions)
        if not subs:
            raise bad("SUBSCRIBE needs at least one topic filter")
        for s in subs:
            if not isinstance(s, TopicSubscription):
                raise bad("subscriptions must be TopicSubscription values")
        check_props(properties)
        if len(properties.subscription_identifiers) > 1:
            raise bad("SUBSCRIBE takes at most one subscription identifier")
        return tnew(cls, (packet_id, subs, properties))


class _Suback(NamedTuple):
    packet_id: int
    reason_codes: tuple[int, ...]
    properties: Properties = EMPTY_PROPERTIES


class Suback(Packet, _Suback):
    """SUBACK: one reason code per filter (v3: 0, 1, 2 or 0x80)."""

    __slots__ = ()
    TYPE = PacketType.SUBACK

    def __new__(
        cls, packet_id: int, reason_codes: Any, properties: Properties = EMPTY_PROPERTIES
    ) -> Suback:
        check_pid(packet_id)
        codes = tuple(reason_codes)
        for c in codes:
            check_reason(c)
        check_props(properties)
        return tnew(cls, (packet_id, codes, properties))


class _Unsubscribe(NamedTuple):
    packet_id: int
    filters: tuple[str, ...]
    properties: Properties = EMPTY_PROPERTIES


class Unsubscribe(Packet, _Unsubscribe):
    """UNSUBSCRIBE: at least one filter [MQTT-3.10.3-2]."""

    __slots__ = ()
    TYPE = PacketType.UNSUBSCRIBE

    def __new__(
        cls, packet_id: int, filters: Any, properties: Properties = EMPTY_PROPERTIES
    ) -> Unsubscribe:
        check_pid(packet_id)
        flts = tuple(filters)
        if not flts:
            raise bad("UNSUBSCRIBE needs at least one topic filter")
        for f in flts:
            if not isinstance(f, str):
                raise bad(f"filter {f!r} is not a str")
            if err := topic_filter_error(f):
                raise bad(err)
        check_props(properties)
        return tnew(cls, (packet_id, flts, properties))


class _Unsuback(NamedTuple):
    packet_id: int
    reason_codes: tuple[int, ...] = ()
    properties: Properties = EMPTY_PROPERTIES


class Unsuback(Packet, _Unsuback):
    """UNSUBACK; `reason_codes` is v5 only (one per filter), empty for v3."""

    __slots__ = ()
    TYPE = PacketType.UNSUBACK

    def __new__(
        cls, packet_id: int, reason_codes: Any = (), properties: Properties = EMPTY_PROPERTIES
    ) -> Unsuback:
        check_pid(packet_id)
        codes = tuple(reason_codes)
        for c in codes:
            check_reason(c)
        check_props(properties)
        return tnew(cls, (packet_id, codes, properties))


class _Empty(NamedTuple):
    pass


class Pingreq(Packet, _Empty):
    """PINGREQ (client -> server keep-alive)."""

    __slots__ = ()
    TYPE = PacketType.PINGREQ


class Pingresp(Packet, _Empty):
    """PINGRESP."""

    __slots__ = ()
    TYPE = PacketType.PINGRESP


class _ReasonOnly(NamedTuple):
    reason_code: int = 0
    properties: Properties = EMPTY_PROPERTIES


class _ReasonMixin(Packet):
    __slots__ = ()

    def __new__(cls, reason_code: int = 0, properties: Properties = EMPTY_PROPERTIES) -> Any:
        check_reason(reason_code)
        check_props(properties)
        return tnew(cls, (reason_code, properties))  # type: ignore[type-var]


class Disconnect(_ReasonMixin, _ReasonOnly):
    """DISCONNECT; v5 adds a reason code and properties (server-sent only in v5)."""

    __slots__ = ()
    TYPE = PacketType.DISCONNECT


class Auth(_ReasonMixin, _ReasonOnly):
    """AUTH (v5 enhanced authentication): 0x00 success, 0x18 continue, 0x19 re-authenticate."""

    __slots__ = ()
    TYPE = PacketType.AUTH

    def __new__(cls, reason_code: int = 0, properties: Properties = EMPTY_PROPERTIES) -> Auth:
        if reason_code not in (0x00, 0x18, 0x19):
            raise bad(f"AUTH reason code must be 0x00, 0x18 or 0x19, not {reason_code!r}")
        return super().__new__(cls, reason_code, properties)  # type: ignore[no-any-return]


def chunk_kind(packets: list[Any]) -> type | None:
    """The one type of a read chunk's packets (None: mixed or empty): the codec and the proxy
    both take a chunk of PUBLISHes only or of PUBACKs only in one step. A long chunk by a
    C-level pass (~15 ns per packet; `all()` over a generator was ~70), a short one by a plain
    loop (no set built for the one packet of a message that arrives alone)."""
    if not packets:
        return None
    kind = type(packets[0])
    if len(packets) > 16:
        return kind if len(set(map(type, packets))) == 1 else None
    for p in packets:
        if type(p) is not kind:
            return None
    return kind


__all__ = [
    "PROTOCOL_NAMES", "Auth", "Connack", "Connect", "Disconnect", "Packet", "PacketType",
    "Pingreq", "Pingresp", "Puback", "Pubcomp", "Publish", "Pubrec", "Pubrel", "Suback",
    "Subscribe", "TopicSubscription", "Unsuback", "Unsubscribe", "Will", "chunk_kind",
]  # fmt: skip
