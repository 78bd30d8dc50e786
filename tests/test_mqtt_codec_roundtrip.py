"""Property-based round trips (every packet type, every property) and fuzzing of the MQTT codec.

Fuzzing follows h11's rule: whatever bytes arrive, whole or one byte at a time, the only exception
that may escape the parser or the connection is RemoteProtocolError. `LIGHTGATE_FUZZ_SCALE=N`
multiplies the fuzzing examples (`make fuzz` runs rounds of these with new seeds).
"""

from __future__ import annotations

import os
import random
from typing import Any

import fuzz_inputs as fi
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mqtt_proxy.codec import (
    SERVER,
    Auth,
    Connack,
    Connect,
    Connection,
    Disconnect,
    Parser,
    Pingreq,
    Pingresp,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    RemoteProtocolError,
    Suback,
    Subscribe,
    TopicSubscription,
    Unsuback,
    Unsubscribe,
    Will,
    encode,
)
from mqtt_proxy.codec._wire import disallowed_search
from mqtt_proxy.codec.properties import PROPERTY_SPECS, WILL
from mqtt_proxy.codec.reason_codes import ALLOWED

SCALE = max(1, int(os.environ.get("LIGHTGATE_FUZZ_SCALE", "1")))

# Strings the strict policy accepts: no surrogates, controls or unassigned/non-characters.
text = st.text(st.characters(exclude_categories=("Cs", "Cc", "Cn")), max_size=12)
level = st.text(
    st.characters(exclude_categories=("Cs", "Cc", "Cn"), exclude_characters="+#/"), max_size=6
)
topic = st.lists(level, min_size=1, max_size=4).map("/".join).filter(bool)
pid = st.integers(1, 0xFFFF)
blob = st.binary(max_size=40)


