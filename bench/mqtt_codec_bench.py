"""MQTT codec throughput: Lightgate's sans-IO codec vs amqtt's packet classes, same bytes.

Parse: ours feeds 64 KiB chunks to `Parser.feed`; amqtt reads each packet field by field with
`await` from an asyncio StreamReader already holding every byte (its broker's read path:
`MQTTFixedHeader.from_stream` then `packet_class(...).from_stream`). Encode: ours
`encode(Publish(...))` (validated event), `encode_publish(...)` (no event) and
`PublishTemplate.packet(pid)` (encode-once fan-out); amqtt `PublishPacket.build(...).to_bytes()`.
Both sides are checked to produce and read the same bytes. Best of --repeat runs.

Run: .venv/bin/python bench/mqtt_codec_bench.py [--n 200000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amqtt.adapters import StreamReaderAdapter  # noqa: E402
from amqtt.mqtt import packet_class  # noqa: E402
from amqtt.mqtt.packet import MQTTFixedHeader  # noqa: E402
from amqtt.mqtt.publish import PublishPacket  # noqa: E402

from mqtt_proxy.codec import (  # noqa: E402
    SERVER,
    Connack,
    Connect,
    Connection,
    Parser,
    Publish,
    PublishTemplate,
    Will,
    encode,
    encode_publish,
)

TOPIC = "sensors/device-0042/temperature"
PAYLOAD = bytes(range(64))
CHUNK = 64 * 1024


def best(fn: Callable[[], int], repeat: int) -> float:
    """Best packets/s over `repeat` runs of fn (which returns the packet count)."""
    rates = []
    for _ in range(repeat):
        t = time.perf_counter()
        n = fn()
        rates.append(n / (time.perf_counter() - t))
    return max(rates)


def ours_parse(stream: bytes, version: int | None, connect: bytes = b"") -> Callable[[], int]:
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]

    def run() -> int:
        p = Parser(version=version, max_packet_size=1 << 20)
        n = 0
        for c in chunks:
            n += len(p.feed(c))
        return n

    return run


def ours_connection(stream: bytes) -> Callable[[], int]:
    """Parser + state machine, as the server uses it."""
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]

    def run() -> int:
        conn = Connection(SERVER)
        conn.receive_data(encode(Connect("bench"), 4))
        conn.send(Connack())
        return sum(len(conn.receive_data(c)) for c in chunks)

    return run


def ours_parse_connects(one: bytes, n: int) -> Callable[[], int]:
    def run() -> int:
        for _ in range(n):
            Parser().feed(one)  # a CONNECT is the first packet of a fresh parser
        return n

    return run


def amqtt_parse(stream: bytes, n: int) -> Callable[[], int]:
    async def read_all() -> int:
        sr = asyncio.StreamReader(limit=len(stream) + 1)
        sr.feed_data(stream)
        sr.feed_eof()
        reader = StreamReaderAdapter(sr)
        for _ in range(n):
            fixed = await MQTTFixedHeader.from_stream(reader)
            assert fixed is not None
            await packet_class(fixed).from_stream(reader, fixed_header=fixed)
        return n

    def run() -> int:
        return asyncio.run(read_all())

    return run


def amqtt_parse_one(stream: bytes) -> list[object]:
    return asyncio.run(_amqtt_packets(stream))


async def _amqtt_packets(stream: bytes) -> list[object]:
    sr = asyncio.StreamReader()
    sr.feed_data(stream)
    sr.feed_eof()
    reader = StreamReaderAdapter(sr)
    out = []
    while not sr.at_eof():
        fixed = await MQTTFixedHeader.from_stream(reader)
        if fixed is None:
            break
        out.append(await packet_class(fixed).from_stream(reader, fixed_header=fixed))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n, rep = args.n, args.repeat
    na = max(n // 10, 1000)  # amqtt is much slower: fewer packets, same per-packet rate

    pub0 = encode(Publish(TOPIC, PAYLOAD), 4)
    pub1 = encode(Publish(TOPIC, PAYLOAD, qos=1, packet_id=1), 4)
    pub0_v5 = encode(Publish(TOPIC, PAYLOAD), 5)
    connect = encode(
        Connect("device-0042", True, 60, "user", b"secret", Will("dev/will", b"gone", 1)), 4
    )
    # same bytes both ways
    assert PublishPacket.build(TOPIC, PAYLOAD, None, False, 0, False).to_bytes() == pub0
    assert PublishPacket.build(TOPIC, PAYLOAD, 1, False, 1, False).to_bytes() == pub1
    amqtt_connect = amqtt_parse_one(connect)[0]
    assert amqtt_connect.to_bytes() == connect  # type: ignore[attr-defined]

    rows: list[tuple[str, float, float | None]] = []

    def row(name: str, ours: float, theirs: float | None) -> None:
        rows.append((name, ours, theirs))
        ratio = f"{ours / theirs:6.1f}x" if theirs else "   n/a"
        amq = f"{theirs:12,.0f}" if theirs else f"{'-':>12}"
        print(f"{name:40s} {ours:12,.0f} {amq} {ratio}", flush=True)

    print(f"CPython {platform.python_version()}, n={n} (amqtt n={na}), best of {rep}")
    print(f"{'packets/s':40s} {'lightgate':>12} {'amqtt':>12} {'ratio':>7}")
    for name, one in (("parse PUBLISH QoS 0, 64 B", pub0), ("parse PUBLISH QoS 1, 64 B", pub1)):
        row(name, best(ours_parse(one * n, 4), rep), best(amqtt_parse(one * na, na), rep))
    row("parse PUBLISH QoS 0, 64 B, MQTT 5", best(ours_parse(pub0_v5 * n, 5), rep), None)
    row(
        "Connection.receive_data PUBLISH QoS 0",
        best(ours_connection(pub0 * n), rep),
        best(amqtt_parse(pub0 * na, na), rep),
    )
    row(
        "parse CONNECT (user, password, will)",
        best(ours_parse_connects(connect, n // 4), rep),
        best(amqtt_parse(connect * na, na), rep),
    )

    def enc_event(qos: int) -> Callable[[], int]:
        def run() -> int:
            for i in range(n):
                encode(Publish(TOPIC, PAYLOAD, qos, packet_id=(i & 0x7FFF) + 1 if qos else 0), 4)
            return n

        return run

    def enc_fn(qos: int) -> Callable[[], int]:
        def run() -> int:
            for i in range(n):
                encode_publish(TOPIC, PAYLOAD, qos, False, False, (i & 0x7FFF) + 1 if qos else 0)
            return n

        return run

    def amqtt_enc(qos: int) -> Callable[[], int]:
        def run() -> int:
            for i in range(na):
                pid = (i & 0x7FFF) + 1 if qos else None
                PublishPacket.build(TOPIC, PAYLOAD, pid, False, qos, False).to_bytes()
            return na

        return run

    tpl = PublishTemplate.build(TOPIC, PAYLOAD, qos=1)

    def fan_out() -> int:
        packet = tpl.packet
        for i in range(n):
            packet((i & 0x7FFF) + 1)
        return n

    for qos in (0, 1):
        row(
            f"encode PUBLISH QoS {qos} (event)",
            best(enc_event(qos), rep),
            best(amqtt_enc(qos), rep),
        )
        row(
            f"encode PUBLISH QoS {qos} (encode_publish)",
            best(enc_fn(qos), rep),
            best(amqtt_enc(qos), rep),
        )
    row("fan-out PUBLISH QoS 1 (template.packet)", best(fan_out, rep), best(amqtt_enc(1), rep))

    ev = Connect("device-0042", True, 60, "user", b"secret", Will("dev/will", b"gone", 1))

    def enc_connect() -> int:
        for _ in range(n // 4):
            encode(ev, 4)
        return n // 4

    def amqtt_enc_connect() -> int:
        for _ in range(na):
            amqtt_connect.to_bytes()  # type: ignore[attr-defined]
        return na

    row("encode CONNECT", best(enc_connect, rep), best(amqtt_enc_connect, rep))


if __name__ == "__main__":
    main()
