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

from mqtt_proxy.connection.linger import LINGER_S

log = logging.getLogger("lightgate.mqtt.ws")
SUBPROTOCOLS = ("mqtt", "mqttv3.1")
MAX_HEAD = 8192  # bytes of HTTP request head before the upgrade is refused (431)
BadHook = Callable[..., None]  # (listener, peer, reason, **extra): the server's BadClientLog.bad

_PHRASES = {
    400: "Bad Request",
    404: "Not Found",
    408: "Request Timeout",
    426: "Upgrade Required",
    431: "Request Header Fields Too Large",
}


def check_upgrade(head: bytes, path: str) -> tuple[int, str] | None:
    """Why the HTTP request `head` (request line and headers, without the blank line) is not an
    MQTT WebSocket upgrade on `path`: (status, reason); None when it may be one (wsproto checks
    the key, version and host). Path first, so a wrong URL is a 404 whatever else it lacks."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return 400, "not an HTTP/1.1 request"
    method, target, _ = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            return 400, f"malformed header line {line[:60]!r}"
        key = name.lower()
        headers[key] = f"{headers[key]},{value.strip()}" if key in headers else value.strip()
    if target.split("?", 1)[0] != path:
        return 404, f"not found: MQTT over WebSocket is served at {path}"
    if method != "GET":
        return 400, f"method {method[:20]} not allowed: the WebSocket upgrade is a GET"

    def tokens(name: str) -> list[str]:
        return [t.strip().lower() for t in headers.get(name, "").split(",")]

    if "websocket" not in tokens("upgrade"):
        return 426, (
            f"{path} speaks MQTT over WebSocket only: upgrade with 'Upgrade: websocket' and "
            "'Sec-WebSocket-Protocol: mqtt'"
        )
    if "upgrade" not in tokens("connection"):
        return 400, "missing 'Connection: Upgrade'"
    if not any(p in SUBPROTOCOLS for p in tokens("sec-websocket-protocol")):
        return 400, "no MQTT subprotocol offered: send 'Sec-WebSocket-Protocol: mqtt'"
    return None


def http_refusal(status: int, reason: str) -> bytes:
    """A complete HTTP/1.1 response refusing the upgrade, the reason as a text/plain body."""
    body = (reason + "\n").encode()
    extra = "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n" if status == 426 else ""
    return (
        f"HTTP/1.1 {status} {_PHRASES.get(status, 'Error')}\r\n"
        f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    ).encode() + body


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
    """HTTP upgrade, then frames ⇄ the inner MQTT protocol's byte stream.

    The request head is checked here first (`check_upgrade`) so that the wrong client gets an
    HTTP answer with a reason instead of a dropped socket; wsproto then does the upgrade itself.
    A connection that has not upgraded within `connect_timeout_s` is answered 408 and closed.
    """

    __slots__ = (
        "_factory",
        "_path",
        "_timeout",
        "_on_bad",
        "_ws",
        "_inner",
        "_head",
        "_timer",
        "transport",
    )

    def __init__(
        self,
        inner_factory: Callable[[], asyncio.Protocol],
        path: str = "/mqtt",
        connect_timeout_s: float = 10.0,
        on_bad: BadHook | None = None,
    ) -> None:
        self._factory = inner_factory
        self._path = path
        self._timeout = connect_timeout_s
        self._on_bad = on_bad
        self._ws = WSConnection(ConnectionType.SERVER)
        self._inner: asyncio.Protocol | None = None
        self._head: bytearray | None = bytearray()  # the request head until it is complete
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport = None  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._timeout, self._upgrade_timed_out)

    def data_received(self, data: bytes) -> None:
        if self._head is not None:
            head = self._collect_head(data)
            if head is None:
                return
            data = head
        try:
            self._ws.receive_data(data)
            for event in self._ws.events():
                if isinstance(event, BytesMessage):
                    if self._inner is not None:
                        self._inner.data_received(bytes(event.data))
                elif isinstance(event, Request):
                    self._on_request(event)
                elif isinstance(event, Ping):
                    if self._ws.state is ConnectionState.OPEN:  # none once our Close is sent
                        self.transport.write(self._ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    if self._ws.state is ConnectionState.REMOTE_CLOSING:
                        self.transport.write(self._ws.send(event.response()))
                    self.transport.close()
                elif isinstance(event, TextMessage):
                    # MQTT over WebSocket is binary only (MQTT 5.0 §6.0): a text frame is a protocol error.
                    self._bad("text frame (MQTT over WebSocket is binary only)")
                    self.close_ws(1003)
        except (RemoteProtocolError, UnicodeError) as exc:  # wsproto reads Host as IDNA
            if self._inner is None:  # still the handshake: answer it in HTTP
                hint = getattr(exc, "event_hint", None)
                status = hint.status_code if isinstance(hint, RejectConnection) else 400
                self._refuse(status, f"bad WebSocket handshake: {exc}")
            else:
                self._bad(f"websocket protocol error: {exc}")
                self.transport.abort()

    def _collect_head(self, data: bytes) -> bytes | None:
        """Buffer the request head; once complete and acceptable, every byte so far (for
        wsproto), else None (still incomplete, or refused)."""
        head = self._head
        assert head is not None
        head += data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > MAX_HEAD:
                self._refuse(431, f"request head longer than {MAX_HEAD} bytes")
            return None
        self._head = None
        refusal = check_upgrade(bytes(head[:end]), self._path)
        if refusal is not None:
            self._refuse(*refusal)
            return None
        return bytes(head)

    def _on_request(self, req: Request) -> None:
        if self._timer is not None:
            self._timer.cancel()  # the inner MQTT connection now times its CONNECT itself
            self._timer = None
        # `mqtt` (3.1.1 and 5.0); `mqttv3.1` is what MQTT 3.1 clients (e.g. Paho JS 1.0) offer.
        chosen = next((p for p in req.subprotocols if p in SUBPROTOCOLS), "mqtt")
        self.transport.write(self._ws.send(AcceptConnection(subprotocol=chosen)))
        self._inner = self._factory()
        self._inner.connection_made(WsTransport(self))

    def _refuse(self, status: int, reason: str) -> None:
        """Answer the handshake with `status` and a one-line plain-text reason, log, close."""
        self._head = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport.is_closing():
            return
        self._bad(reason, status=status)
        self.transport.write(http_refusal(status, reason))
        self.transport.close()

    def _upgrade_timed_out(self) -> None:
        self._timer = None
        if self._inner is None:
            self._refuse(408, f"no WebSocket upgrade within {self._timeout:g} s")

    def _bad(self, reason: str, **extra: object) -> None:
        if self._on_bad is not None:
            self._on_bad("websocket", self._peer(), reason, **extra)
        else:
            log.warning("websocket bad connection from %s: %s", self._peer(), reason)

    def close_ws(self, code: int) -> None:
        """Send a Close frame and wait (at most LINGER_S) for the client's Close before closing
        the socket, reading and dropping what comes meanwhile: closing at once with input
        unread would reset the connection and could swallow the MQTT answer before the Close
        (linger.py). Again once closing: close the socket now."""
        if self._ws.state is ConnectionState.OPEN:
            try:
                self.transport.write(self._ws.send(CloseConnection(code=code)))
            except Exception:  # pragma: no cover - a state wsproto refuses: just drop the socket
                pass
            else:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)
                self.transport.resume_reading()
                return
        self.transport.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        inner, self._inner = self._inner, None
        if inner is not None:
            inner.connection_lost(exc)
