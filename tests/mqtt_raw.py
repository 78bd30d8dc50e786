"""Raw MQTT packets and socket reads for end-to-end tests that speak bytes, not a client
library: CONNECT variants, SUBSCRIBE, reading until the server closes, CONNACK properties."""

from __future__ import annotations

import socket
import time

from mqtt_helpers import read_varint, split_packets


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def packet(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def s16(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def connect_packet(
    cid: bytes,
    level: int = 4,
    clean: bool = True,
    keepalive: int = 60,
    will: tuple[bytes, bytes, int] | None = None,
) -> bytes:
    flags = 0x02 if clean else 0x00
    if will is not None:
        flags |= 0x04 | (will[2] << 3)
    body = s16(b"MQTT") + bytes([level, flags]) + keepalive.to_bytes(2, "big")
    body += b"\x00" if level == 5 else b""  # v5: empty CONNECT properties
    body += s16(cid)
    if will is not None:
        body += b"\x00" if level == 5 else b""  # v5: empty will properties
        body += s16(will[0]) + s16(will[1])
    return packet(0x10, body)


def connect_flags_packet(
    cid: bytes, flags: int = 0x02, name: bytes = b"MQTT", level: int = 4
) -> bytes:
    body = len(name).to_bytes(2, "big") + name + bytes([level, flags, 0, 60])
    body += len(cid).to_bytes(2, "big") + cid
    return bytes([0x10, len(body)]) + body


def subscribe_packet(filt: bytes, qos: int, pid: int = 1) -> bytes:
    body = pid.to_bytes(2, "big") + len(filt).to_bytes(2, "big") + filt + bytes([qos])
    return bytes([0x82, len(body)]) + body


def assert_silent(s: socket.socket, wait: float = 0.5) -> None:
    s.settimeout(wait)
    try:
        data = s.recv(65536)
    except TimeoutError:
        return
    raise AssertionError(f"unexpected bytes {data!r}")


def publish_fields(pkt: bytes) -> tuple[int, bytes, bytes]:
    """(packet id, topic, payload) of a QoS 1/2 3.1.1 PUBLISH with a one-byte remaining length."""
    tlen = int.from_bytes(pkt[2:4], "big")
    topic = pkt[4 : 4 + tlen]
    pid = int.from_bytes(pkt[4 + tlen : 6 + tlen], "big")
    return pid, topic, pkt[6 + tlen :]


def read_until_closed(s: socket.socket, timeout: float = 5.0) -> list[bytes]:
    """Every packet the server sends until it closes the connection (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    data = b""
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"connection not closed in {timeout}s; got {data!r}"
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    pkts, rest = split_packets(data)
    assert not rest, data
    return pkts


def parse_connack_props(connack: bytes) -> dict[int, int]:
    """The integer properties of a v5 CONNACK (id -> value); strings/binaries skipped."""
    got = read_varint(connack, 1)  # the remaining length
    assert got is not None, connack
    got = read_varint(connack, got[1] + 2)  # after flags and reason code: properties length
    assert got is not None, connack
    n, i = got
    end = i + n
    out: dict[int, int] = {}
    sizes = {0x11: 4, 0x13: 2, 0x21: 2, 0x22: 2, 0x24: 1, 0x25: 1, 0x27: 4, 0x28: 1, 0x29: 1}
    sizes |= {0x2A: 1}
    while i < end:
        pid = connack[i]
        i += 1
        if pid in sizes:
            out[pid] = int.from_bytes(connack[i : i + sizes[pid]], "big")
            i += sizes[pid]
        elif pid == 0x26:  # user property: two strings
            for _ in range(2):
                i += 2 + int.from_bytes(connack[i : i + 2], "big")
        else:  # a string (assigned client id, reason string, ...)
            i += 2 + int.from_bytes(connack[i : i + 2], "big")
    return out


def read_until_packet(s: socket.socket, first: int, timeout: float = 10.0) -> list[bytes]:
    """Packets until one whose first byte is `first` (then return at once: a TLS client closes
    itself after reading its answer), or the end of the stream. A reset fails the test: that
    is exactly what a careful close prevents."""
    deadline = time.monotonic() + timeout
    buf = b""
    got: list[bytes] = []
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no answer in {timeout} s: {got}"
        s.settimeout(left)
        chunk = s.recv(65536)  # ConnectionResetError here is the bug
        if not chunk:
            return got
        pkts, buf = split_packets(buf + chunk)
        got += pkts
        if any(p[0] == first for p in pkts):
            return got
