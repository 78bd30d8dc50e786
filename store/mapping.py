"""MQTT ⇄ log mapping: topics, partitions, and MQTT metadata ⇄ record headers.

Rules (outside contract in docs/interfaces.md, escaping in docs/topic-mapping.md):
- An MQTT topic maps to the log topic named by its first level; first levels that are not valid
  Kafka topic names (or that start with the escape prefix) are escaped reversibly.
- partition = (murmur2(key) & 0x7fffffff) % partitions, Kafka's default partitioner, so a Kafka
  producer that keys by MQTT topic lands in the same partition as the gateway.
- Headers carry MQTT metadata under `mqtt.`; user properties are plain headers, except those whose
  name starts with `mqtt.`, which are stored as `mqtt.user.<name>` so they cannot be mistaken for ours.
- The gateway's own log topics start with `__lightgate` (SYSTEM_TOPIC_PREFIX); their names are
  defined here and nowhere else.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass

from store.twins import twin

ESCAPE_PREFIX = "_x."  # marks an escaped first level (a valid Kafka name itself)
HASHED_PREFIX = "_h."  # an escaped level too long for 249 bytes: not reversible (documented)
MAX_TOPIC_LEN = 249
_KAFKA_NAME = re.compile(r"[a-zA-Z0-9._-]+\Z")
_KEEP = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-")

H_QOS = "mqtt.qos"
H_CLIENT_ID = "mqtt.client_id"
H_RETAIN = "mqtt.retain"
H_PAYLOAD_FORMAT = "mqtt.payload_format"
H_MESSAGE_EXPIRY = "mqtt.message_expiry"
H_CONTENT_TYPE = "mqtt.content_type"
H_RESPONSE_TOPIC = "mqtt.response_topic"
H_CORRELATION_DATA = "mqtt.correlation_data"
USER_PREFIX = "mqtt.user."


class TopicMappingError(ValueError):
    """An MQTT topic that cannot be stored (empty, `$`-topic, wildcard, NUL)."""


@dataclass(frozen=True, slots=True)
class MqttProperties:
    payload_format: int | None = None
    message_expiry: int | None = None  # seconds
    content_type: str | None = None
    response_topic: str | None = None
    correlation_data: bytes | None = None
    user_properties: tuple[tuple[str, str], ...] = ()


# Not frozen: a frozen dataclass sets each field through object.__setattr__, 2.5 us per message
# vs 0.5 us here, on the per-PUBLISH path. Treat it as immutable anyway (unsafe_hash keeps the
# value hash the frozen version had).
@dataclass(slots=True, unsafe_hash=True)
class MqttMessage:
    topic: str  # full MQTT topic
    payload: bytes
    qos: int
    client_id: str
    retain: bool = False
    properties: MqttProperties | None = None  # v5 metadata carried into headers
    timestamp_ms: int = 0  # 0 = now (broker receive time)


@dataclass(frozen=True, slots=True)
class MqttView:
    """How an MQTT subscriber sees a stored record (reverse mapping)."""

    topic: str
    qos: int
    client_id: str
    retain: bool
    properties: MqttProperties | None


# --- the gateway's own log topics ----------------------------------------------------------
# Written by the gateway for itself, never MQTT messages: the dispatcher does not index them (the
# probes' topic excepted, into exact-topic queues only), the proxy never delivers them to
# subscribers, Kafka's Metadata marks them internal, Spark lists them only when named.
SYSTEM_TOPIC_PREFIX = "__lightgate"
DEVICE_EVENTS_TOPIC = "__lightgate_device_events"  # connect/disconnect events (device_events.py)
PROBE_TOPIC = "__lightgate_probe"  # latency probes publish on PROBE_TOPIC/<id> (lightgate/probe.py)
PROBE_CLIENT_PREFIX = "__lightgate_probe"  # the probes' MQTT client ids: not devices


def internal_password(secret: bytes, client_id: str) -> bytes:
    """The password that proves an internal client (a latency probe) to the MQTT listener: an
    HMAC of its client id under a secret the gateway makes at start and hands only to its own
    processes. Without it an internal client id is refused, so no device can hide its traffic
    from users' figures or pass the ACL by taking the probe's name."""
    return hmac.new(secret, client_id.encode(), hashlib.sha256).hexdigest().encode()


def is_internal_client(client_id: str) -> bool:
    """An MQTT client of the gateway itself (a latency probe): counted apart from users'."""
    return client_id.startswith(PROBE_CLIENT_PREFIX)


def is_system_topic(log_topic: str) -> bool:
    """A log topic the gateway writes for itself (device events, latency probes)."""
    return log_topic.startswith(SYSTEM_TOPIC_PREFIX)


