"""Retained messages (MQTT 5 §3.3.1.3) in the light-queue DB, looked up by filter without a scan.

State, not derived data: a retained message outlives commitlog retention, so the whole message is
stored (`r` prefix, see keys.py), not a log position.

Lookup for a wildcard subscription walks the topic tree *inside LevelDB*: keys are the topic's
levels joined by NUL, so the topics under `a/b` are one contiguous key range, and the distinct
values of a level are enumerated by seeking past each one's subtree (`<prefix><level>\\x01` sorts
right after every key of `<prefix><level>` and its subtree, and before any longer level). A filter
`+/x/temp` therefore touches one key per distinct first level plus the matches, never every
retained topic, and nothing is held in memory.

Event-loop-only (plyvel calls are short and synchronous).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import plyvel

from lightqueue import codec
from lightqueue.keys import P_RETAINED, retained_key, retained_topic
from lightqueue.model import StoredMessage, props_from_obj, props_to_obj
from lightqueue.topic_trie import validate_filter
from store.mapping import MqttProperties, log_topic_for

_SEP = b"\x00"
_SKIP = b"\x01"


def _encode(m: StoredMessage) -> bytes:
    return codec.encode(
        [m.payload, m.qos, m.client_id, m.timestamp_ms, props_to_obj(m.properties),
         m.log_topic, m.partition, m.offset]
    )  # fmt: skip


def _decode(topic: str, v: bytes) -> StoredMessage:
    payload, qos, cid, ts, props, lt, part, off = codec.decode(v)
    return StoredMessage(topic, payload, qos, cid, True, props_from_obj(props), ts, lt, part, off)


class RetainedStore:
    """topic → last retained message; `match(filter)` walks only matching branches."""

    def __init__(self, db: plyvel.DB, sync: bool = False) -> None:
        self._db = db
        self._sync = sync

    def set(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        client_id: str = "",
        properties: MqttProperties | None = None,
        timestamp_ms: int = 0,
        position: tuple[str, int, int] | None = None,
    ) -> None:
        """Retain `payload` on `topic`; an empty payload deletes (MQTT 5 §3.3.1.3)."""
        if not payload:
            self.delete(topic)
            return
        lt, part, off = position if position is not None else ("", -1, -1)
        m = StoredMessage(topic, bytes(payload), qos, client_id, True, properties,
                          timestamp_ms or int(time.time() * 1000), lt, part, off)  # fmt: skip
        self._db.put(retained_key(topic), _encode(m), sync=self._sync)

    def get(self, topic: str, now_ms: int | None = None) -> StoredMessage | None:
        v = self._db.get(retained_key(topic))
        if v is None:
            return None
        m = _decode(topic, v)
        if m.expired(int(time.time() * 1000) if now_ms is None else now_ms):
            self.delete(topic)
            return None
        return m

    def delete(self, topic: str) -> bool:
        k = retained_key(topic)
        if self._db.get(k) is None:
            return False
        self._db.delete(k, sync=self._sync)
        return True

    def delete_log_topic(self, log_topic: str, wb: Any) -> int:
        """Drop the retained messages that live in a deleted log topic; returns how many."""
        n = 0
        for k in self._db.iterator(prefix=P_RETAINED, include_value=False):
            if log_topic_for(retained_topic(k)) == log_topic:
                wb.delete(k)
                n += 1
        return n

    def topics(self) -> Iterator[str]:
        """Every retained topic (a full scan: for tools and tests, not for SUBSCRIBE)."""
        for k in self._db.iterator(prefix=P_RETAINED, include_value=False):
            yield retained_topic(k)

    def count(self) -> int:
        """Retained topics (a key-only scan: the gateway's metrics cache it, see metrics.py)."""
        return sum(1 for _ in self._db.iterator(prefix=P_RETAINED, include_value=False))

    def match(self, filt: str, now_ms: int | None = None) -> list[StoredMessage]:
        """Retained messages whose topic matches `filt`, expired ones dropped (and deleted)."""
        return self.page(filt, None, 0, now_ms)[0]

    def page(
        self, filt: str, after: bytes | None, limit: int, now_ms: int | None = None
    ) -> tuple[list[StoredMessage], bytes | None]:
        """Up to `limit` (0: all) retained messages matching `filt` whose keys sort after
        `after`, and the cursor to pass next (None: no more). A `#` subscriber of a million
        retained topics is fed page by page: neither side holds them all at once."""
        validate_filter(filt)
        now = int(time.time() * 1000) if now_ms is None else now_ms
        levels = [lv.encode("utf-8") for lv in filt.split("/")]
        out: list[StoredMessage] = []
        expired: list[str] = []
        cursor: bytes | None = None
        for key, v in self._walk(P_RETAINED, levels, 0, after):
            if limit and len(out) == limit:
                break
            cursor = key
            m = _decode(retained_topic(key), v)
            if m.expired(now):
                expired.append(m.topic)
            else:
                out.append(m)
        else:
            cursor = None
        for t in expired:
            self.delete(t)
        return out, cursor

    def count_keys_visited(self, filt: str) -> int:
        """Keys the walk for `filt` reads (tests prove a lookup does not scan everything)."""
        self._visited = 0
        self.match(filt)
        return self._visited

    _visited = 0

    # -- the walk --------------------------------------------------------------------------
    def _walk(
        self, base: bytes, levels: list[bytes], i: int, after: bytes | None
    ) -> Iterator[tuple[bytes, Any]]:
        """Keys under `base` (levels 0..i-1 joined by NUL; `r` alone at i == 0) matching
        `levels[i:]`, in key order, each greater than `after` when given. `base` itself is the
        key of the topic made of those levels."""
        db = self._db
        n = len(levels)
        if i == n:
            if after is None or base > after:
                v = db.get(base)
                self._visited += 1
                if v is not None:
                    yield base, v
            return
        lv = levels[i]
        child_prefix = base + _SEP if i > 0 else base
        if lv == b"#":
            if i > 0 and (after is None or base > after):  # `a/#` also matches `a` (§4.7.1.2)
                v = db.get(base)
                self._visited += 1
                if v is not None:
                    yield base, v
            it = db.iterator(prefix=child_prefix)
            if after is not None and after >= child_prefix:
                it.seek(after + b"\x00")  # the first key after `after`
            elif i == 0:
                it.seek(child_prefix)
            for k, v in it:
                self._visited += 1
                if i == 0 and k[1:2] == b"$":  # `#` at level 0 skips `$` topics
                    it.seek(P_RETAINED + b"%")  # '$' + 1: past every `$...` first level
                    continue
                if after is not None and k <= after:
                    continue
                yield k, v
            return
        if lv != b"+":
            yield from self._walk(child_prefix + lv, levels, i + 1, after)
            return
        # `+`: enumerate the distinct values of level i, skipping each one's subtree.
        it = db.iterator(prefix=child_prefix, include_value=False)
        plen = len(child_prefix)
        if after is not None and after.startswith(child_prefix):
            j = after.find(_SEP, plen)
            it.seek(after if j < 0 else after[:j])  # resume in the subtree holding `after`
        for k in it:
            self._visited += 1
            rest = k[plen:]
            j = rest.find(_SEP)
            value = rest if j < 0 else rest[:j]
            if not (i == 0 and value[:1] == b"$"):
                yield from self._walk(child_prefix + value, levels, i + 1, after)
            it.seek(child_prefix + value + _SKIP)
