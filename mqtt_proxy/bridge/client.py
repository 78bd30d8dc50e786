"""The bridge's connection to the remote broker: our sans-IO codec in the client role
(`Connection(CLIENT)`) under a thin asyncio stream layer.

It only moves packets: CONNECT/CONNACK, SUBSCRIBE/SUBACK and pings are handled here; PUBLISH and
PUBACK go to the callbacks the bridge gives, in the order they arrived. Everything that ends the
connection raises (`RemoteRefused`, `ProtocolError`, OSError, TimeoutError) so the bridge's one
retry loop sees every cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Sequence

from mqtt_proxy.bridge.settings import BridgeSettings
from mqtt_proxy.codec import (
    CLIENT,
    Connack,
    Connect,
    Connection,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Publish,
    RemoteProtocolError,
    Suback,
    Subscribe,
    TopicSubscription,
    encode_publish,
    make_properties,
)
from mqtt_proxy.codec.properties import EMPTY_PROPERTIES, Properties

log = logging.getLogger("lightgate.bridge")
CONNECT_TIMEOUT_S = 10.0
READ_CHUNK = 1 << 16

_CONNACK_WORDS = {
    0x84: "unsupported protocol version",
    0x85: "client id not valid",
    0x86: "bad user name or password",
    0x87: "not authorized",
    0x88: "server unavailable",
    0x8A: "banned",
    0x8C: "bad authentication method",
}


class RemoteRefused(ConnectionError):
    """The remote answered CONNECT with a failing CONNACK."""

    def __init__(self, code: int) -> None:
        super().__init__(f"remote refused the connection: {_CONNACK_WORDS.get(code, 'error')} "
                         f"(CONNACK reason 0x{code:02x})")  # fmt: skip
        self.code = code


def client_tls_context(s: BridgeSettings) -> ssl.SSLContext:
    """TLS to the remote: its CA (or the system's), our certificate when one is set."""
    ctx = ssl.create_default_context(cafile=s.tls_ca or None)
    if s.tls_cert:
        ctx.load_cert_chain(s.tls_cert, s.tls_key or None)
    if s.tls_insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class RemoteClient:
    """One connection to the remote. `connect` then `run` (until it ends, by raising)."""

    def __init__(
        self,
        settings: BridgeSettings,
        on_publish: Callable[[Publish], None],
        on_acks: Callable[[Sequence[int]], None],
    ) -> None:
        self.settings = settings
        self.conn = Connection(CLIENT, max_packet_size=1 << 28)
        self.on_publish = on_publish
        self.on_acks = on_acks
        self.session_present = False
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._subacks: dict[int, asyncio.Future[Suback]] = {}
        self._last_in = time.monotonic()
        self.refused_messages = 0

    @property
    def v5(self) -> bool:
        return self.settings.protocol == 5

    async def connect(self) -> None:
        s = self.settings
        ctx = client_tls_context(s) if s.tls else None
        server_name = (s.tls_server_name or s.host) if ctx is not None else None
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(s.host, s.port, ssl=ctx, server_hostname=server_name),
            CONNECT_TIMEOUT_S,
        )
        props = EMPTY_PROPERTIES
        if self.v5:
            # A persistent session must outlive the connection on the remote (v5 expiry).
            expiry = 0 if s.clean_session else 0xFFFFFFFF
            props = make_properties(session_expiry_interval=expiry, receive_maximum=65535)
        connect = Connect(
            s.client_id or f"lightgate-bridge-{s.name}",
            clean_start=s.clean_session,
            keep_alive=s.keepalive_s,
            username=s.username,
            password=s.password,
            protocol_level=s.protocol,
            properties=props,
        )
        self.write(self.conn.send(connect))
        connack = await asyncio.wait_for(self._connack(), CONNECT_TIMEOUT_S)
        if connack.reason_code >= 0x80:
            raise RemoteRefused(connack.reason_code)
        self.session_present = connack.session_present

    async def _connack(self) -> Connack:
        assert self._reader is not None
        while True:
            data = await self._reader.read(READ_CHUNK)
            if not data:
                raise ConnectionError("remote closed the connection before CONNACK")
            for p in self.conn.receive_data(data):
                if isinstance(p, Connack):
                    return p
                raise RemoteProtocolError(f"{type(p).__name__} before CONNACK", 0x82)

    async def subscribe(self, subs: Sequence[TopicSubscription], packet_id: int) -> Suback:
        """SUBSCRIBE and wait for the SUBACK (`run` must be running to read it)."""
        fut: asyncio.Future[Suback] = asyncio.get_running_loop().create_future()
        self._subacks[packet_id] = fut
        self.write(self.conn.send(Subscribe(packet_id, tuple(subs))))
        return await asyncio.wait_for(fut, CONNECT_TIMEOUT_S)

    def write(self, data: bytes) -> None:
        if self._writer is not None:
            self._writer.write(data)

    def publish(self, topic: str, payload: bytes, qos: int, packet_id: int,
                retain: bool, props: Properties) -> bool:  # fmt: skip
        """Write one PUBLISH (topics come from the log: valid); False, and nothing written,
        when it is larger than the remote's Maximum Packet Size (it would close on us)."""
        conn = self.conn
        data = encode_publish(
            topic, payload, qos, retain, False, packet_id, props, conn.version or 4
        )
        limit = conn.peer_max_packet_size
        if limit is not None and len(data) > limit:
            return False
        if qos:
            conn.publish_sent(packet_id)
        self.write(data)
        return True

    def puback(self, packet_id: int) -> None:
        if self.conn.state.value == "CONNECTED":
            self.write(self.conn.send(Puback(packet_id)))

    @property
    def receive_maximum(self) -> int:
        """QoS 1/2 PUBLISHes the remote takes in flight (its v5 Receive Maximum; 3.1.1: 65535)."""
        return self.conn.peer_receive_maximum

    async def drain(self) -> None:
        if self._writer is not None:
            await self._writer.drain()

    async def run(self) -> None:
        """Read until the connection ends; raises why (a clean remote close: ConnectionError)."""
        assert self._reader is not None
        pinger = asyncio.get_running_loop().create_task(self._ping())
        try:
            while True:
                data = await self._reader.read(READ_CHUNK)
                if not data:
                    raise ConnectionError("remote closed the connection")
                self._last_in = time.monotonic()
                acks: list[int] = []
                for p in self.conn.receive_data(data):
                    if type(p) is Publish:
                        self.on_publish(p)
                    elif type(p) is Puback:
                        acks.append(p.packet_id)
                        if p.reason_code >= 0x80:
                            self._refused(p.reason_code)
                    elif type(p) is Suback:
                        fut = self._subacks.pop(p.packet_id, None)
                        if fut is not None and not fut.done():
                            fut.set_result(p)
                    elif type(p) is Disconnect:
                        raise ConnectionError(f"remote sent DISCONNECT 0x{p.reason_code:02x}")
                    elif type(p) is not Pingresp:
                        raise RemoteProtocolError(f"unexpected {type(p).__name__}", 0x82)
                if acks:
                    self.on_acks(acks)
        finally:
            pinger.cancel()

    def _refused(self, code: int) -> None:
        """A v5 PUBACK that refuses the message (e.g. 0x87, the remote's ACL): settled all the
        same, since sending it again gets the same answer; said once per connection."""
        self.refused_messages += 1
        if self.refused_messages == 1:
            log.warning("bridge %s: the remote refused a message (PUBACK reason 0x%02x); "
                        "refused messages are not sent again", self.settings.name, code,
                        extra={"bridge": self.settings.name})  # fmt: skip

    async def _ping(self) -> None:
        ka = self.settings.keepalive_s
        if ka <= 0:
            return
        while True:
            await asyncio.sleep(ka / 2)
            if time.monotonic() - self._last_in > ka * 1.5:
                self.close()  # the read in `run` ends with the transport
                return
            self.write(self.conn.send(Pingreq()))

    def close(self) -> None:
        w, self._writer = self._writer, None
        if w is not None:
            with contextlib.suppress(Exception):
                w.close()
        for fut in self._subacks.values():
            if not fut.done():
                fut.set_exception(ConnectionError("connection closed"))
        self._subacks.clear()

    async def disconnect(self) -> None:
        """A polite DISCONNECT, then close (graceful shutdown)."""
        w = self._writer
        if w is not None and self.conn.state.value == "CONNECTED":
            with contextlib.suppress(Exception):
                w.write(self.conn.send(Disconnect()))
                await asyncio.wait_for(w.drain(), 2.0)
        self.close()
        if w is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.wait_closed(), 2.0)
