"""A 3.1.1 QoS 1 reader's run of PUBLISHes: the per-message work of a subscriber that reads its
light queue behind the publishers (a QoS 1 reader of a fan-in gets one packet per message, each
with its own packet id and in-flight record, so nothing is shared with other readers).
`Delivery._pump_one` hands each run to `qos1_run` (compiled: `_cqos1_run.qos1_run`) and takes
whatever needs the general path (QoS 0 or 2 to send, retained as published) itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mqtt_proxy.codec import publish_v3_qos1
from mqtt_proxy.delivery.queue_cache import CachedMsg
from mqtt_proxy.sessions.state import Inflight, free_pid
from store.twins import twin


def qos1_run_py(
    cache: dict[int, Any],  # queue_cache.Cached
    seq: int,
    end: int,
    pending: dict[int, int],
    inflight: dict[int, Inflight],
    room: int,
    pid: int,
    now_ms: int,
    queue: str,
    filter_raw: str,
    icls: type[Inflight],
    observe: Callable[[int, int], None],
    out: list[bytes],
    sub_qos: int,
    rap: bool,
) -> tuple[int, int, int, bool]:
    """From `seq` to `end` of `cache` (CachedMsg, raw message or None, contiguous: a raw one,
    queue_cache.RAW_TYPES, carries no properties, so no expiry), the QoS 1 PUBLISHes for a
    3.1.1 subscription of QoS `sub_qos` >= 1, appended to `out`, each recorded in `inflight`
    under a free packet id from `pid` on and in `pending` under its sequence; skipped: missing,
    pending and expired messages. Stops before a message the general path must send (QoS 0 or
    2, retained with retain-as-published `rap`) and when `room` packets are in flight (blocked).
    The receive-to-write latency is observed once per run of equal timestamps. Returns (the
    sequence reached, the next packet id, bytes appended, blocked). Twin of
    `_cqos1_run.qos1_run`."""
    nbytes = 0
    ts0 = same = 0
    blocked = False
    while seq < end:
        m = cache[seq]
        if m is None or seq in pending:
            seq += 1
            continue
        raw = not isinstance(m, CachedMsg)
        exp = None if raw else m.expire_at_ms
        if exp is not None and now_ms >= exp:
            seq += 1
            continue
        q = m.qos if m.qos < sub_qos else sub_qos
        if q != 1 or (rap and m.retain) or type(m.payload) is not bytes:
            break
        if room <= 0:
            blocked = True
            break
        pid = free_pid(inflight, pid)
        data = publish_v3_qos1(m.topic, m.payload, pid)
        inflight[pid] = icls(queue, seq, 1, data, False, filter_raw)
        pending[seq] = pid
        out.append(data)
        nbytes += len(data)
        room -= 1
        pid = pid + 1 if pid < 65535 else 1
        ts = m.timestamp_ms if raw else m.ts_ms
        if ts != ts0:
            if same:
                observe(now_ms - ts0, same)
            ts0, same = ts, 0
        same += 1
        seq += 1
    if same:
        observe(now_ms - ts0, same)
    return seq, pid, nbytes, blocked


qos1_run = twin(
    qos1_run_py,
    "mqtt_proxy.delivery._cqos1_run",
    "qos1_run",
    what="a 3.1.1 QoS 1 reader's PUBLISH run, packet ids and `Inflight` records",
)