# --- topics --------------------------------------------------------------------------------


def is_valid_log_topic(name: str) -> bool:
    return (
        0 < len(name) <= MAX_TOPIC_LEN
        and name not in (".", "..")
        and _KAFKA_NAME.match(name) is not None
    )


def escape_level(level: str) -> str:
    """Log topic for an MQTT first level (see docs/topic-mapping.md)."""
    if is_valid_log_topic(level) and not level.startswith((ESCAPE_PREFIX, HASHED_PREFIX)):
        return level
    keep = _KEEP
    enc = "".join(chr(b) if b in keep else f"_{b:02x}" for b in level.encode("utf-8"))
    name = ESCAPE_PREFIX + enc
    if len(name) <= MAX_TOPIC_LEN:
        return name
    digest = hashlib.sha256(level.encode("utf-8")).hexdigest()[:40]
    return HASHED_PREFIX + enc[: MAX_TOPIC_LEN - len(HASHED_PREFIX) - 41] + "." + digest


def first_level_for(log_topic: str) -> str:
    """Inverse of `escape_level`; raises TopicMappingError for a hashed (irreversible) name."""
    if not log_topic.startswith(ESCAPE_PREFIX):
        if log_topic.startswith(HASHED_PREFIX):
            raise TopicMappingError(f"log topic {log_topic!r} is a hashed first level")
        return log_topic
    enc = log_topic[len(ESCAPE_PREFIX) :]
    out = bytearray()
    i, n = 0, len(enc)
    while i < n:
        c = enc[i]
        if c == "_":
            hx = enc[i + 1 : i + 3]
            if len(hx) != 2 or hx != hx.lower() or not all(ch in "0123456789abcdef" for ch in hx):
                raise TopicMappingError(f"bad escape in log topic {log_topic!r}")
            out.append(int(hx, 16))
            i += 3
        else:
            out.append(ord(c))
            i += 1
    try:
        level = out.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TopicMappingError(f"log topic {log_topic!r} is not UTF-8 once unescaped") from e
    if escape_level(level) != log_topic:  # only the canonical spelling is a valid escape
        raise TopicMappingError(f"log topic {log_topic!r} is not a canonical escape")
    return level


def check_publish_topic(topic: str) -> None:
    """Refuse what must never be stored: empty, `$`-topics (broker-owned), wildcards, NUL."""
    if not topic:
        raise TopicMappingError("empty MQTT topic")
    if topic[0] == "$":
        raise TopicMappingError(f"MQTT topic {topic!r} starts with '$' and is never stored")
    if "+" in topic or "#" in topic or "\x00" in topic:
        raise TopicMappingError(f"MQTT topic {topic!r} contains a wildcard or NUL")


def log_topic_for(mqtt_topic: str) -> str:
    """Log topic of an MQTT topic: its escaped first level. `$`-topics raise."""
    check_publish_topic(mqtt_topic)
    i = mqtt_topic.find("/")
    return escape_level(mqtt_topic if i < 0 else mqtt_topic[:i])


def is_valid_mqtt_topic(topic: str) -> bool:
    try:
        check_publish_topic(topic)
    except TopicMappingError:
        return False
    return len(topic.encode("utf-8")) <= 65535


# --- partitions ----------------------------------------------------------------------------


