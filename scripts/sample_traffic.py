"""Sample device traffic through a running gateway: MQTT devices (paho, v3.1.1 and v5) and a Kafka
producer (aiokafka), for the analytics notebook and demos.

    .venv/bin/lightgate serve --data-dir ./data &
    .venv/bin/python scripts/sample_traffic.py --mqtt 127.0.0.1:1883 --kafka 127.0.0.1:9092

Devices `dev-NN` publish JSON telemetry `{"temp", "hum", "battery", "ts"}` on
`sensors/dev-NN/telemetry`; `ts` (the event time) spreads the run over the last `--span-minutes`,
so a short run still fills many analytics windows. The Kafka producer writes to the same log topic
with MQTT-topic keys (`sensors/gw-N/telemetry`) and no client id.

What an analyst will see with the defaults (docs/spark.md, "The notebook"):
- rates (broker receive time): every device sends `--rate` msg/s for `--seconds`, so about 4 msg/s
  per device in the one or two minutes of the run (partial windows are scaled to the seconds they
  cover);
- telemetry (event time): windows over the last `--span-minutes`; about 1 % of readings carry a `ts`
  20 minutes old. A fresh telemetry run (the notebook's `fresh=True`, or a new `--out`) keeps them:
  the whole log is one micro-batch, read before any watermark exists. Only when the job runs
  incrementally -- once before and once after such readings arrive -- are readings more than
  `--watermark` (10 minutes) behind the newest event time seen dropped and counted;
- sessions: dev-00, dev-04, dev-08 (every 4th) disconnect halfway and reconnect 1 s later (the
  other devices pause for that second too, and catch up); dev-01, dev-06,
  dev-11 (i % 5 == 1) drop their connection without DISCONNECT at the end;
- top talkers: `--devices` + `--gateways` devices with `--seconds * --rate` messages each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any


def _addr(text: str) -> tuple[str, int] | None:
    if not text:
        return None
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


class Device:
    """One MQTT device on its own paho network thread."""

    def __init__(self, idx: int, addr: tuple[str, int]) -> None:
        import paho.mqtt.client as mqtt

        self.name = f"dev-{idx:02d}"
        self.qos = 1 if idx % 2 == 0 else 0
        proto = mqtt.MQTTv5 if idx % 3 == 0 else mqtt.MQTTv311
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=self.name, protocol=proto
        )
        self.addr = addr
        self.sent = 0
        self.pending: list[Any] = []
        self.battery = 100.0 - idx

    def connect(self) -> None:
        self.client.connect(*self.addr, keepalive=30)
        self.client.loop_start()
        deadline = time.monotonic() + 10
        while not self.client.is_connected():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no CONNACK from {self.addr}")
            time.sleep(0.01)

    def publish(self, event_ms: int, phase: float, late: bool) -> None:
        self.battery = max(0.0, self.battery - 0.05)
        body = {
            "temp": round(21 + 4 * math.sin(phase) + random.gauss(0, 0.3), 2),
            "hum": round(45 + 10 * math.cos(phase / 2) + random.gauss(0, 1), 1),
            "battery": round(self.battery, 2),
            "ts": event_ms - (20 * 60_000 if late else 0),
        }
        info = self.client.publish(f"sensors/{self.name}/telemetry", json.dumps(body), qos=self.qos)
        if self.qos:
            self.pending.append(info)
        self.sent += 1

    def settle(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for info in self.pending:
            info.wait_for_publish(max(0.0, deadline - time.monotonic()))
        self.pending.clear()

    def disconnect(self, clean: bool = True) -> None:
        self.settle()
        if clean:
            self.client.disconnect()
            self.client.loop_stop()
        else:  # vanish: the gateway sees the connection drop without DISCONNECT
            self.client.loop_stop()
            sock = self.client.socket()
            if sock is not None:
                sock.close()


async def run(args: argparse.Namespace) -> dict[str, int]:
    random.seed(args.seed)
    mqtt_addr, kafka_addr = _addr(args.mqtt), _addr(args.kafka)
    devices = [Device(i, mqtt_addr) for i in range(args.devices)] if mqtt_addr else []
    for d in devices:
        d.connect()
    producer = None
    if kafka_addr:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(
            bootstrap_servers=f"{kafka_addr[0]}:{kafka_addr[1]}", linger_ms=20, acks=1
        )
        await producer.start()
    steps = max(1, int(args.seconds * args.rate))
    span = args.span_minutes * 60_000
    start = int(time.time() * 1000) - span
    kafka_sent = 0
    t0 = time.monotonic()
    for step in range(steps):
        event_ms = start + int(span * step / steps)
        phase = 2 * math.pi * step / max(1, steps // 3)
        if step == steps // 2:  # every 4th device reconnects: a 1 s offline gap in sessions
            for d in devices[::4]:
                d.disconnect()
            await asyncio.sleep(1.0)  # long enough to see on the sessions chart
            for d in devices[::4]:
                d.connect()
        for d in devices:
            d.publish(event_ms, phase + hash(d.name) % 7, late=random.random() < 0.01)
        if producer is not None:
            for g in range(args.gateways):
                value = {"temp": round(18 + 3 * math.sin(phase + g), 2), "ts": event_ms}
                await producer.send(
                    "sensors",
                    key=f"sensors/gw-{g}/telemetry".encode(),
                    value=json.dumps(value).encode(),
                    headers=[("source", b"kafka")],
                )
                kafka_sent += 1
        await asyncio.sleep(max(0.0, t0 + (step + 1) / args.rate - time.monotonic()))
    if producer is not None:
        await producer.flush()
        await producer.stop()
    for i, d in enumerate(devices):
        d.disconnect(clean=i % 5 != 1)
    return {"mqtt": sum(d.sent for d in devices), "kafka": kafka_sent}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Send sample MQTT + Kafka device traffic.")
    ap.add_argument("--mqtt", default="127.0.0.1:1883", help="MQTT host:port ('' to skip)")
    ap.add_argument("--kafka", default="127.0.0.1:9092", help="Kafka host:port ('' to skip)")
    ap.add_argument("--devices", type=int, default=12, help="MQTT devices (default 12)")
    ap.add_argument("--gateways", type=int, default=2, help="Kafka-side pseudo devices (default 2)")
    ap.add_argument("--seconds", type=float, default=15, help="run time (default 15)")
    ap.add_argument("--rate", type=float, default=4, help="messages/s per device (default 4)")
    ap.add_argument("--span-minutes", type=int, default=30, help="event-time span (default 30)")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    counts = asyncio.run(run(args))
    print(f"sent {counts['mqtt']} MQTT and {counts['kafka']} Kafka messages", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
