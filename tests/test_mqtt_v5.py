"""MQTT 5 specifics: every v5 property reaches the Kafka headers, invalid topic aliases end the
connection with 0x94, and CONNACK announces the configured Maximum Packet Size."""

from __future__ import annotations

import pytest
from mqtt_helpers import (
    PUBLISH,
    V5,
    Client,
    props,
    raw,
    read_packets,
)
from mqtt_raw import (
    connect_packet,
    packet,
    parse_connack_props,
    read_until_closed,
    s16,
    varint,
)


def _v5_publish(topic: bytes, payload: bytes, alias: int | None) -> bytes:
    prop = b"" if alias is None else b"\x23" + alias.to_bytes(2, "big")
    return packet(0x30, s16(topic) + varint(len(prop)) + prop + payload)


def test_54_v5_properties_reach_kafka_headers(broker):
    """Every MQTT 5 PUBLISH property is carried through the store to Kafka consumers as the
    `mqtt.*` headers of docs/topic-mapping.md; user properties become plain headers."""
    if not hasattr(broker, "gw"):
        pytest.skip("needs `lightgate serve` (the in-process broker has no Kafka listener)")
    import kafka

    pub = Client(broker.port, "kh-dev", V5).connect()
    p = props(
        PUBLISH,
        PayloadFormatIndicator=1,
        MessageExpiryInterval=3600,
        ContentType="application/json",
        ResponseTopic="kh/reply",
        CorrelationData=b"\x00\xffid",
        UserProperty=[("site", "north"), ("line", "7")],
    )
    pub.publish("kh/sensor/1", b'{"t": 21}', 1, props=p)
    pub.publish("kh/sensor/2", b"plain", 2)
    pub.disconnect()
    consumer = kafka.KafkaConsumer(
        "kh", bootstrap_servers=f"127.0.0.1:{broker.gw.port('kafka')}",
        auto_offset_reset="earliest", consumer_timeout_ms=15_000,
    )  # fmt: skip
    try:
        got = {}
        for rec in consumer:
            got[rec.key] = rec
            if len(got) == 2:
                break
    finally:
        consumer.close()
    rec = got[b"kh/sensor/1"]
    assert rec.value == b'{"t": 21}'
    h = dict(rec.headers)
    assert h["mqtt.qos"] == b"1" and h["mqtt.client_id"] == b"kh-dev"
    assert h["mqtt.payload_format"] == b"1"
    assert h["mqtt.message_expiry"] == b"3600"
    assert h["mqtt.content_type"] == b"application/json"
    assert h["mqtt.response_topic"] == b"kh/reply"
    assert h["mqtt.correlation_data"] == b"\x00\xffid"
    assert h["site"] == b"north" and h["line"] == b"7"
    plain = dict(got[b"kh/sensor/2"].headers)
    assert plain["mqtt.qos"] == b"2"
    assert not [k for k in plain if k not in ("mqtt.qos", "mqtt.client_id")]


def test_65_invalid_topic_alias_disconnects_0x94(broker):
    """v5 PUBLISH with Topic Alias 0, or one above the Topic Alias Maximum of our CONNACK:
    DISCONNECT 0x94 and close; nothing stored from it; others unaffected. The maximum itself
    is usable."""
    sub = Client(broker.port, "ta-sub").connect()
    sub.subscribe("ta/#", 0)
    s = raw(broker.port)
    s.sendall(connect_packet(b"ta-probe", 5))
    (connack,) = read_packets(s, 1)
    alias_max = parse_connack_props(connack)[0x22]
    assert alias_max >= 1
    s.sendall(_v5_publish(b"ta/max", b"ok", alias_max) + _v5_publish(b"", b"again", alias_max))
    assert [m.payload for m in sub.expect(2)] == [b"ok", b"again"]
    s.close()
    for alias in (0, alias_max + 1):
        s = raw(broker.port)
        s.sendall(connect_packet(b"ta-bad", 5))
        assert read_packets(s, 1)[0][0] == 0x20
        s.sendall(_v5_publish(b"ta/bad", b"bad", alias))
        pkts = read_until_closed(s)
        assert pkts and pkts[-1][0] == 0xE0 and pkts[-1][2] == 0x94, (alias, pkts)
        s.close()
    sub.expect_none(0.3)
    Client(broker.port, "ta-pub").connect().publish("ta/after", b"fine", 1)
    assert sub.expect(1)[0].payload == b"fine"
    sub.disconnect()


def test_66_connack_maximum_packet_size_is_the_configured_one(gateway_factory, tmp_path):
    """`max_packet_size` (--set) is what a v5 CONNACK announces, and is enforced at that size:
    a PUBLISH of exactly the maximum is accepted, one byte more is DISCONNECT 0x95."""
    limit = 3000
    gw = gateway_factory(tmp_path / "mps", "--set", f"max_packet_size={limit}")
    port = gw.port("mqtt")
    c = Client(port, "mps-paho", V5).connect()
    assert c.connack_props.MaximumPacketSize == limit
    c.disconnect()
    sub = Client(port, "mps-sub").connect()
    sub.subscribe("mps/#", 1)

    def publish_of_size(size: int) -> tuple[bytes, int]:
        """A QoS 0 PUBLISH of exactly `size` bytes on the wire, and its payload length."""
        head = s16(b"mps/t") + b"\x00"  # topic, empty properties
        n = size - 1 - len(head)
        n -= len(varint(len(head) + n))
        pkt = packet(0x30, head + b"p" * n)
        assert len(pkt) == size
        return pkt, n

    s = raw(port)
    s.sendall(connect_packet(b"mps-raw", 5))
    (connack,) = read_packets(s, 1)
    assert parse_connack_props(connack)[0x27] == limit
    pkt, n = publish_of_size(limit)
    s.sendall(pkt)
    (m,) = sub.expect(1)
    assert m.payload == b"p" * n
    s.sendall(publish_of_size(limit + 1)[0])
    pkts = read_until_closed(s)
    assert pkts and pkts[-1][0] == 0xE0 and pkts[-1][2] == 0x95, pkts
    s.close()
    sub.expect_none(0.3)
    sub.disconnect()
