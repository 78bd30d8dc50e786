"""What delivery keeps per queue read here: `QueueState` (positions known, loads, the pushed
entries) and its cache of `CachedMsg`, a resolved message with its encoded PUBLISH forms, shared
by every local subscriber of the queue (encode once per kind of receiver, see delivery.py); a
message without properties stays as it is until a reader needs more than its fields (`cached`)."""

from __future__ import annotations

import asyncio
from collections import deque
from itertools import islice
from typing import TYPE_CHECKING, TypeAlias

from lightqueue.model import StoredMessage
from mqtt_proxy.codec import PublishTemplate, publish_qos0, publish_qos0_alias
from mqtt_proxy.delivery.outbound import delivery_properties
from mqtt_proxy.ports import Entries, Message
from mqtt_proxy.sessions.state import Subscription
from store.mapping import MqttMessage, MqttProperties
from store.twins import twin

if TYPE_CHECKING:
    from mqtt_proxy.delivery.group_state import SharedGroup

PUMP_BATCHES = 64  # reads of `read_batch` entries per reader per tick before yielding the loop


class _CachedFields:
    """The fields of `CachedMsg`: the pure-Python twin of `_cqueue_cache.CachedBase`."""

    __slots__ = (
        "topic",
        "payload",
        "qos",
        "retain",
        "client_id",
        "props",
        "ts_ms",
        "expire_at_ms",
        "templates",
        "data0",
        "alias0",
    )

    def __init__(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        retain: bool,
        client_id: str,
        props: MqttProperties | None,
        ts_ms: int,
    ) -> None:
        self.topic = topic
        self.payload = payload
        self.qos = qos
        self.retain = retain
        self.client_id = client_id
        self.props = props
        self.ts_ms = ts_ms
        expiry = props.message_expiry if props is not None else None
        self.expire_at_ms = ts_ms + expiry * 1000 if expiry is not None else None
        self.templates: dict[tuple[int, bool, bool, tuple[int, ...]], PublishTemplate] | None = None
        self.data0: bytes | None = None  # QoS 0, 3.1.1, no retain: the common packet, cached
        self.alias0: tuple[int, bytes] | None = None  # QoS 0, v5, aliased, no topic: cached


# The compiled fields and loops (_cqueue_cache.pyx), unless absent or disabled. The base is chosen
# once, at import: switching the twins later leaves CachedMsg's base as it is.
if TYPE_CHECKING:
    _Base = _CachedFields
else:
    _Base = twin(
        _CachedFields,
        "mqtt_proxy.delivery._cqueue_cache",
        "CachedBase",
        what="a cached message's fields (read from its slots)",
    )


# A message without properties of these types is cached as it is (`fill_cache`): the QoS 0 and
# QoS 1 runs read its fields in place, so a fan-in's messages need no CachedMsg each (its
# allocation, copy and free were ~10 % of the loop; docs/performance-history.md); everything else
# reads the cache through `cached`, which makes the CachedMsg on first use.
RAW_TYPES: tuple[type, ...] = (MqttMessage, StoredMessage)


