"""Outbound topic aliases in the codec: `PublishTemplate.aliased` and `publish_qos0_alias`.

Property-based: whatever the message, the aliased bytes parse back (through a client-role
`Connection`, which resolves aliases as paho does) to the same PUBLISH with the full topic; the
property-less QoS 0 encoder writes exactly `encode`'s bytes.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mqtt_proxy.codec import (
    CLIENT,
    SERVER,
    Connack,
    Connect,
    Connection,
    LocalProtocolError,
    Properties,
    Publish,
    PublishTemplate,
    encode,
    make_properties,
    publish_qos0_alias,
)

level = st.text(
    st.characters(exclude_categories=("Cs", "Cc", "Cn"), exclude_characters="+#/\ufeff"),
    max_size=8,
)
topic = st.lists(level, min_size=1, max_size=4).map("/".join).filter(bool)
payload = st.one_of(st.binary(max_size=200), st.binary(min_size=16380, max_size=16400))
alias = st.integers(1, 0xFFFF)
short_text = st.text(st.characters(exclude_categories=("Cs", "Cc", "Cn")), max_size=10)


@st.composite
def publish_props(draw: Any) -> Properties | None:
    """The properties delivery puts on a PUBLISH (never a Topic Alias: that is per connection)."""
    kw: dict[str, Any] = {}
    if draw(st.booleans()):
        kw["payload_format_indicator"] = draw(st.integers(0, 1))
    if draw(st.booleans()):
        kw["message_expiry_interval"] = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        kw["content_type"] = draw(short_text)
    if draw(st.booleans()):
        kw["correlation_data"] = draw(st.binary(max_size=300))  # block length past 127
    if draw(st.booleans()):
        kw["subscription_identifiers"] = tuple(
            draw(st.lists(st.integers(1, 2**28 - 1), max_size=3))
        )
    if draw(st.booleans()):
        kw["user_properties"] = tuple(draw(st.lists(st.tuples(short_text, short_text), max_size=3)))
    return make_properties(**kw) if kw else draw(st.sampled_from([None, Properties()]))


def client_conn(maximum: int = 0xFFFF) -> Connection:
    """A connected client-role codec that announced `maximum` aliases (it resolves them)."""
    client, server = Connection(CLIENT), Connection(SERVER)
    c = Connect("sub", protocol_level=5, properties=make_properties(topic_alias_maximum=maximum))
    server.receive_data(client.send(c))
    client.receive_data(server.send(Connack()))
    return client


@settings(deadline=None, max_examples=200)
@given(topic, payload, alias, st.booleans())
def test_qos0_alias_bytes_equal_encode(t: str, p: bytes, a: int, retain: bool) -> None:
    first = publish_qos0_alias(t, p, a, True, retain)
    later = publish_qos0_alias(t, p, a, False, retain)
    ap = make_properties(topic_alias=a)
    assert first == encode(Publish(t, p, 0, retain, properties=ap), 5)
    assert later == encode(Publish("", p, 0, retain, properties=ap), 5)
    tpl = PublishTemplate.build(t, p, 0, retain, None, 5)
    assert tpl.aliased(a, True) == first and tpl.aliased(a, False) == later
    got = client_conn().receive_data(first + later)
    assert [(g.topic, g.payload, g.retain, g.properties.topic_alias) for g in got] == [
        (t, p, retain, a)
    ] * 2


@settings(deadline=None, max_examples=300)
@given(
    topic,
    payload,
    st.integers(0, 2),
    st.booleans(),
    st.booleans(),
    publish_props(),
    alias,
    st.integers(1, 0xFFFF),
)
def test_template_aliased_round_trip(
    t: str, p: bytes, qos: int, retain: bool, dup: bool, props: Any, a: int, pid: int
) -> None:
    tpl = PublishTemplate.build(t, p, qos, retain, props, 5)
    first = tpl.aliased(a, True, pid, dup)
    later = tpl.aliased(a, False, pid, dup)
    # 3 bytes of property, and the two lengths may each take one byte more
    assert tpl.size + 3 <= len(first) <= tpl.size + 5
    want = (props or Properties())._replace(topic_alias=a)
    for data in (first, later):  # each parses alone, exactly as `encode` wrote it
        ref = encode(
            Publish(
                t if data is first else "", p, qos, retain, dup and qos > 0, pid if qos else 0, want
            ),
            5,
        )
        assert len(data) == len(ref)
    client = client_conn()
    got = client.receive_data(first)
    if qos:  # a second packet id for the later one (the first is in flight on the client)
        later = tpl.aliased(a, False, pid % 0xFFFF + 1, dup)
    got += client.receive_data(later)
    for g in got:
        assert (g.topic, g.payload, g.qos, g.retain, g.properties) == (t, p, qos, retain, want)
        assert g.dup == (dup and qos > 0)


def test_alias_checks() -> None:
    tpl = PublishTemplate.build("a/b", b"x", 1, False, None, 4)
    with pytest.raises(LocalProtocolError):
        tpl.aliased(1, True, 7)  # no aliases before MQTT 5
    tpl5 = PublishTemplate.build("a/b", b"x", 1, False, None, 5)
    # the later form is kept per alias: another alias or packet id still comes out right
    for alias, pid in ((1, 7), (1, 8), (2, 8), (1, 9)):
        want = encode(
            Publish("", b"x", 1, packet_id=pid, properties=make_properties(topic_alias=alias)), 5
        )
        assert tpl5.aliased(alias, False, pid) == want
    for bad in (0, 0x10000):
        with pytest.raises(LocalProtocolError):
            tpl5.aliased(bad, True, 7)
        with pytest.raises(LocalProtocolError):
            publish_qos0_alias("a/b", b"x", bad, True)


def test_golden_alias_bytes() -> None:
    assert publish_qos0_alias("dev/1", b"hi", 2, True) == (
        b"\x30\x0d"  # PUBLISH QoS 0, remaining length 13
        b"\x00\x05dev/1"  # topic name
        b"\x03\x23\x00\x02"  # properties: length 3, Topic Alias = 2
        b"hi"
    )
    assert publish_qos0_alias("dev/1", b"hi", 2, False) == (
        b"\x30\x08"  # remaining length 8
        b"\x00\x00"  # empty topic name: the receiver takes it from alias 2
        b"\x03\x23\x00\x02"
        b"hi"
    )
    tpl = PublishTemplate.build("t", b"", 1, False, make_properties(content_type="j"), 5)
    assert tpl.aliased(1, False, 9, dup=True) == (
        b"\x3a\x0c"  # PUBLISH QoS 1 DUP, remaining length 12
        b"\x00\x00"  # empty topic
        b"\x00\x09"  # packet id 9
        b"\x07\x23\x00\x01"  # properties: length 7, Topic Alias = 1 first ...
        b"\x03\x00\x01j"  # ... then the template's Content Type "j"
    )


# -- the numbering policy (mqtt_proxy/delivery/topic_aliases.py), sans-IO -----------------------------


def test_book_first_use_until_full() -> None:
    from mqtt_proxy.delivery.topic_aliases import AliasBook

    book = AliasBook(3)
    assert [book.lookup(t) for t in ("a", "b", "a", "c", "d", "b")] == [1, 2, 1, 3, 0, 2]


def test_book_promotes_hot_topics_and_keeps_uniform_traffic_stable() -> None:
    from mqtt_proxy.delivery.topic_aliases import AliasBook

    book = AliasBook(2, window=100)
    book.lookup("cold1"), book.lookup("cold2")
    for _ in range(3):  # uniform over 4 topics for whole windows: nobody moves
        for t in ("cold1", "cold2", "x", "y") * 50:
            book.lookup(t)
    assert book.alias == {"cold1": 1, "cold2": 2}
    for _ in range(200):  # "hot" dominates a window: it takes the coldest number
        book.lookup("hot")
        book.lookup("cold2")
    assert book.alias == {"hot": 1, "cold2": 2} and book.topics[1] == "hot"
    assert book.lookup("cold1") == 0


def test_book_candidates_stay_bounded() -> None:
    from mqtt_proxy.delivery.topic_aliases import AliasBook

    book = AliasBook(4)
    for t in "abcd":
        book.lookup(t)
    for i in range(50_000):  # one-off topics
        book.lookup(f"once/{i}")
        assert len(book.cand) < book.cand_max
    assert set(book.alias) == set("abcd")  # seen once each: never hotter than 8 lookups


def test_out_aliases_per_connection() -> None:
    from mqtt_proxy.delivery.topic_aliases import AliasBook, OutAliases

    book = AliasBook(8, window=10_000)
    a, b = OutAliases(book, 2), OutAliases(book, 2)
    tpl = {t: PublishTemplate.build(t, b"p", 1, False, None, 5) for t in ("t/1", "t/2", "t/3")}
    plain = b"plain"
    got = [a.packet(t, tpl[t], 7, plain) for t in ("t/1", "t/1", "t/2", "t/3")]
    assert got[0] == tpl["t/1"].aliased(1, True, 7)
    assert got[1] == tpl["t/1"].aliased(1, False, 7)
    assert got[2] == tpl["t/2"].aliased(2, True, 7)
    assert got[3] is plain  # alias 3 is beyond this client's maximum of 2
    assert b.packet("t/1", tpl["t/1"], 9, plain) == tpl["t/1"].aliased(1, True, 9)  # own state
    assert a.knows({1: "t/1", 2: "t/2"}) and not b.knows({2: "t/2"})
    book.topics[1] = "t/3"  # the book gave alias 1 to another topic: the client re-learns it
    book.alias = {"t/3": 1, "t/2": 2}
    assert a.packet("t/3", tpl["t/3"], 7, plain) == tpl["t/3"].aliased(1, True, 7)
    assert a.packet("t/1", tpl["t/1"], 7, plain) is plain
    small = OutAliases(book, 5, max_packet=len(tpl["t/2"].packet(1)) + 2)
    assert small.packet("t/2", tpl["t/2"], 7, plain) is plain  # +3 bytes would not fit
    assert small.sent == {}
