"""Closing a connection so that the last packet we wrote reaches the client.

Closing a socket whose receive buffer still holds unread bytes (or that receives more after the
close) makes the kernel answer with a TCP reset, and a reset can overtake the DISCONNECT or
CONNACK refusal still in flight: the client then sees `ECONNRESET` / `BrokenPipeError` instead
of the reason code (a v5 client flooding past Receive Maximum lost its DISCONNECT 0x93 about one
time in three). So a refusal closes the way careful servers do (Mosquitto, nginx's lingering
close): write the answer, shut down the sending side (`write_eof`: the client reads the answer,
then end of file), keep reading and discarding for a while, and close once the client has
closed too, or after `LINGER_S`, or after `LINGER_BYTES` more bytes, whichever comes first.

TLS transports cannot half-close (asyncio's SSL transport has no `write_eof`): the answer is
written and input drained the same way until the client closes, bounded alike. WebSocket does
its own equivalent in `WebSocketProtocol.close_ws` (a Close frame, then the client's Close).
"""

from __future__ import annotations

import asyncio

LINGER_S = 2.0  # longest wait for the client to close after our answer
LINGER_BYTES = 256 * 1024  # most input discarded meanwhile before closing anyway


def linger_close(
    transport: asyncio.Transport, loop: asyncio.AbstractEventLoop
) -> asyncio.TimerHandle | None:
    """Half-close `transport` after what is queued and keep reading (the protocol discards
    what comes); returns the timer that closes it for good, None if closed at once."""
    if transport.is_closing():
        return None
    if transport.get_extra_info("websocket"):
        transport.close()  # WsTransport.close lingers on the WebSocket close handshake
        return None
    try:
        if transport.can_write_eof():
            transport.write_eof()  # flushed first: FIN follows our answer
        transport.resume_reading()  # paused by a limit: the rest must be read to be dropped
    except (OSError, RuntimeError):
        transport.close()
        return None
    return loop.call_later(LINGER_S, transport.close)
