"""Inputs for the socket fuzzer: valid MQTT / Kafka sessions from a seeded `random.Random`, and
the mutations that break them.

Valid first, then broken: a random byte stream is refused at the first byte, so it tests little
beyond the framing; a valid session with one length field changed reaches the handlers. Sessions
are lists of packets (MQTT) or frames (Kafka) so that mutations can also duplicate, drop and
reorder whole packets. Everything is drawn from the `random.Random` passed in, so a seed names
the exact bytes.

MQTT packets are encoded by our codec (its round trips against paho, mosquitto and amqtt are
tested elsewhere); Kafka requests are random kio entities of every supported API version, encoded
by kio (generated from Kafka's own schemas), with topic, group and partition values drawn from
small pools so that requests reach existing state rather than stop at "unknown topic".
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import io
import random
import struct
import typing
import uuid
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatchBuilder
from kio.schema.errors import ErrorCode
from kio.serial import entity_writer
from kio.static.constants import EntityType

from mqtt_proxy.codec import (
    Auth,
    Connect,
    Disconnect,
    Pingreq,
    Properties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    TopicSubscription,
    Unsubscribe,
    Will,
    encode,
)
from store.kafka import protocol as kp

TOPICS = ["fz/a", "fz/b/c", "fz/é", "fz", "other/x", "fz/a/b/c/d"]
FILTERS = TOPICS + ["fz/#", "#", "+/a", "fz/+/c", "$share/g/fz/#", "$SYS/#", "$replay/-1m/fz/#"]
KAFKA_TOPICS = ["fz", "other", "fzk", "mqtt", "__consumer_offsets", ""]
GROUPS = ["g1", "g2", ""]
INTERESTING = [0, 1, -1, 2, 7, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, -(2**31)]


# --- MQTT ---------------------------------------------------------------------------------------
def _props(rng: random.Random, kind: str) -> Properties:
    if rng.random() < 0.6:
        return Properties()
    kw: dict[str, Any] = {}
    if rng.random() < 0.3:
        kw["user_properties"] = (("k", "v" * rng.randint(0, 20)),)
    if kind == "connect":
        for name in ("session_expiry_interval", "receive_maximum", "topic_alias_maximum"):
            if rng.random() < 0.4:
                kw[name] = rng.choice([1, 10, 0xFFFF])
        if rng.random() < 0.2:
            kw["maximum_packet_size"] = rng.choice([20, 100, 1 << 20])
        if rng.random() < 0.1:
            kw["authentication_method"] = "SCRAM-SHA-1"
    elif kind == "publish":
        if rng.random() < 0.4:
            kw["topic_alias"] = rng.randint(1, 12)
        if rng.random() < 0.3:
            kw["message_expiry_interval"] = rng.choice([1, 3600])
        if rng.random() < 0.2:
            kw["response_topic"] = rng.choice(TOPICS)
            kw["correlation_data"] = rng.randbytes(4)
    elif kind == "subscribe" and rng.random() < 0.3:
        kw["subscription_identifiers"] = (rng.randint(1, 1000),)
    return Properties(**kw)


def mqtt_session(rng: random.Random) -> list[bytes]:
    """A plausible client session: CONNECT, then a random mix of what clients send."""
    v = rng.choice([3, 4, 5, 5])
    p5 = (lambda kind: _props(rng, kind)) if v == 5 else (lambda kind: Properties())
    will = None
    if rng.random() < 0.3:
        will = Will(rng.choice(TOPICS), rng.randbytes(rng.randint(0, 20)), rng.randint(0, 2),
                    rng.random() < 0.3)  # fmt: skip
    user = rng.choice([None, None, "u", "admin"])
    pw = rng.randbytes(3) if (user is not None or v == 5) and rng.random() < 0.5 else None
    cid = rng.choice(["", f"fz{rng.randint(0, 9)}", "x" * rng.randint(1, 40)])
    packets: list[Any] = [
        Connect(
            cid,
            rng.random() < 0.7,
            rng.choice([0, 1, 60, 0xFFFF]),
            user,
            pw,
            will,
            v,
            p5("connect"),
        )  # fmt: skip
    ]
    pid = 0
    for _ in range(rng.randint(0, 12)):
        pid = pid % 0xFFFF + 1
        r = rng.random()
        if r < 0.25:
            subs = [
                TopicSubscription(rng.choice(FILTERS), rng.randint(0, 2))
                if v != 5
                else TopicSubscription(
                    rng.choice(FILTERS),
                    rng.randint(0, 2),
                    False,
                    rng.random() < 0.5,
                    rng.randint(0, 2),
                )  # fmt: skip
                for _ in range(rng.randint(1, 3))
            ]
            packets.append(Subscribe(pid, subs, p5("subscribe")))
        elif r < 0.6:
            qos = rng.randint(0, 2)
            size = rng.choice([0, 1, 10, 100, 5000]) if rng.random() > 0.01 else 600_000
            packets.append(Publish(rng.choice(TOPICS), rng.randbytes(size), qos,
                                   rng.random() < 0.2, False, pid if qos else 0,
                                   p5("publish")))  # fmt: skip
        elif r < 0.7:
            ack_pid = rng.randint(max(1, pid - 3), pid)  # one of the last packet ids
            packets.append(rng.choice([Puback, Pubrec, Pubrel, Pubcomp])(ack_pid))
        elif r < 0.8:
            packets.append(Unsubscribe(pid, [rng.choice(FILTERS)]))
        elif r < 0.9:
            packets.append(Pingreq())
        elif v == 5 and r < 0.93:
            packets.append(Auth(0x18))
        else:
            packets.append(Disconnect(rng.choice([0, 0x04]) if v == 5 else 0))
    out = []
    for p in packets:
        try:
            out.append(encode(p, v))
        except Exception:  # our encoder refusing a combination it deems invalid: skip that one
            continue
    return out


def ws_upgrade(rng: random.Random, path: str = "/mqtt") -> bytes:
    key = base64.b64encode(rng.randbytes(16)).decode()
    proto = rng.choice(["mqtt", "mqttv3.1", "mqtt, mqttv3.1"])
    return (
        f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
        f"Sec-WebSocket-Protocol: {proto}\r\n\r\n"
    ).encode()


def ws_frame(rng: random.Random, payload: bytes, opcode: int = 2, fin: bool = True) -> bytes:
    """A client frame (masked, RFC 6455 §5.3)."""
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | opcode])
    if n < 126:
        head += bytes([0x80 | n])
    elif n < 65536:
        head += b"\xfe" + n.to_bytes(2, "big")
    else:
        head += b"\xff" + n.to_bytes(8, "big")
    mask = rng.randbytes(4)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def ws_session(rng: random.Random, packets: list[bytes]) -> list[bytes]:
    """MQTT packets in WebSocket frames: one per frame, joined, or split over continuations,
    with the odd ping, text frame or close."""
    out = [ws_upgrade(rng)]
    data = b"".join(packets)
    pos = 0
    while pos < len(data):
        n = rng.randint(1, max(1, len(data) - pos))
        chunk, pos = data[pos : pos + n], pos + n
        if rng.random() < 0.2 and len(chunk) > 1:
            cut = rng.randint(1, len(chunk) - 1)
            out += [ws_frame(rng, chunk[:cut], 2, False), ws_frame(rng, chunk[cut:], 0, True)]
        else:
            out.append(ws_frame(rng, chunk))
        if rng.random() < 0.05:
            out.append(ws_frame(rng, rng.randbytes(rng.randint(0, 8)), rng.choice([1, 9, 10])))
    if rng.random() < 0.3:
        out.append(ws_frame(rng, struct.pack(">H", 1000), 8))
    return out


# --- Kafka --------------------------------------------------------------------------------------
def record_batch(rng: random.Random) -> bytes:
    pid = rng.choice([-1, -1, 0, 1])
    builder = DefaultRecordBatchBuilder(2, rng.choice([0, 0, 1, 2]), 0, pid, 0 if pid >= 0 else -1,
                                        0 if pid >= 0 else -1, 1 << 30)  # fmt: skip
    for i in range(rng.randint(1, 4)):
        key = rng.choice([None, b"k", rng.choice(TOPICS).encode()])
        headers = [("mqtt.qos", b"1")] if rng.random() < 0.3 else []
        builder.append(i, None, key, rng.randbytes(rng.randint(0, 50)), headers)
    return bytes(builder.build())


def _int(rng: random.Random, lo: int, hi: int, name: str) -> int:
    if "partition" in name or name in ("index", "generation_id", "replication_factor"):
        pool = [0, 0, 1, -1, 2, 3, 7] + ([rng.randint(lo, hi)] if rng.random() < 0.05 else [])
    elif "offset" in name:
        pool = [0, 0, 1, -1, -2, 5, 100, hi]
    else:
        pool = [rng.randint(lo, hi), 0, 1, -1] + INTERESTING
    return min(hi, max(lo, rng.choice(pool)))


def _str(rng: random.Random, name: str, hint: Any) -> str:
    if "topic" in name or "Topic" in str(hint) or name == "name":
        return rng.choice(KAFKA_TOPICS)
    if "group" in name or "Group" in str(hint) or name == "key":
        return rng.choice(GROUPS)
    if "member" in name:
        return rng.choice(["", "m-1", "fz-member"])
    return rng.choice(["", "x", "fz", "lightgate.fsync.policy", "retention.ms", "range"])


def _value(rng: random.Random, hint: Any, kind: str | None, name: str, depth: int) -> Any:
    args = typing.get_args(hint)
    if type(None) in args:  # X | None
        if rng.random() < 0.15:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        n = 0 if depth > 3 else rng.choice([0, 1, 1, 1, 2, 3])
        return tuple(_value(rng, args[0], kind, name, depth + 1) for _ in range(n))
    if dataclasses.is_dataclass(hint):
        return random_entity(rng, hint, depth + 1)  # type: ignore[arg-type]
    if kind == "records":
        return record_batch(rng)
    if kind == "string":
        return _str(rng, name, hint)
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 4, 20]))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "uuid":
        return uuid.UUID(bytes=rng.randbytes(16)) if rng.random() < 0.5 else uuid.UUID(int=0)
    if kind == "error_code":
        return rng.choice(list(ErrorCode))
    if kind == "timedelta_i32":
        return datetime.timedelta(milliseconds=rng.choice([0, 1, 100, 2**31 - 1]))
    if kind == "timedelta_i64":
        return datetime.timedelta(milliseconds=rng.choice([0, 1, 100, 2**40]))
    if kind == "datetime_i64":
        return datetime.datetime.fromtimestamp(rng.randint(0, 2**33), datetime.UTC)
    if kind == "float64":
        return rng.random()
    lo, hi = getattr(hint, "__low__", -(2**31)), getattr(hint, "__high__", 2**31 - 1)
    return _int(rng, lo, hi, name)


_HINTS: dict[type, dict[str, Any]] = {}


def random_entity(rng: random.Random, cls: type, depth: int = 0) -> Any:
    """A random instance of a kio entity class: every field drawn by its Kafka type."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        kw[f.name] = _value(rng, hints[f.name], f.metadata.get("kafka_type"), f.name, depth)
    return cls(**kw)


