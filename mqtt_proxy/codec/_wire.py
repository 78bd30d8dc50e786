"""Wire primitives shared by the parser, the encoder and the property codec (MQTT 5 §1.5).

Strings: UTF-8 Encoded String = u16 length + bytes. The spec says the bytes MUST be well-formed
UTF-8 (Python's strict decoder already refuses surrogates and overlong forms) and MUST NOT contain
U+0000 [MQTT-1.5.4-2]; control characters U+0001..U+001F, U+007F..U+009F and Unicode
non-characters SHOULD NOT appear and a receiver MAY close the connection [MQTT-1.5.4-3]. We follow
Mosquitto and refuse them by default ("strict" policy); `strict=False` refuses only U+0000.
"""

from __future__ import annotations

import re
import struct

from .errors import LocalProtocolError, RemoteProtocolError

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
pack_u16 = _U16.pack
pack_u32 = _U32.pack
unpack_u16_from = _U16.unpack_from
unpack_u32_from = _U32.unpack_from

MAX_VARINT = 268_435_455  # 0xFFFFFF7F decoded: four 7-bit groups


def _noncharacters() -> str:
    ranges = ["\ufdd0-\ufdef"]
    for plane in range(17):
        base = plane << 16
        ranges.append(f"{chr(base | 0xFFFE)}{chr(base | 0xFFFF)}")
    return "".join(ranges)


# Everything the strict policy refuses, as one character class; only run on non-ASCII strings
# (ASCII strings use str.isprintable, which for ASCII is exactly "not 0x00-0x1F, 0x7F").
_DISALLOWED = re.compile(f"[\x00-\x1f\x7f-\x9f{_noncharacters()}]")
disallowed_search = _DISALLOWED.search


def encode_varint(n: int) -> bytes:
    """MQTT Variable Byte Integer (1-4 bytes, little-endian 7-bit groups)."""
    if n < 128:
        if n < 0:
            raise LocalProtocolError(f"negative variable byte integer {n}")
        return _SMALL_VARINTS[n]
    if n > MAX_VARINT:
        raise LocalProtocolError(f"variable byte integer {n} > {MAX_VARINT}")
    out = bytearray()
    while n:
        b = n & 0x7F
        n >>= 7
        out.append(b | 0x80 if n else b)
    return bytes(out)


_SMALL_VARINTS = [bytes((i,)) for i in range(128)]


def decode_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """Decode a Variable Byte Integer at `pos` (must end before `end`) -> (value, next pos).

    Malformed when it runs past `end`, has a fifth byte [MQTT-1.5.5-1 / 2.2.3], or is not
    minimally encoded (a trailing 0x00 group after a continuation byte).
    """
    value = 0
    shift = 0
    for i in range(4):
        if pos + i >= end:
            raise RemoteProtocolError("variable byte integer runs past the end of the packet")
        b = buf[pos + i]
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and i:
                raise RemoteProtocolError("variable byte integer not minimally encoded")
            return value, pos + i + 1
        shift += 7
    raise RemoteProtocolError("variable byte integer longer than 4 bytes")


def check_str(s: str, strict: bool) -> None:
    """Apply the code point policy to a decoded string; RemoteProtocolError 0x81 if refused."""
    if strict:
        if s.isascii():
            if s.isprintable():
                return
        elif disallowed_search(s) is None:
            return
        raise RemoteProtocolError(f"disallowed code point in UTF-8 string {s!r}")
    if "\x00" in s:
        raise RemoteProtocolError(f"U+0000 in UTF-8 string {s!r}")


def read_str(buf: bytes, pos: int, end: int, strict: bool) -> tuple[str, int]:
    """UTF-8 Encoded String at `pos` -> (str, next pos); malformed if short or invalid."""
    if pos + 2 > end:
        raise RemoteProtocolError("string length runs past the end of the packet")
    n = (buf[pos] << 8) | buf[pos + 1]
    stop = pos + 2 + n
    if stop > end:
        raise RemoteProtocolError("string runs past the end of the packet")
    try:
        s = str(buf[pos + 2 : stop], "utf-8")
    except UnicodeDecodeError as e:
        raise RemoteProtocolError(f"invalid UTF-8: {e}") from None
    check_str(s, strict)
    return s, stop


def read_bin(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    """Binary Data (u16 length + bytes) -> (bytes, next pos)."""
    if pos + 2 > end:
        raise RemoteProtocolError("binary length runs past the end of the packet")
    stop = pos + 2 + ((buf[pos] << 8) | buf[pos + 1])
    if stop > end:
        raise RemoteProtocolError("binary data runs past the end of the packet")
    return bytes(buf[pos + 2 : stop]), stop


def enc_str(s: str) -> bytes:
    """UTF-8 Encoded String; LocalProtocolError if too long or containing U+0000."""
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise LocalProtocolError(f"string of {len(b)} bytes > 65535")
    if b"\x00" in b:
        raise LocalProtocolError(f"U+0000 in string {s!r}")
    return pack_u16(len(b)) + b


def enc_bin(b: bytes) -> bytes:
    """Binary Data; LocalProtocolError if longer than 65535 bytes."""
    if len(b) > 0xFFFF:
        raise LocalProtocolError(f"binary data of {len(b)} bytes > 65535")
    return pack_u16(len(b)) + bytes(b)
