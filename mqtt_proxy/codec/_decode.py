"""Decoders for every packet but PUBLISH (whose fast path lives in `parser.py`).

Each decoder is `f(b0, buf, s, end, version, strict) -> Packet`: `b0` is the fixed-header byte
(flags already checked), `buf[s:end]` the variable header + payload. They raise
RemoteProtocolError with the reason code the spec names (0x81 malformed unless stated).
"""

from __future__ import annotations

from collections.abc import Callable

from ._wire import read_bin, read_str
from .errors import RemoteProtocolError
from .packets import (
    PROTOCOL_NAMES,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    TopicSubscription,
    Unsuback,
    Unsubscribe,
    Will,
)
from .properties import EMPTY_PROPERTIES, WILL, decode_properties
from .reason_codes import ALLOWED, v5_from_v3_connack
from .topics import topic_filter_error, topic_name_error

_tnew = tuple.__new__
_E = RemoteProtocolError
Decoder = Callable[[int, bytes, int, int, int, bool], Packet]


def _u16(buf: bytes, p: int, end: int, what: str) -> int:
    if p + 2 > end:
        raise _E(f"{what} runs past the end of the packet")
    return (buf[p] << 8) | buf[p + 1]


def _pid(buf: bytes, p: int, end: int) -> int:
    pid = _u16(buf, p, end, "packet id")
    if not pid:
        raise _E("packet id 0 [MQTT-2.2.1-3]")
    return pid


def _done(p: int, end: int, what: str) -> None:
    if p != end:
        raise _E(f"{end - p} unexpected trailing bytes in {what}")


