"""MQTT over WebSocket (subprotocol `mqtt` or `mqttv3.1`, path `/mqtt`): an adapter in front of the MQTT protocol.

`WebSocketProtocol` owns the socket. wsproto (sans-IO) does the HTTP upgrade and parses the
client's masked frames; once upgraded, the inner MQTT protocol is handed a `WsTransport` shim and
sees a plain byte stream, so the MQTT layer is identical for TCP, TLS and WebSocket.

Outbound frames are built here rather than through `wsproto.send(Message(...))`: a server frame is
unmasked, so the header is two to ten bytes in front of the payload, and wsproto's generic path
costs several µs per frame on the fan-out hot path. wsproto still sees every inbound byte and the
close handshake, which are the parts with state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import RemoteProtocolError

log = logging.getLogger("lightgate.mqtt.ws")
SUBPROTOCOLS = ("mqtt", "mqttv3.1")


def ws_binary_frame(payload: bytes | bytearray | memoryview, _h1: bytes = b"\x82") -> bytes:
    """One unmasked, final, binary frame (RFC 6455 §5.2) around `payload`."""
    n = len(payload)
    if n < 126:
        header = _h1 + bytes((n,))
    elif n < 65536:
        header = _h1 + b"\x7e" + n.to_bytes(2, "big")
    else:
        header = _h1 + b"\x7f" + n.to_bytes(8, "big")
    return header + bytes(payload)


class WsTransport(asyncio.Transport):
    """What the MQTT protocol sees as its transport: writes become binary frames."""

    __slots__ = ("_outer",)

    def __init__(self, outer: WebSocketProtocol) -> None:
        self._outer = outer

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if data:
            self._outer.transport.write(ws_binary_frame(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        # One frame for the lot: MQTT over WebSocket may split or join packets across frames.
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        self._outer.close_ws(1000)

    def abort(self) -> None:
        self._outer.transport.abort()

    def is_closing(self) -> bool:
        return self._outer.transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "websocket":
            return True
        return self._outer.transport.get_extra_info(name, default)

    def pause_reading(self) -> None:
        self._outer.transport.pause_reading()

    def resume_reading(self) -> None:
        self._outer.transport.resume_reading()

    def get_write_buffer_size(self) -> int:
        return self._outer.transport.get_write_buffer_size()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._outer.transport.set_write_buffer_limits(high, low)

    def can_write_eof(self) -> bool:
        return False


class WebSocketProtocol(asyncio.Protocol):
    """HTTP upgrade, then frames ⇄ the inner MQTT protocol's byte stream."""

    __slots__ = ("_factory", "_path", "_ws", "_inner", "transport")

    def __init__(self, inner_factory: Callable[[], asyncio.Protocol], path: str = "/mqtt") -> None:
        self._factory = inner_factory
        self._path = path
        self._ws = WSConnection(ConnectionType.SERVER)
        self._inner: asyncio.Protocol | None = None
        self.transport: asyncio.Transport = None  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                if isinstance(event, BytesMessage):
                    if self._inner is not None:
                        self._inner.data_received(bytes(event.data))
                elif isinstance(event, Request):
                    self._on_request(event)
                elif isinstance(event, Ping):
                    self.transport.write(self._ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    if self._ws.state is ConnectionState.REMOTE_CLOSING:
                        self.transport.write(self._ws.send(event.response()))
                    self.transport.close()
                elif isinstance(event, TextMessage):
                    # MQTT over WebSocket is binary only (MQTT 5.0 §6.0): a text frame is a protocol error.
                    self.close_ws(1003)
        except RemoteProtocolError as exc:
            log.info("websocket protocol error from %s: %s", self._peer(), exc)
            self.transport.abort()

    def _on_request(self, req: Request) -> None:
        path = req.target.split("?", 1)[0]
        if path != self._path:
            self._reject(404)
            return
        # `mqtt` (3.1.1 and 5.0); `mqttv3.1` is what MQTT 3.1 clients (e.g. Paho JS 1.0) offer.
        chosen = next((p for p in req.subprotocols if p in SUBPROTOCOLS), None)
        if chosen is None:
            self._reject(400)
            return
        self.transport.write(self._ws.send(AcceptConnection(subprotocol=chosen)))
        self._inner = self._factory()
        self._inner.connection_made(WsTransport(self))

    def _reject(self, status: int) -> None:
        self.transport.write(
            self._ws.send(RejectConnection(status_code=status, headers=[(b"content-length", b"0")]))
        )
        self.transport.close()

    def close_ws(self, code: int) -> None:
        if self._ws.state is ConnectionState.OPEN:
            try:
                self.transport.write(self._ws.send(CloseConnection(code=code)))
            except Exception:  # pragma: no cover - a state wsproto refuses: just drop the socket
                pass
        self.transport.close()

    def _peer(self) -> Any:
        return self.transport.get_extra_info("peername") if self.transport else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.connection_lost(exc)
