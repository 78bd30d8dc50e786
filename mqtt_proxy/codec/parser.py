"""Index-walking MQTT stream parser: `feed(chunk) -> list[Packet]`.

Theory of operation
-------------------
`feed` appends the chunk to the unparsed tail of the previous call and walks an index over it:
read byte 0 and the remaining length (1-4 byte varint), check the packet size limit as soon as
the length is known (an oversize packet is refused before its body is buffered), and if the whole
packet is present decode it and move on. Whatever is left is kept as the new tail. A packet that
is known to be large and incomplete is gathered as a list of chunks and joined once when
complete, so a 1 MiB packet in 64 KiB reads costs one copy, not sixteen.

PUBLISH, the hot path, is decoded inline; other packets go through `_decode.DECODERS`.

Version: 3 (MQTT 3.1), 4 (3.1.1), 5 (5.0) or None before CONNECT. With None the only legal packet
is CONNECT, which fixes the version for the following packets of the same chunk (a server's
parser). A client's parser is told the version it sent (`Parser(version=5)`).

Errors: RemoteProtocolError with a v5 reason-code hint; the packets completed before the bad one
are in `err.packets`. After an error the parser is dead and raises the same error again.

Measurements behind the micro-choices (`bench/mqtt_parser_variants.py`: CPython 3.11, 2 vCPU
shared VM, 64-byte QoS 0 PUBLISH in 64 KiB chunks, best of 7; the VM is noisy, +-10%):
* process-wide topic cache (bytes -> validated str): 1.8-1.9 M/s with it, 0.6-1.1 M/s without;
  it skips the UTF-8 decode, the code point policy and the wildcard checks for repeated topics;
* one-byte remaining length tested inline before the varint loop: 1.95 vs 1.73 M/s;
* hot constants as default arguments vs module globals, and struct.unpack_from vs two byte reads
  for the u16 topic length: no difference above the noise; the default arguments stay (they make
  the function's dependencies explicit), the byte reads stay (never slower, no tuple).
"""

from __future__ import annotations

from collections.abc import Callable

from store.twins import twin

from ._decode import DECODERS, REQUIRED_FLAGS
from ._wire import check_str
from .errors import RemoteProtocolError
from .packets import Packet, Publish
from .properties import EMPTY_PROPERTIES, decode_properties
from .topics import topic_name_error

__all__ = ["Parser", "DEFAULT_MAX_PACKET_SIZE", "PROTOCOL_MAX_PACKET_SIZE"]

DEFAULT_MAX_PACKET_SIZE = 1024 * 1024
PROTOCOL_MAX_PACKET_SIZE = 268_435_455 + 5  # 4-byte varint maximum + fixed header

_E = RemoteProtocolError

# Validated PUBLISH topics, shared by every parser of the process: devices publish to the same
# topics again and again. Keyed by policy; cleared wholesale when it grows past the bound.
_TOPICS_STRICT: dict[bytes, str] = {}
_TOPICS_LAX: dict[bytes, str] = {}
_TOPIC_CACHE_MAX = 8192


def _topic(tb: bytes, strict: bool) -> str:
    """Decode and validate a PUBLISH topic name (not empty), caching it."""
    try:
        topic = str(tb, "utf-8")
    except UnicodeDecodeError as e:
        raise _E(f"invalid UTF-8 in topic name: {e}") from None
    check_str(topic, strict)
    if err := topic_name_error(topic):
        raise _E(err, 0x90)
    cache = _TOPICS_STRICT if strict else _TOPICS_LAX
    if len(cache) >= _TOPIC_CACHE_MAX:
        cache.clear()
    cache[tb] = topic
    return topic