@st.composite
def topic_filter(draw: Any) -> str:
    levels = draw(st.lists(st.one_of(level, st.just("+")), min_size=1, max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    flt = "/".join(levels)
    assume(flt)
    if draw(st.booleans()):
        flt = f"$share/{draw(level.filter(bool))}/{flt}"
    return flt


_VALUES = {
    "byte": st.integers(0, 1),
    "u16": st.integers(1, 0xFFFF),
    "u32": st.integers(1, 0xFFFFFFFF),
    "varint": st.integers(1, 268_435_455),
    "str": text,
    "bin": blob,
}


@st.composite
def properties(draw: Any, ptype: int) -> Properties:
    kw: dict[str, Any] = {}
    for spec in PROPERTY_SPECS.values():
        if ptype not in spec.packets or not draw(st.booleans()):
            continue
        if spec.type == "pair":
            kw[spec.name] = tuple(draw(st.lists(st.tuples(text, text), min_size=1, max_size=3)))
        elif spec.type == "varint":
            n = 1 if ptype != 3 else draw(st.integers(1, 3))
            kw[spec.name] = tuple(draw(st.lists(_VALUES["varint"], min_size=n, max_size=n)))
        else:
            kw[spec.name] = draw(_VALUES[spec.type])
    if ptype == 1 and "authentication_data" in kw:
        kw.setdefault("authentication_method", "m")
    return Properties(**kw)


def props_for(ptype: int, version: int) -> Any:
    return properties(ptype) if version == 5 else st.just(Properties())


def reason(ptype: int, version: int) -> Any:
    if version != 5:
        return st.just(0)
    return st.sampled_from(sorted(ALLOWED[ptype]))


@st.composite
def packet(draw: Any, version: int) -> Any:
    v = version
    kind = draw(st.integers(1, 15 if v == 5 else 14))
    if kind == 1:
        will = None
        if draw(st.booleans()):
            will = Will(
                draw(topic),
                draw(blob),
                draw(st.integers(0, 2)),
                draw(st.booleans()),
                draw(props_for(WILL, v)),
            )
        user = draw(st.none() | text)
        pw = draw(st.none() | blob) if (user is not None or v == 5) else None
        return Connect(
            draw(text),
            draw(st.booleans()),
            draw(st.integers(0, 0xFFFF)),
            user,
            pw,
            will,
            v,
            draw(props_for(1, v)),
        )
    if kind == 2:
        if v == 5:
            code = draw(reason(2, 5))
        else:
            code = draw(st.sampled_from([0x00, 0x84, 0x85, 0x88, 0x86, 0x87]))
        return Connack(draw(st.booleans()) and not code and v != 3, code, draw(props_for(2, v)))
    if kind == 3:
        qos = draw(st.integers(0, 2))
        return Publish(
            draw(topic),
            draw(blob),
            qos,
            draw(st.booleans()),
            qos > 0 and draw(st.booleans()),
            draw(pid) if qos else 0,
            draw(props_for(3, v)),
        )
    if kind in (4, 5, 6, 7):
        cls = {4: Puback, 5: Pubrec, 6: Pubrel, 7: Pubcomp}[kind]
        return cls(draw(pid), draw(reason(kind, v)), draw(props_for(kind, v)))
    if kind == 8:
        subs = []
        for flt in draw(st.lists(topic_filter(), min_size=1, max_size=3)):
            if v == 5:
                subs.append(
                    TopicSubscription(
                        flt,
                        draw(st.integers(0, 2)),
                        draw(st.booleans()) and not flt.startswith("$share/"),
                        draw(st.booleans()),
                        draw(st.integers(0, 2)),
                    )
                )
            else:
                subs.append(TopicSubscription(flt, draw(st.integers(0, 2))))
        return Subscribe(draw(pid), subs, draw(props_for(8, v)))
    if kind == 9:
        codes = st.sampled_from(sorted(ALLOWED[9])) if v == 5 else st.sampled_from([0, 1, 2, 0x80])
        return Suback(
            draw(pid), draw(st.lists(codes, min_size=1, max_size=4)), draw(props_for(9, v))
        )
    if kind == 10:
        return Unsubscribe(
            draw(pid),
            draw(st.lists(topic_filter(), min_size=1, max_size=3)),
            draw(props_for(10, v)),
        )
    if kind == 11:
        codes = draw(st.lists(reason(11, 5), min_size=1, max_size=3)) if v == 5 else ()
        return Unsuback(draw(pid), codes, draw(props_for(11, v)))
    if kind == 12:
        return Pingreq()
    if kind == 13:
        return Pingresp()
    if kind == 14:
        return Disconnect(draw(reason(14, v)), draw(props_for(14, v)))
    return Auth(draw(reason(15, 5)), draw(props_for(15, 5)))


@settings(deadline=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from([3, 4, 5]).flatmap(
        lambda v: st.tuples(st.just(v), st.lists(packet(v), max_size=5))
    )
)
def test_round_trip(case: tuple[int, list[Any]]) -> None:
    version, packets = case
    data = b"".join(encode(p, version) for p in packets)
    assert Parser(version=version).feed(data) == packets
    # split at an arbitrary point: same events
    cut = len(data) // 3
    p = Parser(version=version)
    assert p.feed(data[:cut]) + p.feed(data[cut:]) == packets


@settings(deadline=None, max_examples=200)
@given(st.sampled_from([3, 4, 5]).flatmap(packet))
def test_connect_first_sets_version(pkt: Any) -> None:
    if not isinstance(pkt, Connect):
        return
    parser = Parser()
    assert parser.feed(encode(pkt, pkt.protocol_level)) == [pkt]
    assert parser.version == pkt.protocol_level


def _feed_outcome(version: int | None, data: bytes, step: int) -> tuple[list[Any], int | None]:
    parser = Parser(version=version, max_packet_size=4096)
    out: list[Any] = []
    try:
        for i in range(0, len(data), step):
            out += parser.feed(data[i : i + step])
    except RemoteProtocolError as e:
        return out + e.packets, e.reason_code
    return out, None


@settings(deadline=None, max_examples=1000 * SCALE)
@given(st.sampled_from([None, 3, 4, 5]), st.binary(max_size=200))
def test_fuzz_random_bytes(version: int | None, data: bytes) -> None:
    whole = _feed_outcome(version, data, len(data) or 1)
    bytewise = _feed_outcome(version, data, 1)
    assert whole == bytewise


@st.composite
def mutated_stream(draw: Any) -> tuple[int, bytes]:
    v = draw(st.sampled_from([3, 4, 5]))
    data = bytearray(
        b"".join(encode(p, v) for p in draw(st.lists(packet(v), min_size=1, max_size=3)))
    )
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    return v, bytes(data)


@settings(deadline=None, max_examples=1000 * SCALE, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_stream())
def test_fuzz_mutated_packets(case: tuple[int, bytes]) -> None:
    version, data = case
    assert _feed_outcome(version, data, len(data)) == _feed_outcome(version, data, 1)


@settings(deadline=None, max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([3, 4, 5]), st.binary(max_size=120), st.integers(1, 7))
def test_fuzz_server_connection(version: int, tail: bytes, step: int) -> None:
    conn = Connection(SERVER, max_packet_size=4096)
    data = encode(Connect("c", protocol_level=version), version) + tail
    try:
        for i in range(0, len(data), step):
            conn.receive_data(data[i : i + step])
    except RemoteProtocolError as e:
        reply = conn.error_bytes(e)
        assert isinstance(reply, bytes)


@settings(deadline=None, max_examples=200 * SCALE)
@given(st.integers(0, 2**64), st.integers(1, 64))
def test_fuzz_mutated_sessions_through_the_server_connection(seed: int, step: int) -> None:
    """Whole client sessions (CONNECT first, then what clients send: tests/fuzz_inputs.py) with
    the socket fuzzer's mutations (bit flips, truncations, length fields, packets duplicated or
    reordered), in chunks of `step` bytes: only RemoteProtocolError, and the last words for it
    always encode."""
    rng = random.Random(seed)
    data = b"".join(fi.mutate(rng, fi.mqtt_session(rng), "mqtt"))
    conn = Connection(SERVER, max_packet_size=4096)
    try:
        for i in range(0, len(data), step):
            conn.receive_data(data[i : i + step])
    except RemoteProtocolError as e:
        assert isinstance(conn.error_bytes(e), bytes)


def _carrier(ptype: int, props: Properties) -> Any:
    """A v5 packet of type `ptype` carrying `props` (WILL: inside a CONNECT's will)."""
    return {
        1: lambda: Connect("c", protocol_level=5, properties=props),
        WILL: lambda: Connect("c", protocol_level=5, will=Will("w", b"", properties=props)),
        2: lambda: Connack(properties=props),
        3: lambda: Publish("t", b"p", properties=props),
        4: lambda: Puback(1, 0, props),
        5: lambda: Pubrec(1, 0, props),
        6: lambda: Pubrel(1, 0, props),
        7: lambda: Pubcomp(1, 0, props),
        8: lambda: Subscribe(1, [TopicSubscription("a")], props),
        9: lambda: Suback(1, [0], props),
        10: lambda: Unsubscribe(1, ["a"], props),
        11: lambda: Unsuback(1, [0], props),
        14: lambda: Disconnect(0, props),
        15: lambda: Auth(0, props),
    }[ptype]()


@settings(deadline=None, max_examples=300)
@given(
    st.sampled_from(
        [(s.id, t) for s in PROPERTY_SPECS.values() for t in sorted(s.packets)]
    ).flatmap(
        lambda c: st.tuples(
            st.just(c),
            st.lists(st.tuples(text, text), min_size=1, max_size=2).map(tuple)
            if PROPERTY_SPECS[c[0]].type == "pair"
            else st.integers(1, 268_435_455).map(lambda x: (x,))
            if PROPERTY_SPECS[c[0]].type == "varint"
            else _VALUES[PROPERTY_SPECS[c[0]].type],
        )
    )
)
def test_every_property_in_every_allowed_packet(case: tuple[tuple[int, int], Any]) -> None:
    (prop_id, ptype), value = case
    spec = PROPERTY_SPECS[prop_id]
    if ptype == 1 and spec.name == "authentication_data":
        props = Properties(authentication_data=value, authentication_method="m")
    else:
        props = Properties(**{spec.name: value})
    pkt = _carrier(ptype, props)
    assert Parser(version=5).feed(encode(pkt, 5)) == [pkt]


@settings(deadline=None, max_examples=150)
@given(
    st.text(
        st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="+#\ufeff"),
        min_size=1,
        max_size=40,
    ).filter(lambda t: disallowed_search(t) is None),  # what inbound parsing lets through
    st.one_of(st.binary(max_size=300), st.binary(min_size=16380, max_size=16400)),
    st.booleans(),
    st.sampled_from([4, 5]),
)
def test_delivery_encoders_agree(topic: str, payload: bytes, retain: bool, version: int) -> None:
    """The three ways delivery encodes a QoS 0 PUBLISH write the same bytes as `encode`, and
    those bytes parse back to the message (short and multi-byte remaining lengths)."""
    from mqtt_proxy.codec import PublishTemplate, encode_publish, publish_qos0

    want = encode(Publish(topic, payload, 0, retain), version)
    assert encode_publish(topic, payload, 0, retain, version=version) == want
    assert PublishTemplate.build(topic, payload, 0, retain, None, version).data == want
    assert publish_qos0(topic, payload, retain, version == 5) == want
    assert publish_qos0(topic, payload, retain, version == 5) == want  # cached topic bytes
    (got,) = Parser(version=version).feed(want)
    assert (got.topic, got.payload, got.retain, got.qos) == (topic, payload, retain, 0)
    if version == 4 and not retain:  # and the 3.1.1 QoS 1 packet of a catching-up reader
        from mqtt_proxy.codec import publish_v3_qos1

        pid = len(payload) % 65535 + 1
        q1 = PublishTemplate.build(topic, payload, 1, False, None, 4).packet(pid)
        assert (
            publish_v3_qos1(topic, payload, pid)
            == q1
            == encode(Publish(topic, payload, 1, False, False, pid), 4)
        )


@given(st.sampled_from([4, 5]), st.lists(pid, min_size=1, max_size=300))
def test_joined_v3_acks_parse_back(ptype: int, pids: list[int]) -> None:
    """The acks of one fsync, packed at once for a 3.1.1 connection, are the codec's PUBACKs /
    PUBRECs for those ids, in order."""
    from mqtt_proxy.delivery.outbound import acks

    data = acks(ptype, pids)
    kind = Puback if ptype == 4 else Pubrec
    assert data == b"".join(encode(kind(p), 4) for p in pids)
    assert Parser(version=4).feed(data) == [kind(p) for p in pids]
