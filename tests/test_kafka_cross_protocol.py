"""MQTT ⇄ Kafka over one log, at the store boundary the MQTT proxy uses (`append_mqtt`) and the one
the light-queue dispatcher uses (`mapping.mqtt_view` over stored records). The paho end-to-end
versions join these once `lightgate serve` wires the MQTT proxy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from kafka_helpers import running_gateway

from store.mapping import (
    MqttMessage,
    MqttProperties,
    log_topic_for,
    mqtt_view,
    partition_for_key,
)
from store.record_batch import iter_batch_headers, iter_records

pytestmark = pytest.mark.timeout(60)


async def read_all(bootstrap: str, topic: str, n: int) -> list:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    out: list = []
    try:
        deadline = time.monotonic() + 15
        while len(out) < n and time.monotonic() < deadline:
            for msgs in (await consumer.getmany(timeout_ms=200)).values():
                out.extend(msgs)
    finally:
        await consumer.stop()
    return out


def stored_records(store, topic: str, partition: int) -> list:
    data = store.read(topic, partition, 0, 1 << 20)
    out, pos = [], 0
    for h in iter_batch_headers(data):
        out += list(iter_records(data[pos : pos + h.size]))
        pos += h.size
    return out


async def test_mqtt_publish_reaches_kafka_consumer_with_key_and_headers(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data", partitions=4) as gw:
        props = MqttProperties(content_type="text/plain", user_properties=(("unit", "C"),))
        msg = MqttMessage("factory/line1/temp", b"21.5", 1, "dev-1", properties=props)
        gw.store.ensure_topic("factory")
        await gw.store.append_mqtt([msg]).durable
        (rec,) = await read_all(gw.bootstrap, "factory", 1)
        assert (rec.key, rec.value) == (b"factory/line1/temp", b"21.5")
        headers = dict(rec.headers)
        assert headers["mqtt.qos"] == b"1" and headers["mqtt.client_id"] == b"dev-1"
        assert headers["mqtt.content_type"] == b"text/plain"
        assert headers["unit"] == b"C"  # an MQTT 5 user property arrives as a Kafka header
        # MQTT writes partition like Kafka's default partitioner on the key: one MQTT topic,
        # one partition, whichever protocol wrote it
        assert rec.partition == partition_for_key(b"factory/line1/temp", 4)


async def test_kafka_record_maps_to_mqtt_topic_and_properties(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data", partitions=4) as gw:
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap, acks="all")
        await producer.start()
        try:
            key = b"factory/line2/cmd"
            meta = await producer.send_and_wait(
                "factory", b'{"on":1}', key=key,
                headers=[("mqtt.content_type", b"application/json"), ("trace", b"abc")],
            )  # fmt: skip
            other = await producer.send_and_wait("factory", b"no-key", partition=meta.partition)
        finally:
            await producer.stop()
        # the Java/aiokafka default partitioner and the MQTT side agree on the partition
        assert meta.partition == partition_for_key(key, 4)
        recs = stored_records(gw.store, "factory", meta.partition)
        assert [r.offset for r in recs] == [meta.offset, other.offset]
        view = mqtt_view("factory", recs[0].key, recs[0].headers)
        assert view.topic == "factory/line2/cmd"
        assert view.properties is not None
        assert view.properties.content_type == "application/json"
        assert view.properties.user_properties == (("trace", "abc"),)
        assert mqtt_view("factory", recs[1].key, recs[1].headers).topic == "factory"


async def test_escaped_first_level_round_trips_through_kafka(tmp_path: Path) -> None:
    async with running_gateway(tmp_path / "data") as gw:
        mqtt_topic = "my building/floor 2"
        log_topic = log_topic_for(mqtt_topic)
        assert log_topic != "my building" and gw.server.broker.legal_topic(log_topic)
        producer = AIOKafkaProducer(bootstrap_servers=gw.bootstrap)
        await producer.start()
        try:
            await producer.send_and_wait(log_topic, b"v", key=mqtt_topic.encode())
        finally:
            await producer.stop()
        (rec,) = await read_all(gw.bootstrap, log_topic, 1)
        assert mqtt_view(log_topic, rec.key, list(rec.headers)).topic == mqtt_topic
        tp = TopicPartition(log_topic, 0)
        assert gw.store.high_watermark(tp.topic, tp.partition) == 1