def decode_connect(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Connect:
    name, p = read_str(buf, s, end, strict)
    if p >= end:
        raise _E("CONNECT ends before the protocol level")
    level = buf[p]
    if PROTOCOL_NAMES.get(level) != name:
        if name not in ("MQTT", "MQIsdp"):
            raise _E(f"unknown protocol name {name!r}", 0x82)
        raise _E(f"unsupported protocol {name!r} level {level}", 0x84, level)
    try:
        return _connect_body(buf, p + 1, end, level, strict)
    except RemoteProtocolError as e:
        e.protocol_level = level
        raise


def _connect_body(buf: bytes, p: int, end: int, level: int, strict: bool) -> Connect:
    if p + 3 > end:
        raise _E("CONNECT ends before keep alive")
    flags = buf[p]
    keep_alive = (buf[p + 1] << 8) | buf[p + 2]
    p += 3
    if flags & 0x01:
        raise _E("CONNECT reserved flag set [MQTT-3.1.2-3]")
    will_flag = flags & 0x04
    will_qos = (flags >> 3) & 3
    will_retain = bool(flags & 0x20)
    if will_qos == 3:
        raise _E("will QoS 3 [MQTT-3.1.2-14]")
    if not will_flag and (will_qos or will_retain):
        raise _E("will QoS/retain without will flag [MQTT-3.1.2-13]")
    has_pw = flags & 0x40
    has_user = flags & 0x80
    if has_pw and not has_user and level < 5:
        raise _E("password without user name [MQTT-3.1.2-22]")
    props = EMPTY_PROPERTIES
    if level == 5:
        props, p = decode_properties(buf, p, end, 1, strict)
        if props.authentication_data is not None and props.authentication_method is None:
            raise _E("authentication data without method", 0x82)
    client_id, p = read_str(buf, p, end, strict)
    will = None
    if will_flag:
        wprops = EMPTY_PROPERTIES
        if level == 5:
            wprops, p = decode_properties(buf, p, end, WILL, strict)
        wtopic, p = read_str(buf, p, end, strict)
        if not wtopic or topic_name_error(wtopic):
            raise _E(f"invalid will topic {wtopic!r}", 0x90)
        wpayload, p = read_bin(buf, p, end)
        will = _tnew(Will, (wtopic, wpayload, will_qos, will_retain, wprops))
    username = password = None
    if has_user:
        username, p = read_str(buf, p, end, strict)
    if has_pw:
        password, p = read_bin(buf, p, end)
    _done(p, end, "CONNECT")
    return _tnew(
        Connect,
        (client_id, bool(flags & 0x02), keep_alive, username, password, will, level, props),
    )


def decode_connack(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Connack:
    if s + 2 > end:
        raise _E("CONNACK shorter than 2 bytes")
    ack, code = buf[s], buf[s + 1]
    if version >= 4 and ack & 0xFE:
        raise _E("CONNACK reserved acknowledge flags set [MQTT-3.2.2-1]")
    props = EMPTY_PROPERTIES
    p = s + 2
    if version == 5:
        if code not in ALLOWED[2]:
            raise _E(f"reason code 0x{code:02X} not allowed in CONNACK")
        if p < end:
            props, p = decode_properties(buf, p, end, 2, strict)
    else:
        code = v5_from_v3_connack(code)
    _done(p, end, "CONNACK")
    return _tnew(Connack, (bool(ack & 1) if version >= 4 else False, code, props))


def _ack_decoder(cls: type[Packet], ptype: int) -> Decoder:
    allowed = ALLOWED[ptype]

    def decode(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Packet:
        pid = _pid(buf, s, end)
        p = s + 2
        code = 0
        props = EMPTY_PROPERTIES
        if version == 5 and p < end:
            code = buf[p]
            p += 1
            if code not in allowed:
                raise _E(f"reason code 0x{code:02X} not allowed in {cls.__name__.upper()}")
            if p < end:
                props, p = decode_properties(buf, p, end, ptype, strict)
        _done(p, end, cls.__name__.upper())
        return _tnew(cls, (pid, code, props))  # type: ignore[no-any-return,type-var]

    return decode


def decode_subscribe(
    b0: int, buf: bytes, s: int, end: int, version: int, strict: bool
) -> Subscribe:
    pid = _pid(buf, s, end)
    p = s + 2
    props = EMPTY_PROPERTIES
    if version == 5:
        props, p = decode_properties(buf, p, end, 8, strict)
    reserved = 0xC0 if version == 5 else 0xFC
    subs = []
    while p < end:
        flt, p = read_str(buf, p, end, strict)
        if p >= end:
            raise _E("SUBSCRIBE filter without options")
        opts = buf[p]
        p += 1
        if opts & reserved:
            raise _E("SUBSCRIBE reserved option bits set [MQTT-3.8.3-5]")
        qos = opts & 3
        rh = (opts >> 4) & 3
        if qos == 3 or rh == 3:
            raise _E("SUBSCRIBE QoS or retain handling 3")
        if err := topic_filter_error(flt):
            raise _E(err, 0x8F)
        no_local = bool(opts & 4)
        if no_local and flt.startswith("$share/"):
            raise _E("no local on a shared subscription [MQTT-3.8.3-4]", 0x82)
        subs.append(_tnew(TopicSubscription, (flt, qos, no_local, bool(opts & 8), rh)))
    if not subs:
        raise _E("SUBSCRIBE without topic filters [MQTT-3.8.3-3]", 0x82)
    return _tnew(Subscribe, (pid, tuple(subs), props))


def decode_suback(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Suback:
    pid = _pid(buf, s, end)
    p = s + 2
    props = EMPTY_PROPERTIES
    allowed = ALLOWED[9] if version == 5 else (0, 1, 2, 0x80)
    if version == 5:
        props, p = decode_properties(buf, p, end, 9, strict)
    codes = tuple(buf[p:end])
    for c in codes:
        if c not in allowed:
            raise _E(f"reason code 0x{c:02X} not allowed in SUBACK")
    if not codes:
        raise _E("SUBACK without reason codes", 0x82)
    return _tnew(Suback, (pid, codes, props))


def decode_unsubscribe(
    b0: int, buf: bytes, s: int, end: int, version: int, strict: bool
) -> Unsubscribe:
    pid = _pid(buf, s, end)
    p = s + 2
    props = EMPTY_PROPERTIES
    if version == 5:
        props, p = decode_properties(buf, p, end, 10, strict)
    flts = []
    while p < end:
        flt, p = read_str(buf, p, end, strict)
        if err := topic_filter_error(flt):
            raise _E(err, 0x8F)
        flts.append(flt)
    if not flts:
        raise _E("UNSUBSCRIBE without topic filters [MQTT-3.10.3-2]", 0x82)
    return _tnew(Unsubscribe, (pid, tuple(flts), props))


def decode_unsuback(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Unsuback:
    pid = _pid(buf, s, end)
    p = s + 2
    props = EMPTY_PROPERTIES
    codes: tuple[int, ...] = ()
    if version == 5:
        props, p = decode_properties(buf, p, end, 11, strict)
        codes = tuple(buf[p:end])
        for c in codes:
            if c not in ALLOWED[11]:
                raise _E(f"reason code 0x{c:02X} not allowed in UNSUBACK")
        if not codes:
            raise _E("UNSUBACK without reason codes", 0x82)
        p = end
    _done(p, end, "UNSUBACK")
    return _tnew(Unsuback, (pid, codes, props))


def _empty_decoder(cls: type[Packet]) -> Decoder:
    def decode(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Packet:
        _done(s, end, cls.__name__.upper())
        return _tnew(cls, ())  # type: ignore[no-any-return,type-var]

    return decode


def _reason_decoder(cls: type[Packet], ptype: int) -> Decoder:
    allowed = ALLOWED[ptype]

    def decode(b0: int, buf: bytes, s: int, end: int, version: int, strict: bool) -> Packet:
        code = 0
        props = EMPTY_PROPERTIES
        p = s
        if version == 5 and p < end:
            code = buf[p]
            p += 1
            if code not in allowed:
                raise _E(f"reason code 0x{code:02X} not allowed in {cls.__name__.upper()}")
            if p < end:
                props, p = decode_properties(buf, p, end, ptype, strict)
        _done(p, end, cls.__name__.upper())
        return _tnew(cls, (code, props))  # type: ignore[no-any-return,type-var]

    return decode


# packet type -> decoder (PUBLISH, 3, is handled inline by the parser)
DECODERS: dict[int, Decoder] = {
    1: decode_connect,
    2: decode_connack,
    4: _ack_decoder(Puback, 4),
    5: _ack_decoder(Pubrec, 5),
    6: _ack_decoder(Pubrel, 6),
    7: _ack_decoder(Pubcomp, 7),
    8: decode_subscribe,
    9: decode_suback,
    10: decode_unsubscribe,
    11: decode_unsuback,
    12: _empty_decoder(Pingreq),
    13: _empty_decoder(Pingresp),
    14: _reason_decoder(Disconnect, 14),
    15: _reason_decoder(Auth, 15),
}

# Required low nibble of byte 0 per packet type [MQTT-2.2.2-1/2]; PUBLISH's flags are its own.
REQUIRED_FLAGS = {t: (2 if t in (6, 8, 10) else 0) for t in DECODERS}
