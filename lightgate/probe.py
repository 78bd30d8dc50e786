"""Latency probes: a built-in MQTT client measures the whole pipeline, hop by hop.

Every `probe_interval_ms` the probe publishes one QoS 1 message carrying its sequence number and
send time on `__lightgate_probe/<id>` to the gateway's own MQTT listener, and is subscribed to
that topic itself, so the message takes the path every device message takes: proxy → store
(fsync) → dispatch → notify → pull → deliver, in either process shape. Hops, in
`lightgate_probe_latency_seconds{hop}`:

- `durable`: publish → PUBACK (the proxy's append is durable);
- `indexed`: publish → the notify event for the probe's light queue, seen by a mailbox the probe
  registers with the core's notifier (dispatched and notified);
- `delivered`: that event → the PUBLISH reaching the probe's subscription (pull and deliver);
- `end_to_end`: publish → delivered.

Invisible to users: `__lightgate_probe` is the one `__lightgate*` log topic the dispatcher
indexes, and only into exact-topic queues, so `#` or `+/…` subscribers never match it; Spark
reads `__` topics only by name, and Kafka Metadata marks them internal. A probe not delivered
within `probe_timeout_ms` makes `/health` 503 (lightgate/health.py logs it once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import time
from collections import deque
from typing import TYPE_CHECKING

from store.latency import LatencyHistogram
from store.mapping import PROBE_CLIENT_PREFIX, PROBE_TOPIC, internal_password

if TYPE_CHECKING:
    from lightgate.config import GatewayConfig
    from notify import InProcessNotifier

log = logging.getLogger("lightgate.probe")

HOPS = ("durable", "indexed", "delivered", "end_to_end")
_PAYLOAD = struct.Struct(">QQ")  # sequence, wall-clock send time in ns (for outside readers)
_MAILBOX = PROBE_TOPIC  # the notify mailbox (proxy id) the probe reads its events from


def _str(s: str) -> bytes:
    b = s.encode()
    return len(b).to_bytes(2, "big") + b


def _packet(first: int, body: bytes) -> bytes:
    n, rem = len(body), bytearray()
    while True:
        n, byte = divmod(n, 128)
        rem.append(byte | (128 if n else 0))
        if not n:
            return bytes([first]) + bytes(rem) + body


class Probe:
    """The probe client plus its notify mailbox. Event-loop-only."""

    def __init__(
        self,
        cfg: GatewayConfig,
        host: str,
        port: int,
        notifier: InProcessNotifier | None,
        secret: bytes,
    ) -> None:
        self.interval = cfg.probe_interval_ms / 1000
        self.timeout = cfg.probe_timeout_ms / 1000
        self.host, self.port = host, port
        self.notifier = notifier
        self.secret = secret  # proves the probe to the listener (store.mapping.internal_password)
        self.topic = f"{PROBE_TOPIC}/{os.getpid()}-{id(self) & 0xFFFF:x}"
        self.hist = {hop: LatencyHistogram() for hop in HOPS}
        self.sent = self.delivered = 0
        self._seq = 0
        self._pending: dict[int, float] = {}  # seq -> send time (loop clock), until delivered
        self._pids: dict[int, float] = {}  # packet id -> send time, until PUBACK
        self._unindexed: deque[tuple[int, float]] = deque()
        self._indexed: dict[int, float] = {}  # seq -> time its notify event was seen
        self._qseq: int | None = None
        self._connected_at: float | None = None
        self._started = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self._writer: asyncio.StreamWriter | None = None

    def histograms(self) -> dict[str, LatencyHistogram]:
        return self.hist

    @property
    def connected(self) -> bool:
        return self._connected_at is not None

    def problem(self) -> str | None:
        """Why probes say the pipeline is unhealthy, or None."""
        now = asyncio.get_running_loop().time()
        if self._connected_at is None:
            if now - self._started > self.timeout:
                return "latency probe: cannot connect to its MQTT listener"
            return None
        oldest = min(self._pending.values(), default=None)
        if oldest is not None and now - oldest > self.timeout:
            return f"latency probe: not delivered within {self.timeout * 1000:.0f} ms"
        return None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._started = loop.time()
        if self.notifier is not None:
            self.notifier.register(_MAILBOX, [self.topic], announce=False)
            self._tasks.append(
                loop.create_task(self._watch_events(self.notifier), name="probe-events")
            )
        self._tasks.append(loop.create_task(self._run(), name="probe"))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self.notifier is not None:
            self.notifier.drop(_MAILBOX)
        if self._writer is not None:
            self._writer.close()

    # -- the notify hop --------------------------------------------------------------------
    async def _watch_events(self, notifier: InProcessNotifier) -> None:
        loop = asyncio.get_running_loop()
        async for ev in notifier.events(_MAILBOX):
            now = loop.time()
            last = self._qseq
            self._qseq = ev.last_seq
            n = 1 if last is None else ev.last_seq - last
            while n > 0 and self._unindexed:
                seq, t0 = self._unindexed.popleft()
                self.hist["indexed"].observe(now - t0)
                self._indexed[seq] = now
                n -= 1

    # -- the client ------------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = 0.2
        while True:
            try:
                await self._session()
                backoff = 0.2
            except (OSError, asyncio.IncompleteReadError, ConnectionError) as exc:
                log.debug("probe connection: %r", exc)
            self._connected_at = None
            self._writer = None
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)

    async def _session(self) -> None:
        reader, writer = await asyncio.open_connection(self.host, self.port)
        self._writer = writer
        cid = f"{PROBE_CLIENT_PREFIX}-{os.getpid()}"
        # CONNECT 3.1.1, user name + password + clean session, keep alive 60 s, the password
        # proving an internal client; then SUBSCRIBE the probe topic at QoS 0.
        password = internal_password(self.secret, cid)
        body = _str("MQTT") + bytes([4, 0xC2, 0, 60]) + _str(cid) + _str(cid)
        writer.write(_packet(0x10, body + len(password).to_bytes(2, "big") + password))
        writer.write(_packet(0x82, (1).to_bytes(2, "big") + _str(self.topic) + b"\x00"))
        await writer.drain()
        sender = asyncio.get_running_loop().create_task(self._send_loop(writer))
        try:
            await self._read_loop(reader)
        finally:
            sender.cancel()
            writer.close()

    async def _send_loop(self, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        last_ping = loop.time()
        while True:
            await asyncio.sleep(self.interval)
            if self._connected_at is None:
                continue
            self._seq += 1
            seq, pid = self._seq, (self._seq % 65535) + 1
            t0 = loop.time()
            body = _str(self.topic) + pid.to_bytes(2, "big")
            body += _PAYLOAD.pack(seq, time.time_ns())
            self._pending[seq] = t0
            self._pids[pid] = t0
            self._unindexed.append((seq, t0))
            self.sent += 1
            writer.write(_packet(0x32, body))
            if t0 - last_ping > 30:
                writer.write(b"\xc0\x00")
                last_ping = t0
            self._trim(t0)

    def _trim(self, now: float) -> None:
        """Forget probes far older than the timeout (their loss is already reported)."""
        horizon = now - max(60.0, 10 * self.timeout)
        for d in (self._pending, self._pids, self._indexed):
            for k in [k for k, t in d.items() if t < horizon]:
                del d[k]
        while self._unindexed and self._unindexed[0][1] < horizon:
            self._unindexed.popleft()

    async def _read_loop(self, reader: asyncio.StreamReader) -> None:
        loop = asyncio.get_running_loop()
        while True:
            first = (await reader.readexactly(1))[0]
            n, shift = 0, 0
            while True:
                b = (await reader.readexactly(1))[0]
                n |= (b & 127) << shift
                shift += 7
                if not b & 128:
                    break
            body = await reader.readexactly(n) if n else b""
            kind = first >> 4
            now = loop.time()
            if kind == 2:  # CONNACK
                if len(body) < 2 or body[1] != 0:
                    raise ConnectionError(f"probe CONNACK refused: {body!r}")
                self._connected_at = now
            elif kind == 4:  # PUBACK
                t0 = self._pids.pop(int.from_bytes(body[:2], "big"), None)
                if t0 is not None:
                    self.hist["durable"].observe(now - t0)
            elif kind == 3:  # PUBLISH (QoS 0: no packet id)
                tlen = int.from_bytes(body[:2], "big")
                payload = body[2 + tlen :]
                if len(payload) >= _PAYLOAD.size:
                    self._delivered(_PAYLOAD.unpack_from(payload)[0], now)

    def _delivered(self, seq: int, now: float) -> None:
        t0 = self._pending.pop(seq, None)
        if t0 is None:
            return
        self.delivered += 1
        self.hist["end_to_end"].observe(now - t0)
        seen = self._indexed.pop(seq, None)
        if seen is not None:
            self.hist["delivered"].observe(now - seen)