def kafka_request(rng: random.Random, api_key: int, version: int, correlation_id: int) -> bytes:
    """One framed request: kio header (v1 or v2 as the version needs) and a random body."""
    cls = kp._entity_class(api_key, version, EntityType.request)
    header_cls = cls.__header_schema__  # type: ignore[attr-defined]
    header = header_cls(request_api_key=api_key, request_api_version=version,
                        correlation_id=correlation_id, client_id=rng.choice(["fz", None, ""]))  # fmt: skip
    out = io.BytesIO()
    entity_writer(header_cls)(out, header)
    entity_writer(cls)(out, random_entity(rng, cls))
    body = out.getvalue()
    return struct.pack(">i", len(body)) + body


def kafka_session(rng: random.Random) -> list[bytes]:
    """ApiVersions (mostly), then requests of random supported APIs and versions."""
    frames = []
    if rng.random() < 0.8:
        frames.append(kafka_request(rng, 18, rng.randint(0, 3), 0))
    keys = list(kp.SUPPORTED_VERSIONS)
    for cid in range(1, rng.randint(1, 8)):
        key = rng.choice(keys + [0, 0, 1, 3])  # produce, fetch, metadata more often
        lo, hi = kp.SUPPORTED_VERSIONS[key]
        frames.append(kafka_request(rng, key, rng.randint(lo, hi), cid))
    return frames


