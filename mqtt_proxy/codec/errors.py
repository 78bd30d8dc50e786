"""The codec's two errors, after h11's `_util.py`.

`LocalProtocolError`: *we* asked the codec to do something the spec forbids (send a CONNACK twice,
encode QoS 3). A bug in our code; the peer did nothing wrong.

`RemoteProtocolError`: the *peer* broke the spec (malformed bytes, a packet in the wrong state).
The connection must be closed; `Connection.error_bytes` turns the error into the last bytes to
send (a v5 DISCONNECT or CONNACK carrying `reason_code`, a v3 CONNACK return code, or nothing).

Both carry `reason_code`, a hint in MQTT 5 reason-code terms (see `reason_codes.py`), so there is
one place that maps errors to wire codes instead of one per call site.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["ProtocolError", "LocalProtocolError", "RemoteProtocolError"]


class ProtocolError(Exception):
    """Base class; never raised directly. `reason_code` is an MQTT 5 reason code (0x80..0xA2)."""

    reason_code: int
    protocol_level: int | None

    def __init__(
        self, msg: str, reason_code: int = 0x81, protocol_level: int | None = None
    ) -> None:
        if type(self) is ProtocolError:
            raise TypeError("tried to directly instantiate ProtocolError")
        super().__init__(msg)
        self.reason_code = reason_code
        # The protocol level (3, 4, 5) when known at the time of the error: lets the error reply
        # for a bad CONNECT be shaped in the client's own version (v5 CONNACK vs v3 CONNACK).
        self.protocol_level = protocol_level


class LocalProtocolError(ProtocolError):
    """We misused the codec API. Raise it in our own code paths; never caused by peer bytes."""

    def _reraise_as_remote_protocol_error(self) -> NoReturn:
        """Re-raise as a RemoteProtocolError keeping message, code and traceback.

        Used where a validator written for local use (a constructor) rejects values that came
        from the wire, as h11 does.
        """
        self.__class__ = RemoteProtocolError  # type: ignore[assignment]
        raise self


class RemoteProtocolError(ProtocolError):
    """The peer violated the spec. `packets` holds the complete packets parsed before the bad one
    in the same `feed` call (the server may act on them, e.g. a QoS 0 PUBLISH, or ignore them)."""

    packets: list[Any]

    def __init__(
        self, msg: str, reason_code: int = 0x81, protocol_level: int | None = None
    ) -> None:
        super().__init__(msg, reason_code, protocol_level)
        self.packets = []
