"""Device connect/disconnect events, appended to the system log topic `__lightgate_device_events`.

Each event is one Kafka record: key = client id, value = JSON
`{"event": "connect"|"disconnect", "client_id", "ts", "reason", "remote"}`, so Kafka consumers and
Spark see device presence next to device data. The topic is internal: its records are not MQTT
messages (the proxy never delivers `__lightgate*` topics to MQTT subscribers; see delivery/delivery.py).

Events are buffered and appended every FLUSH_S as one RecordBatch per partition (the store's
builder), so a connect storm costs one append per flush, not one per connection. The partition is
Kafka's default for the key (murmur2 of the client id), so a Kafka consumer or a partitioner-aware
tool finds a client's events where a Kafka producer would have put them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from mqtt_proxy.ports import LogPort
from store.mapping import DEVICE_EVENTS_TOPIC, PROBE_CLIENT_PREFIX, partition_for_key
from store.record_batch import build_uncompressed

log = logging.getLogger("lightgate.mqtt.events")

TOPIC = DEVICE_EVENTS_TOPIC
_EVENT_JSON = '{{"event":"{}","client_id":{},"ts":{},"reason":{},"remote":{}}}'
_json_str = json.encoder.encode_basestring_ascii  # what json.dumps uses for a str


def event_json(event: str, client_id: str, ts: int, reason: str, remote: str) -> bytes:
    """The bytes `json.dumps` of the event dict writes (compact separators), without building
    the dict and walking it: that was a third of an event's cost, paid twice per device."""
    return _EVENT_JSON.format(
        event, _json_str(client_id), ts, _json_str(reason), _json_str(remote)
    ).encode()


# PROBE_CLIENT_PREFIX (store.mapping): the gateway's own latency probe is not a device


FLUSH_S = 0.05


class DeviceEvents:
    __slots__ = ("_store", "_pending", "_scheduled", "_partitions", "enabled")

    def __init__(self, store: LogPort) -> None:
        self._store = store
        self._pending: list[tuple[str, bytes, int]] = []
        self._scheduled = False
        self._partitions = 0
        self.enabled = hasattr(store, "append_batch")

    def connect(self, client_id: str, remote: str) -> None:
        self._add("connect", client_id, "", remote)

    def disconnect(self, client_id: str, reason: str, remote: str) -> None:
        self._add("disconnect", client_id, reason, remote)

    def _add(self, event: str, client_id: str, reason: str, remote: str) -> None:
        if not self.enabled or client_id.startswith(PROBE_CLIENT_PREFIX):
            return
        ts = int(time.time() * 1000)
        value = event_json(event, client_id, ts, reason, remote)
        self._pending.append((client_id, value, ts))
        if not self._scheduled:
            self._scheduled = True
            # Analytics data nobody waits for: one append per FLUSH_S instead of per loop tick
            # (a connect storm of ~5k/s made one tiny batch per tick: 3.5 % of its CPU profile).
            asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def close(self) -> None:
        """Graceful stop: append what is buffered, then take no more events."""
        self.flush()
        self.enabled = False

    def flush(self) -> None:
        self._scheduled = False
        pending, self._pending = self._pending, []
        if not pending:
            return
        store = self._store
        try:
            if not self._partitions:
                n = store.partitions(TOPIC)
                if n is None:  # the in-process store (a RemoteStore learns it at start)
                    got = store.ensure_topic(TOPIC)
                    assert isinstance(got, int)  # in-process: created within the call
                    n = got
                self._partitions = n
            # partition -> [(ts, key, value, headers)]
            by_part: dict[int, list[tuple[int, bytes, bytes, list[tuple[str, bytes | None]]]]] = {}
            for key, value, ts in pending:
                kb = key.encode()
                by_part.setdefault(partition_for_key(kb, self._partitions), []).append(
                    (ts, kb, value, [])
                )
            for part, records in by_part.items():
                store.append_batch(TOPIC, part, bytes(build_uncompressed(records)), sync=False)
        except Exception:
            log.exception("could not append %d device events", len(pending))