class CachedMsg(_Base):
    """A resolved message plus its encoded PUBLISH templates, keyed by what differs per receiver."""

    __slots__ = ()

    @classmethod
    def from_stored(cls, m: Message) -> CachedMsg:
        return cls(m.topic, m.payload, m.qos, m.retain, m.client_id, m.properties, m.timestamp_ms)

    def expired(self, now_ms: int) -> bool:
        return self.expire_at_ms is not None and now_ms >= self.expire_at_ms

    def template(
        self, qos: int, retain: bool, v5: bool, sub_ids: tuple[int, ...], now_ms: int
    ) -> PublishTemplate:
        """The PUBLISH for one kind of receiver, built once per (QoS, retain, version, ids).
        A v5 message with an expiry is rebuilt per pump: its remaining lifetime changes."""
        key = (qos, retain, v5, sub_ids)
        templates = self.templates
        if templates is None:
            templates = self.templates = {}
        tpl = templates.get(key)
        if tpl is None or (v5 and self.expire_at_ms is not None):
            props = None
            if v5:
                expiry = None
                if self.expire_at_ms is not None:
                    # What is left of it, never more than it had (a record stamped ahead of
                    # this clock, e.g. a Kafka producer's timestamp, must not get a longer
                    # lifetime, nor one past the property's u32 range).
                    left = max(0, (self.expire_at_ms - now_ms + 999) // 1000)
                    lifetime = None if self.props is None else self.props.message_expiry
                    expiry = left if lifetime is None else min(left, lifetime)
                props = delivery_properties(self.props, expiry, sub_ids)
            tpl = PublishTemplate.build(
                self.topic, self.payload, qos, retain, props, 5 if v5 else 4
            )
            templates[key] = tpl
        return tpl

    def qos0(self, retain: bool, v5: bool, sub_ids: tuple[int, ...], now_ms: int) -> bytes:
        """The QoS 0 PUBLISH for a cohort: `template(0, ...).data`, but without a template
        object where no property has to be carried (the fan-in/fan-out hot path)."""
        if self.props is not None or sub_ids:
            return self.template(0, retain, v5, sub_ids, now_ms).data
        if retain or v5:
            return publish_qos0(self.topic, self.payload, retain, v5)
        d = self.data0
        if d is None:
            d = self.data0 = publish_qos0(self.topic, self.payload)
        return d

    def qos0_alias(
        self, alias: int, first: bool, retain: bool, sub_ids: tuple[int, ...], now_ms: int
    ) -> bytes:
        """The v5 QoS 0 PUBLISH with a Topic Alias (and the topic name when `first`). The later
        form is kept, as `data0`: cohorts that are not at one position (a fan-out whose
        members read at different speeds) each need it, and every connection uses the same
        alias (bench/RESULTS.md, "Topic aliases": the fan-out row)."""
        if self.props is not None or sub_ids:
            return self.template(0, retain, True, sub_ids, now_ms).aliased(alias, first)
        if first or retain:
            return publish_qos0_alias(self.topic, self.payload, alias, first, retain)
        d = self.alias0
        if d is None or d[0] != alias:
            d = self.alias0 = (alias, publish_qos0_alias(self.topic, self.payload, alias, False))
        return d[1]


Cached: TypeAlias = "CachedMsg | MqttMessage | StoredMessage | None"


def fill_cache_py(
    cls: type[CachedMsg],
    msgs: list[Message | None],
    cache: dict[int, Cached],
    seq: int,
    internal: str,
    probe: str,
    raw_types: tuple[type, ...],
) -> None:
    """cache[seq + i] = msgs[i] itself when its type is one of `raw_types` and it carries no
    properties, else cls(msgs[i]); None for a missing message or one on an internal topic
    (`internal`, except the probes' `probe`). Twin of `_cqueue_cache.fill_cache`."""
    for m in msgs:
        if m is None or (m.topic.startswith(internal) and not m.topic.startswith(probe)):
            cache[seq] = None
        elif type(m) in raw_types and m.properties is None:
            cache[seq] = m
        else:
            cache[seq] = cls.from_stored(m)
        seq += 1


def cached(cache: dict[int, Cached], seq: int) -> CachedMsg | None:
    """cache[seq] as a CachedMsg: a raw message (see `Cached`) is made one, in place."""
    m = cache[seq]
    if m is None or isinstance(m, CachedMsg):
        return m
    c = cache[seq] = CachedMsg.from_stored(m)
    return c


def cached_get(cache: dict[int, Cached], seq: int) -> CachedMsg | None:
    """`cached`, or None where the cache has no entry for `seq`."""
    return cached(cache, seq) if seq in cache else None


fill_cache = twin(
    fill_cache_py,
    "mqtt_proxy.delivery._cqueue_cache",
    "fill_cache",
    what="a queue's cached messages",
)


def cached_end_py(cache: dict[int, Cached], pos: int, limit: int) -> int:
    """The first sequence from `pos` (below `limit`) that `cache` does not hold, or `limit`.
    Twin of `_cqueue_cache.cached_end`."""
    while pos < limit and pos in cache:
        pos += 1
    return pos


cached_end = twin(
    cached_end_py,
    "mqtt_proxy.delivery._cqueue_cache",
    "cached_end",
    what="where a queue's cached run ends",
)


def evict_oldest_py(cache: dict[int, Cached], over: int, start: int) -> None:
    """Of the `over` oldest keys of `cache` (insertion order), delete those below `start` (a
    queue's cache held to its size, never what a reader is about to take). Twin of
    `_cqueue_cache.evict_oldest`."""
    for k in list(islice(cache, over)):
        if k < start:
            del cache[k]


evict_oldest = twin(
    evict_oldest_py,
    "mqtt_proxy.delivery._cqueue_cache",
    "evict_oldest",
    what="a queue's cache held to its size",
)


class QueueState:
    """One queue with local readers: its subscriptions and groups, and what is known of it."""

    __slots__ = (
        "name", "subs", "groups", "cache", "last_seq", "read_end", "floor", "loading",
        "loaded_start", "retry", "pushed", "pushed_n",
    )  # fmt: skip

    def __init__(self, name: str) -> None:
        self.name = name
        # A dict for O(1) removal: a list.remove per disconnect scanned every subscriber of the
        # queue (100k subscribers leaving in any order: 33 s of the loop; bench/RESULTS.md).
        self.subs: dict[Subscription, None] = {}
        self.groups: dict[str, SharedGroup] = {}
        self.cache: dict[int, Cached] = {}
        self.last_seq = -1  # highest sequence announced by notify or seen in a read
        self.read_end = 0  # next_seq of the last read: nothing at or past it is known yet
        self.floor = 0  # the queue's first valid sequence as of the last read (retention)
        self.loading = 0  # 1: a load is being asked for, 2: its answer is still to come
        self.loaded_start = 0  # first valid sequence of the last answered load
        self.retry: asyncio.TimerHandle | None = None  # a failed load is retried later
        # Entries the dispatcher pushed for this watched queue: (first sequence, entries) runs
        # not yet delivered to every reader; a load finds them here instead of reading.
        self.pushed: deque[tuple[int, Entries]] = deque()
        self.pushed_n = 0


def pushed_from(qs: QueueState, from_seq: int, n: int) -> Entries | None:
    """Up to `n` pushed entries from `from_seq`, or None when they are not held here. A reader
    behind every pushed run (a slow QoS 1 reader far back) is answered at once; one near the
    head finds its run from the newest end. (Scanning all ~1000 runs per load was 2 % of a QoS 1
    fan-in.)"""
    pushed = qs.pushed
    if not pushed or from_seq < pushed[0][0]:
        return None
    for first, entries in reversed(pushed):
        if first <= from_seq < first + len(entries):
            i = from_seq - first
            return entries[i : i + n]
    return None