class Parser:
    """Bytes in, packets out. One per connection and direction."""

    __slots__ = (
        "version",
        "max_packet_size",
        "strict_utf8",
        "_tail",
        "_chunks",
        "_have",
        "_need",
        "_error",
    )

    def __init__(
        self,
        version: int | None = None,
        max_packet_size: int = DEFAULT_MAX_PACKET_SIZE,
        strict_utf8: bool = True,
    ) -> None:
        if version not in (None, 3, 4, 5):
            raise ValueError(f"version must be None, 3, 4 or 5, not {version!r}")
        self.version = version
        self.max_packet_size = max_packet_size
        self.strict_utf8 = strict_utf8
        self._tail = b""
        self._chunks: list[bytes] = []  # pieces of one large packet still incomplete
        self._have = 0  # bytes in _tail + _chunks while _need is set
        self._need = 0  # total bytes the pending large packet needs (0: unknown)
        self._error: RemoteProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet parsed."""
        return len(self._tail) + sum(map(len, self._chunks))

    def feed(self, data: bytes) -> list[Packet]:
        """Parse every complete packet in the tail + `data`; keep the rest for the next call."""
        if self._error is not None:
            raise self._error
        if type(data) is not bytes:
            data = bytes(data)
        if self._need:
            chunks = self._chunks
            chunks.append(data)
            self._have += len(data)
            if self._have < self._need:
                return []
            buf = self._tail + b"".join(chunks)
            chunks.clear()
            self._need = 0
        elif self._tail:
            buf = self._tail + data
        else:
            buf = data
        out: list[Packet] = []
        try:
            pos = _walk(self, buf, out)
        except RemoteProtocolError as e:
            e.packets = list(out)
            if e.protocol_level is None:
                e.protocol_level = self.version
            self._error = e
            self._tail = b""
            raise
        self._tail = buf[pos:] if pos < len(buf) else b""
        self._have = len(self._tail)
        return out

    def _walk(
        self,
        buf: bytes,
        out: list[Packet],
        _tnew=tuple.__new__,
        Publish=Publish,
        EMPTY=EMPTY_PROPERTIES,
        decoders=DECODERS,
        flags_for=REQUIRED_FLAGS,
        strict_cache=_TOPICS_STRICT,
        lax_cache=_TOPICS_LAX,
    ) -> int:
        """Walk `buf`, appending packets to `out`; return the index of the unparsed tail."""
        n = len(buf)
        pos = 0
        version = self.version
        maxsize = self.max_packet_size
        strict = self.strict_utf8
        cache_get = (strict_cache if strict else lax_cache).get
        append = out.append
        while n - pos >= 2:
            b0 = buf[pos]
            rl = buf[pos + 1]
            if rl < 0x80:
                s = pos + 2
            else:
                rl &= 0x7F
                i = pos + 2
                shift = 7
                while True:
                    if i >= n:
                        return pos  # varint incomplete
                    b = buf[i]
                    rl |= (b & 0x7F) << shift
                    i += 1
                    if not b & 0x80:
                        if not b:
                            raise _E("remaining length not minimally encoded")
                        break
                    if i - pos >= 5:
                        raise _E("remaining length longer than 4 bytes")
                    shift += 7
                s = i
            end = s + rl
            if end - pos > maxsize:
                raise _E(f"packet of {end - pos} bytes > maximum packet size {maxsize}", 0x95)
            if end > n:
                if end - pos > 65536:  # large and incomplete: gather chunks, join once
                    self._need = end - pos
                return pos
            t = b0 >> 4
            if t == 3:
                if version is None:
                    raise _E("PUBLISH before CONNECT", 0x82)
                qos = (b0 >> 1) & 3
                if s + 2 > end:
                    raise _E("PUBLISH ends before the topic name")
                p = s + 2 + ((buf[s] << 8) | buf[s + 1])
                if p > end:
                    raise _E("PUBLISH topic runs past the end of the packet")
                tb = buf[s + 2 : p]
                topic = cache_get(tb)
                if topic is None:
                    if tb:
                        topic = _topic(tb, strict)
                    elif version == 5:
                        topic = ""
                    else:
                        raise _E("empty topic name", 0x90)
                if qos:
                    if qos == 3:
                        raise _E("PUBLISH QoS 3 [MQTT-3.3.1-4]")
                    if p + 2 > end:
                        raise _E("PUBLISH ends before the packet id")
                    pid = (buf[p] << 8) | buf[p + 1]
                    if not pid:
                        raise _E("PUBLISH packet id 0 [MQTT-2.2.1-3]")
                    p += 2
                else:
                    pid = 0
                    if b0 & 8:
                        raise _E("DUP set on a QoS 0 PUBLISH [MQTT-3.3.1-2]")
                if version == 5:
                    if p < end and not buf[p]:  # empty property block, the common case
                        props = EMPTY
                        p += 1
                    else:
                        props, p = decode_properties(buf, p, end, 3, strict)
                    if not topic and props.topic_alias is None:
                        raise _E("empty topic name without topic alias", 0x82)
                else:
                    props = EMPTY
                append(
                    _tnew(
                        Publish,
                        (topic, buf[p:end], qos, b0 & 1 == 1, b0 & 8 == 8, pid, props),
                    )
                )
            else:
                decode = decoders.get(t)
                if decode is None or (t == 15 and version != 5):
                    raise _E(f"reserved packet type {t}")
                if b0 & 0x0F != flags_for[t]:
                    raise _E(f"reserved flags 0x{b0 & 0x0F:X} on packet type {t} [MQTT-2.2.2-2]")
                if version is None:
                    if t != 1:
                        raise _E(f"packet type {t} before CONNECT", 0x82)
                    pkt = decode(b0, buf, s, end, 0, strict)
                    version = self.version = pkt.protocol_level  # type: ignore[attr-defined]
                else:
                    pkt = decode(b0, buf, s, end, version, strict)
                append(pkt)
            pos = end
        return pos


# The compiled walk (_cparser.pyx, built at install), unless absent or disabled: the same
# packets and errors as `Parser._walk`, which stays the reference (the codec tests run both).
_walk: Callable[[Parser, bytes, list[Packet]], int] = twin(
    Parser._walk,
    "mqtt_proxy.codec._cparser",
    "walk",
    what="the packet walk; PUBLISH and plain PUBACK allocated in place",
)