# --- mutations ----------------------------------------------------------------------------------
def _set_varint(pkt: bytes, value: int) -> bytes:
    """An MQTT packet with its remaining length replaced (a 5-byte varint when value is huge)."""
    i = 1
    while i < len(pkt) and i < 5 and pkt[i] & 0x80:
        i += 1
    enc = bytearray()
    while True:
        b, value = value & 0x7F, value >> 7
        enc.append(b | (0x80 if value else 0))
        if not value:
            break
    return pkt[:1] + bytes(enc) + pkt[i + 1 :]


def mutate(rng: random.Random, packets: list[bytes], proto: str) -> list[bytes]:
    """One to three mutations: bit flips, bytes set, truncation, length fields changed, packets
    duplicated, dropped, reordered, or random bytes inserted."""
    out = list(packets) or [b""]
    for _ in range(rng.randint(1, 3)):
        i = rng.randrange(len(out))
        pkt = bytearray(out[i])
        op = rng.randrange(9)
        if op == 0 and pkt:  # bit flip
            j = rng.randrange(len(pkt))
            pkt[j] ^= 1 << rng.randrange(8)
        elif op == 1 and pkt:  # interesting byte
            pkt[rng.randrange(len(pkt))] = rng.choice([0, 0xFF, 0x7F, 0x80, 0x01])
        elif op == 2 and pkt:  # truncate
            del pkt[rng.randrange(len(pkt)) :]
        elif op == 3 and len(pkt) > 2:  # length field
            if proto == "kafka":
                j = 0 if rng.random() < 0.4 else rng.randrange(4, max(5, len(pkt) - 3))
                width = rng.choice([2, 4]) if j else 4
                v = rng.choice(INTERESTING + [len(pkt), len(pkt) - 5, len(pkt) + 10])
                fmt = ">h" if width == 2 else ">i"
                v = max(-(2 ** (width * 8 - 1)), min(2 ** (width * 8 - 1) - 1, v))
                pkt[j : j + width] = struct.pack(fmt, v)
            else:
                v = rng.choice([0, 1, 2, len(pkt), len(pkt) + 100, 127, 128, 16383, 268_435_455])
                pkt = bytearray(_set_varint(bytes(pkt), v))
        elif op == 4:  # duplicate
            out.insert(i, bytes(pkt))
        elif op == 5 and len(out) > 1:  # drop
            del out[i]
            continue
        elif op == 6 and len(out) > 1:  # swap with another
            k = rng.randrange(len(out))
            out[i], out[k] = out[k], bytes(pkt)
            continue
        elif op == 7:  # insert random bytes
            j = rng.randint(0, len(pkt))
            pkt[j:j] = rng.randbytes(rng.randint(1, 16))
        elif op == 8 and proto == "mqtt" and pkt:  # packet type / flags nibble
            pkt[0] = (rng.randrange(16) << 4) | (
                pkt[0] & 0xF if rng.random() < 0.5 else rng.randrange(16)
            )
        out[i] = bytes(pkt)
    return out


def random_bytes(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.choice([1, 5, 50, 500, 5000]))]
