"""One bridge: its connection to the remote, kept up with exponential backoff, and its figures.

Per connection: CONNECT, SUBSCRIBE the `in` rules, then forward from the committed positions
until the connection ends. Woken by the notifier (the light queues it reads grew), by PUBACKs
(the window opened) and once a second (a missed event delays, never loses). One log line per
state change (connected, disconnected with the reason); the error is kept in the figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lightqueue import LightQueues
from mqtt_proxy.bridge.client import RemoteClient
from mqtt_proxy.bridge.inbound import CanWrite, Receiver, subscriptions
from mqtt_proxy.bridge.outbound import Forwarder
from mqtt_proxy.bridge.settings import BridgeSettings
from mqtt_proxy.codec import ProtocolError, Publish
from mqtt_proxy.ports import LogPort

log = logging.getLogger("lightgate.bridge")
POLL_S = 1.0


class Wakeups(Protocol):
    """What the bridge uses of the notifier (`InProcessNotifier`)."""

    def register(self, proxy_id: str, queues: Iterable[str], announce: bool = False) -> None: ...

    def drop(self, proxy_id: str) -> None: ...

    def batches(self, proxy_id: str) -> AsyncIterator[dict[str, int]]: ...


@dataclass(slots=True)
class BridgeFigures:
    """What /metrics, /api/stats, the dashboard and `lightgate status` show of one bridge."""

    name: str
    remote: str
    connected: bool = False
    lag_messages: int = 0
    lag_seconds: float = 0.0
    messages_out: int = 0
    messages_in: int = 0
    reconnects: int = 0
    last_error: str = ""
    connected_since: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "remote": self.remote,
            "connected": self.connected,
            "lag_messages": self.lag_messages,
            "lag_seconds": self.lag_seconds,
            "messages_out": self.messages_out,
            "messages_in": self.messages_in,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
        }


class Bridge:
    """Runs one `[[bridge]]` until `close`."""

    def __init__(
        self,
        settings: BridgeSettings,
        log_port: LogPort,
        queues: LightQueues,
        wakeups: Wakeups,
        can_write: CanWrite,
    ) -> None:
        self.settings = settings
        self.queues = queues
        self.wakeups = wakeups
        self.forwarder = Forwarder(settings, queues)
        self.receiver = Receiver(settings, log_port, queues, can_write)
        self.figures = BridgeFigures(settings.name, f"{settings.host}:{settings.port}")
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._client: RemoteClient | None = None
        self._closing = False
        self._id = f"bridge:{settings.name}"

    def start(self) -> None:
        queues = self.forwarder.acquire()
        loop = asyncio.get_running_loop()
        if queues:
            self.wakeups.register(self._id, queues)
            self._tasks.append(loop.create_task(self._events(), name=f"{self._id} events"))
        self._tasks.append(loop.create_task(self._ticker(), name=f"{self._id} figures"))
        self._tasks.append(loop.create_task(self._run(), name=self._id))

    async def _events(self) -> None:
        async for _ in self.wakeups.batches(self._id):
            self._wake.set()

    async def _ticker(self) -> None:
        while True:
            try:
                await self.forwarder.prefetch_heads()
            except Exception as exc:  # the cluster is away: the age waits for it
                log.debug("bridge %s: no head record: %r", self.settings.name, exc)
            self.refresh()
            self._wake.set()
            await asyncio.sleep(POLL_S)

    def refresh(self) -> None:
        f = self.figures
        f.lag_messages, f.lag_seconds = self.forwarder.lag()
        f.messages_out = self.forwarder.forwarded
        f.messages_in = self.receiver.received

    async def _run(self) -> None:
        s = self.settings
        delay = s.backoff_min_s
        while not self._closing:
            client = self._client = RemoteClient(s, self._on_publish, self._on_acks)
            try:
                await client.connect()
                self._connected(client)
                delay = s.backoff_min_s
                await self._session(client)
            except asyncio.CancelledError:
                raise
            except (OSError, ProtocolError, TimeoutError, ssl.SSLError, EOFError) as exc:
                self._failed(exc)
            except Exception as exc:  # a bug must not end the bridge for good: log, retry
                log.exception("bridge %s failed", s.name, extra={"bridge": s.name})
                self._failed(exc)
            finally:
                client.close()
                self._client = None
            if self._closing:
                break
            self.figures.reconnects += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, s.backoff_max_s)

    def _connected(self, client: RemoteClient) -> None:
        f = self.figures
        f.connected = True
        f.connected_since = time.time()
        f.last_error = ""
        log.info("bridge %s connected to %s (MQTT %s, session present: %s)", f.name, f.remote,
                 "5.0" if client.v5 else "3.1.1", client.session_present,
                 extra={"bridge": f.name})  # fmt: skip

    def _failed(self, exc: BaseException) -> None:
        f = self.figures
        text = str(exc) or type(exc).__name__
        if isinstance(exc, TimeoutError):
            text = "timed out"
        was, f.connected = f.connected, False
        if self._closing:
            return  # `close` says so
        if was or text != f.last_error:  # one line per change, not one per retry
            log.warning("bridge %s %s %s: %s", f.name,
                        "disconnected from" if was else "cannot connect to", f.remote, text,
                        extra={"bridge": f.name})  # fmt: skip
        f.last_error = text

    async def _session(self, client: RemoteClient) -> None:
        fwd = self.forwarder
        fwd.restart()
        reader = asyncio.get_running_loop().create_task(client.run())
        try:
            subs = subscriptions(self.settings)
            if subs:
                ack = await client.subscribe(subs, 1)
                bad = [sub.filter for sub, rc in zip(subs, ack.reason_codes, strict=False)
                       if rc >= 0x80]  # fmt: skip
                if bad:  # out goes on; the figures and one log line say what is missing
                    text = f"remote refused the subscription to {', '.join(bad)}"
                    log.warning("bridge %s: %s", self.settings.name, text,
                                extra={"bridge": self.settings.name})  # fmt: skip
                    self.figures.last_error = text
            while not reader.done():
                self._wake.clear()  # before the pump: a PUBACK during it wakes the next round
                quota = fwd.window(client.receive_maximum)
                if quota > 0:
                    await fwd.pump(client.publish, client.drain, quota)
                    fwd.settle()
                waiter = asyncio.ensure_future(self._wake.wait())
                try:
                    await asyncio.wait((waiter, reader), return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
            reader.result()  # raises why the connection ended
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            elif not reader.cancelled():
                reader.exception()  # retrieved: the cause was raised above, or we are closing

    def _on_publish(self, p: Publish) -> None:
        client = self._client
        if client is not None:
            self.receiver.handle(p, client.puback)

    def _on_acks(self, packet_ids: Sequence[int]) -> None:
        self.forwarder.acked(packet_ids)
        self.forwarder.settle()
        self._wake.set()

    async def close(self) -> None:
        self._closing = True
        client = self._client
        if client is not None:
            await client.disconnect()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        self.forwarder.settle()
        self.forwarder.release()
        self.wakeups.drop(self._id)
        self.refresh()
        self.figures.connected = False
        log.info("bridge %s closed", self.settings.name, extra={"bridge": self.settings.name})


class Bridges:
    """Every configured bridge of this gateway (run once, where the log and queues are)."""

    def __init__(self, bridges: list[Bridge]) -> None:
        self.bridges = bridges

    def start(self) -> None:
        for b in self.bridges:
            b.start()

    def figures(self) -> list[BridgeFigures]:
        return [b.figures for b in self.bridges]

    async def close(self) -> None:
        await asyncio.gather(*(b.close() for b in self.bridges), return_exceptions=True)
