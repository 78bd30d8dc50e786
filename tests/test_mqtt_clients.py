"""Other real clients against the gateway: Debian's mosquitto_pub/mosquitto_sub and amqtt's
client (3.1.1), plus `$SYS` statistics, replay from the log and the device-events log topic."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time

import pytest
from mqtt_helpers import SUBSCRIBE, V5, Client, props

MOSQ = shutil.which("mosquitto_sub") and shutil.which("mosquitto_pub")
needs_mosquitto = pytest.mark.skipif(
    not MOSQ, reason="mosquitto-clients not installed (make test installs it where apt works)"
)


@needs_mosquitto
def test_40_mosquitto_pub_sub(broker):
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", "mq/#", "-q", "1",
         "-C", "3", "-v", "-i", "mosq-sub"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.5)
    for i in range(3):
        subprocess.run(
            ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.port), "-t", f"mq/{i}",
             "-m", f"hello {i}", "-q", "1"],
            check=True, timeout=10,
        )  # fmt: skip
    out, _ = sub.communicate(timeout=10)
    assert out.splitlines() == [f"mq/{i} hello {i}" for i in range(3)]


@needs_mosquitto
def test_41_mosquitto_v5_properties(broker):
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-V", "mqttv5", "-t", "m5/t",
         "-C", "1", "-F", "%t %p %P", "-i", "mosq-sub5"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(0.5)
    subprocess.run(
        ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.port), "-V", "mqttv5", "-t", "m5/t",
         "-m", "v5", "-D", "publish", "user-property", "site", "north"],
        check=True, timeout=10,
    )  # fmt: skip
    out, _ = sub.communicate(timeout=10)
    assert out.strip() == "m5/t v5 site:north"


def test_42_amqtt_client(broker):
    from amqtt.client import MQTTClient

    async def run() -> list[tuple[str, bytes]]:
        sub = MQTTClient(client_id="amqtt-sub")
        await sub.connect(f"mqtt://127.0.0.1:{broker.port}/")
        await sub.subscribe([("am/#", 1)])
        pub = MQTTClient(client_id="amqtt-pub")
        await pub.connect(f"mqtt://127.0.0.1:{broker.port}/")
        for i in range(3):
            await pub.publish(f"am/{i}", f"a{i}".encode(), qos=1)
        got = []
        for _ in range(3):
            msg = await asyncio.wait_for(sub.deliver_message(), 10)
            got.append((msg.topic, bytes(msg.data)))
        await pub.disconnect()
        await sub.disconnect()
        return got

    assert asyncio.run(run()) == [(f"am/{i}", f"a{i}".encode()) for i in range(3)]


def test_43_sys_topics(broker):
    c = Client(broker.port, "sys").connect()
    c.subscribe("$SYS/broker/#")
    first = {m.topic: m for m in c.expect(10)}
    assert first["$SYS/broker/version"].retain
    assert first["$SYS/broker/clients/connected"].payload == b"1"
    for name in ("uptime", "messages/received", "messages/sent", "bytes/received", "bytes/sent"):
        assert f"$SYS/broker/{name}" in first
    periodic = c.expect(1, timeout=5)[0]  # sys_interval_s = 1 in the fixture
    assert periodic.topic.startswith("$SYS/broker/") and not periodic.retain


def test_44_replay_from_log(broker):
    pub = Client(broker.port, "p").connect()
    for i in range(5):
        pub.publish(f"hist/{i % 2}", f"old{i}", 1)
    time.sleep(0.3)
    c = Client(broker.port, "replayer").connect()
    c.subscribe("$replay/-1h/hist/#", 1)
    old = c.expect(5)
    assert sorted(m.payload for m in old) == sorted(f"old{i}".encode() for i in range(5))
    assert {m.topic for m in old} == {"hist/0", "hist/1"}  # original topics
    pub.publish("hist/0", b"new", 1)
    assert c.expect(1)[0].payload == b"new"  # continues live, no gap
    c.expect_none(0.5)  # and no duplicate
    plain = Client(broker.port, "plain").connect()
    plain.subscribe("hist/#", 1)
    plain.expect_none(0.5)  # a plain subscription starts live


def test_45_replay_since_user_property_v5(broker):
    pub = Client(broker.port, "p").connect()
    pub.publish("rp/a", b"before", 1)
    time.sleep(0.3)
    since = str(int(time.time() * 1000) - 60_000)
    c = Client(broker.port, "rp5", V5).connect()
    c.subscribe("rp/+", 1, props=props(SUBSCRIBE, UserProperty=[("replay-since", since)]))
    assert [m.payload for m in c.expect(1)] == [b"before"]
    pub.publish("rp/a", b"after", 1)
    assert [m.payload for m in c.expect(1)] == [b"after"]


def test_46_device_events_in_log(broker):
    c = Client(broker.port, "dev-42").connect()
    c.disconnect()
    time.sleep(0.3)
    events = [
        json.loads(r.value)
        for r in broker.records("__lightgate_device_events")
        if r.key == b"dev-42"
    ]
    assert [e["event"] for e in events] == ["connect", "disconnect"]
    assert events[0]["client_id"] == "dev-42" and events[0]["remote"].startswith("127.0.0.1:")
    assert events[1]["reason"] == "disconnect" and events[1]["ts"] >= events[0]["ts"]
    watcher = Client(broker.port, "w").connect()
    watcher.subscribe("#")
    Client(broker.port, "dev-43").connect().disconnect()
    watcher.expect_none(0.5)  # internal topic: never delivered to MQTT wildcards


def test_46b_device_events_use_kafkas_partitioner(broker):
    """A client's events sit in the partition Kafka's default partitioner picks for its id."""
    from store import segment_reader as sr
    from store.mapping import partition_for_key

    for i in range(12):
        Client(broker.port, f"part-{i}").connect().disconnect()
    time.sleep(0.3)
    parts = sr.list_topics(broker.data_dir)["__lightgate_device_events"]
    seen = set()
    for part in range(parts):
        for r in sr.iter_records_from(broker.data_dir, "__lightgate_device_events", part):
            if r.key.startswith(b"part-"):
                assert partition_for_key(r.key, parts) == part, (r.key, part)
                seen.add(r.key)
    assert len(seen) == 12 and parts > 1