def murmur2_py(data: bytes) -> int:
    """Kafka's `Utils.murmur2` (signed 32-bit result), bit for bit (the reference of the
    compiled `store._cmapping.murmur2`, bound to `murmur2` at the end of this module)."""
    length = len(data)
    m = 0x5BD1E995
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    n4 = length & ~3
    for i in range(0, n4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> 24
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    extra = length & 3
    if extra == 3:
        h ^= data[n4 + 2] << 16
    if extra >= 2:
        h ^= data[n4 + 1] << 8
    if extra >= 1:
        h ^= data[n4]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for_key(key: bytes, partitions: int) -> int:
    """Kafka's default partitioner for a keyed record: toPositive(murmur2(key)) % partitions."""
    return (_murmur2(key) & 0x7FFFFFFF) % partitions


# --- headers -------------------------------------------------------------------------------

_QOS_BYTES = (b"0", b"1", b"2")


def headers_for(msg: MqttMessage) -> list[tuple[str, bytes | None]]:
    """Record headers carrying the MQTT metadata of `msg` (docs/topic-mapping.md, "Headers")."""
    hs: list[tuple[str, bytes | None]] = [
        (H_QOS, _QOS_BYTES[msg.qos]),
        (H_CLIENT_ID, msg.client_id.encode()),
    ]
    if msg.retain:
        hs.append((H_RETAIN, b"1"))
    p = msg.properties
    if p is not None:
        if p.payload_format is not None:
            hs.append((H_PAYLOAD_FORMAT, str(p.payload_format).encode()))
        if p.message_expiry is not None:
            hs.append((H_MESSAGE_EXPIRY, str(p.message_expiry).encode()))
        if p.content_type is not None:
            hs.append((H_CONTENT_TYPE, p.content_type.encode()))
        if p.response_topic is not None:
            hs.append((H_RESPONSE_TOPIC, p.response_topic.encode()))
        if p.correlation_data is not None:
            hs.append((H_CORRELATION_DATA, bytes(p.correlation_data)))
        for name, value in p.user_properties:
            if name.startswith("mqtt."):
                name = USER_PREFIX + name
            hs.append((name, value.encode()))
    return hs


def _int_or_none(v: bytes | None) -> int | None:
    try:
        return int(v) if v is not None else None
    except ValueError:
        return None


def mqtt_view(
    log_topic: str,
    key: bytes | None,
    headers: list[tuple[str, bytes | None]],
    default_qos: int = 1,
) -> MqttView:
    """How MQTT subscribers see a stored record (also one produced over Kafka).

    Topic: the key if it is a valid MQTT topic whose first level maps to `log_topic`, else the
    first level `log_topic` stands for (or `log_topic` itself when that is not reversible).
    Records without `mqtt.qos` (Kafka producers) get `default_qos`: 1, since they were stored
    durably. `mqtt.*` headers become properties; every other header becomes a user property.
    """
    topic = None
    if key:
        try:
            k = key.decode("utf-8")
        except UnicodeDecodeError:
            k = None
        if k is not None and is_valid_mqtt_topic(k):
            i = k.find("/")
            if escape_level(k if i < 0 else k[:i]) == log_topic:
                topic = k
    if topic is None:
        try:
            topic = first_level_for(log_topic) or log_topic
        except TopicMappingError:
            topic = log_topic
    qos, client_id, retain = default_qos, "", False
    pf = exp = ct = rt = cd = None
    users: list[tuple[str, str]] = []
    for name, value in headers:
        if name.startswith("mqtt."):
            if name == H_QOS:
                q = _int_or_none(value)
                qos = q if q in (0, 1, 2) else default_qos
            elif name == H_CLIENT_ID:
                client_id = (value or b"").decode("utf-8", "replace")
            elif name == H_RETAIN:
                retain = value == b"1"
            elif name == H_PAYLOAD_FORMAT:
                pf = _int_or_none(value)
            elif name == H_MESSAGE_EXPIRY:
                exp = _int_or_none(value)
            elif name == H_CONTENT_TYPE:
                ct = (value or b"").decode("utf-8", "replace")
            elif name == H_RESPONSE_TOPIC:
                rt = (value or b"").decode("utf-8", "replace")
            elif name == H_CORRELATION_DATA:
                cd = value or b""
            elif name.startswith(USER_PREFIX):
                users.append((name[len(USER_PREFIX) :], (value or b"").decode("utf-8", "replace")))
            else:
                users.append((name, (value or b"").decode("utf-8", "replace")))
        else:
            users.append((name, (value or b"").decode("utf-8", "replace")))
    props = None
    if (
        pf is not None
        or exp is not None
        or ct is not None
        or rt is not None
        or cd is not None
        or users
    ):
        props = MqttProperties(pf, exp, ct, rt, cd, tuple(users))
    return MqttView(topic, qos, client_id, retain, props)


# The compiled hash (store/_cmapping.pyx) unless absent or disabled: the same values.
murmur2: Callable[[bytes], int] = twin(
    murmur2_py, "store._cmapping", "murmur2", what="Kafka's key hash"
)
_murmur2 = murmur2


def _keep_tracked(msgs: list[MqttMessage]) -> None:
    """Python cannot untrack an object: without the compiled module the collector scans them."""


# A message holds str, bytes, ints, a bool and None or MqttProperties (strs, bytes, tuples): it
# can never be part of a reference cycle, so the cyclic GC need not track it. Fan-in keeps the
# messages of the last `recent_cache_bytes` alive for delivery, and the collector walked each
# of them in every young and middle collection until it died: ~10 % of the broker's CPU in a
# fan-in run, about half of it middle collections over surviving messages
# (docs/performance-history.md).
untrack_messages: Callable[[list[MqttMessage]], None] = twin(
    _keep_tracked,
    "store._cmapping",
    "untrack",
    what="fan-in's messages out of the cyclic GC's reach (they can hold no cycle)",
)
