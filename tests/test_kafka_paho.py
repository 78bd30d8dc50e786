"""Cross-protocol end to end: paho MQTT clients and aiokafka on one gateway, one log.

The gateway runs in a background thread (real Store, light queues, notifier, `MqttServer`, and the
`KafkaServer` on the same store), as `tests/mqtt_broker.py` does for the MQTT tests.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from mqtt_broker import open_queues
from mqtt_helpers import PUBLISH, V5, Client, props

pytestmark = pytest.mark.timeout(120)


class MixedGateway:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.mqtt_port = self.kafka_port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> MixedGateway:
        ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.result(timeout=60)
        return self

    def _run(self, ready: Future[None]) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(ready))
        except BaseException as exc:  # surfaced through `ready`
            if not ready.done():
                ready.set_exception(exc)
        finally:
            loop.close()

    async def _main(self, ready: Future[None]) -> None:
        from mqtt_proxy.backends.backend import LocalBackend
        from mqtt_proxy.server import MqttServer
        from mqtt_proxy.settings import ProxySettings
        from store import Store, StoreConfig
        from store.kafka import KafkaConfig, KafkaServer

        self._stop = asyncio.Event()
        store = await Store.open(self.data_dir, StoreConfig(fsync="always", default_partitions=2))
        queues, notifier, closers = await open_queues(store, self.data_dir)
        settings = ProxySettings()
        backend = LocalBackend(store, queues, notifier, "mqtt-0", settings.recent_cache_bytes)
        mqtt = MqttServer(backend, settings)
        _, self.mqtt_port = await mqtt.start_tcp("127.0.0.1", 0)
        kafka = KafkaServer(store, "127.0.0.1", 0, KafkaConfig())
        await kafka.start()
        self.kafka_port = kafka.port
        ready.set_result(None)
        await self._stop.wait()
        await kafka.close()
        await mqtt.close()
        for close in closers:
            await close()
        await store.close()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)


@pytest.fixture
def mixed(tmp_path: Path) -> Iterator[MixedGateway]:
    gw = MixedGateway(tmp_path / "data").start()
    try:
        yield gw
    finally:
        gw.stop()


async def in_thread(fn: Any, *args: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def test_kafka_record_reaches_mqtt_wildcard_subscriber(mixed: MixedGateway) -> None:
    sub = await in_thread(lambda: Client(mixed.mqtt_port, "sub-1", V5).connect())
    try:
        await in_thread(lambda: sub.subscribe("factory/+/cmd", qos=1))
        producer = AIOKafkaProducer(bootstrap_servers=f"127.0.0.1:{mixed.kafka_port}", acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(
                "factory", b'{"on":true}', key=b"factory/line2/cmd",
                headers=[("mqtt.content_type", b"application/json"), ("trace", b"abc")],
            )  # fmt: skip
        finally:
            await producer.stop()
        (msg,) = await in_thread(lambda: sub.expect(1, timeout=20))
        assert (msg.topic, msg.payload) == ("factory/line2/cmd", b'{"on":true}')
        assert msg.props.ContentType == "application/json"
        assert msg.user_props == {"trace": "abc"}
    finally:
        await in_thread(sub.disconnect)


async def test_mqtt5_user_property_arrives_as_kafka_header(mixed: MixedGateway) -> None:
    pub = await in_thread(lambda: Client(mixed.mqtt_port, "dev-7", V5).connect())
    try:
        p = props(PUBLISH, UserProperty=[("unit", "C")], ContentType="text/plain")
        await in_thread(lambda: pub.publish("factory/line1/temp", b"21.5", qos=1, props=p))
    finally:
        await in_thread(pub.disconnect)
    consumer = AIOKafkaConsumer("factory", bootstrap_servers=f"127.0.0.1:{mixed.kafka_port}",
                                auto_offset_reset="earliest")  # fmt: skip
    await consumer.start()
    got: list = []
    try:
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            for msgs in (await consumer.getmany(timeout_ms=200)).values():
                got += msgs
    finally:
        await consumer.stop()
    (rec,) = got
    assert (rec.key, rec.value) == (b"factory/line1/temp", b"21.5")
    headers = dict(rec.headers)
    assert headers["unit"] == b"C"
    assert headers["mqtt.content_type"] == b"text/plain"
    assert headers["mqtt.qos"] == b"1" and headers["mqtt.client_id"] == b"dev-7"
