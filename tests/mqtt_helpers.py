"""Blocking helpers around paho-mqtt 2.x for the MQTT end-to-end tests.

`Client` wraps one paho client running its own network thread: every call waits for the broker's
answer (CONNACK, SUBACK, PUBACK/PUBCOMP) and received messages land in a queue that `expect`
drains with a timeout. `kill()` drops the socket without DISCONNECT (the "abnormal close" of the
will tests).
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

V311 = mqtt.MQTTv311
V5 = mqtt.MQTTv5


@dataclass
class Received:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    props: Any = None
    dup: bool = False

    @property
    def user_props(self) -> dict[str, str]:
        if self.props is None or not hasattr(self.props, "UserProperty"):
            return {}
        return dict(self.props.UserProperty)

    @property
    def sub_ids(self) -> list[int]:
        if self.props is None or not hasattr(self.props, "SubscriptionIdentifier"):
            return []
        return list(self.props.SubscriptionIdentifier)


@dataclass
class Client:
    port: int
    client_id: str = ""
    version: int = V311
    host: str = "127.0.0.1"
    transport: str = "tcp"
    paho: mqtt.Client = field(init=False)
    messages: queue.Queue[Received] = field(default_factory=queue.Queue)
    connack: Any = None
    connack_props: Any = None
    session_present: bool = False
    disconnect_reason: Any = None
    disconnected: threading.Event = field(default_factory=threading.Event)
    _connected: threading.Event = field(default_factory=threading.Event)
    _subacks: dict[int, Any] = field(default_factory=dict)
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _acked: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        kwargs: dict[str, Any] = {"client_id": self.client_id, "protocol": self.version}
        self.paho = mqtt.Client(CallbackAPIVersion.VERSION2, transport=self.transport, **kwargs)
        p = self.paho
        p.on_connect = self._on_connect
        p.on_message = self._on_message
        p.on_subscribe = self._on_subscribe
        p.on_unsubscribe = self._on_subscribe
        p.on_publish = self._on_publish
        p.on_disconnect = self._on_disconnect
        if self.transport == "websockets":
            p.ws_set_options(path="/mqtt")

    # callbacks (paho's thread)
    def _on_connect(self, c: Any, ud: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.connack = rc
        self.connack_props = props
        self.session_present = bool(getattr(flags, "session_present", False))
        self._connected.set()

    def _on_message(self, c: Any, ud: Any, msg: mqtt.MQTTMessage) -> None:
        props = getattr(msg, "properties", None)
        self.messages.put(
            Received(msg.topic, msg.payload, msg.qos, bool(msg.retain), props, bool(msg.dup))
        )

    def _on_subscribe(self, c: Any, ud: Any, mid: int, codes: Any, props: Any = None) -> None:
        with self._cond:
            self._subacks[mid] = codes
            self._cond.notify_all()

    def _on_publish(self, c: Any, ud: Any, mid: int, rc: Any = None, props: Any = None) -> None:
        with self._cond:
            self._acked.add(mid)
            self._cond.notify_all()

    def _on_disconnect(self, c: Any, ud: Any, flags: Any, rc: Any, props: Any = None) -> None:
        self.disconnect_reason = rc
        self.disconnected.set()
        self._connected.set()

    # API
    def connect(
        self,
        clean: bool = True,
        keepalive: int = 60,
        props: Properties | None = None,
        will: tuple[str, bytes, int, bool] | None = None,
        will_props: Properties | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout: float = 10.0,
        expect_ok: bool = True,
    ) -> Client:
        p = self.paho
        if will is not None:
            p.will_set(will[0], will[1], will[2], will[3], properties=will_props)
        if username is not None:
            p.username_pw_set(username, password)
        self._connected.clear()
        self.disconnected.clear()
        if self.version == V5:
            p.connect(self.host, self.port, keepalive, clean_start=clean, properties=props)
        else:
            p._clean_session = clean
            p.connect(self.host, self.port, keepalive)
        p.loop_start()
        assert self._connected.wait(timeout), "no CONNACK"
        if expect_ok:
            assert not getattr(self.connack, "is_failure", self.connack != 0), self.connack
        return self

    def subscribe(
        self,
        filt: str,
        qos: int = 0,
        timeout: float = 10.0,
        props: Properties | None = None,
        **opts: Any,
    ) -> list[Any]:
        if self.version == V5:
            options = SubscribeOptions(qos=qos, **opts)
            rc, mid = self.paho.subscribe(filt, options=options, properties=props)
        else:
            rc, mid = self.paho.subscribe(filt, qos)
        assert rc == 0
        return self._wait_ack(mid, timeout)

    def unsubscribe(self, filt: str, timeout: float = 10.0) -> Any:
        rc, mid = self.paho.unsubscribe(filt)
        assert rc == 0
        return self._wait_ack(mid, timeout)

    def _wait_ack(self, mid: int, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while mid not in self._subacks:
                left = deadline - time.monotonic()
                assert left > 0, "no SUBACK/UNSUBACK"
                self._cond.wait(left)
            return self._subacks.pop(mid)

    def publish(
        self,
        topic: str,
        payload: bytes | str = b"",
        qos: int = 0,
        retain: bool = False,
        props: Properties | None = None,
        wait: bool = True,
        timeout: float = 10.0,
    ) -> int:
        info = self.paho.publish(topic, payload, qos, retain, properties=props)
        if wait and qos:
            deadline = time.monotonic() + timeout
            with self._cond:
                while info.mid not in self._acked:
                    left = deadline - time.monotonic()
                    assert left > 0, f"no ack for publish {info.mid}"
                    self._cond.wait(left)
        return info.mid

    def expect(self, n: int = 1, timeout: float = 10.0) -> list[Received]:
        out = []
        deadline = time.monotonic() + timeout
        while len(out) < n:
            left = deadline - time.monotonic()
            try:
                out.append(self.messages.get(timeout=max(0.0, left)))
            except queue.Empty:
                raise AssertionError(f"expected {n} messages, got {len(out)}: {out}") from None
        return out

    def expect_none(self, wait: float = 0.5) -> None:
        try:
            m = self.messages.get(timeout=wait)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected message {m}")

    def disconnect(self, props: Properties | None = None, reasoncode: Any = None) -> None:
        self.paho.disconnect(reasoncode=reasoncode, properties=props)
        self.disconnected.wait(5)
        self.paho.loop_stop()

    def kill(self) -> None:
        """Drop the TCP connection without DISCONNECT (abnormal close)."""
        sock = self.paho.socket()
        self.paho.loop_stop()
        if sock is not None:
            import socket as _s

            try:
                sock.shutdown(_s.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


def props(packet: int, **values: Any) -> Properties:
    p = Properties(packet)
    for k, v in values.items():
        setattr(p, k, v)
    return p


CONNECT = PacketTypes.CONNECT
PUBLISH = PacketTypes.PUBLISH
SUBSCRIBE = PacketTypes.SUBSCRIBE
DISCONNECT = PacketTypes.DISCONNECT
WILLMESSAGE = PacketTypes.WILLMESSAGE


# -- raw sockets: exact bytes on the wire ----------------------------------------------------


def raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(5)
    return s


def read_varint(buf: bytes, i: int) -> tuple[int, int] | None:
    """The MQTT variable byte integer at `buf[i]` and the index after it; None if `buf` ends
    inside it."""
    n, mul = 0, 1
    while True:
        if i >= len(buf):
            return None
        b = buf[i]
        n += (b & 0x7F) * mul
        mul *= 128
        i += 1
        if not b & 0x80:
            return n, i


def split_packets(buf: bytes) -> tuple[list[bytes], bytes]:
    """Whole MQTT packets off the front of `buf`, and the incomplete rest."""
    out = []
    while len(buf) >= 2:
        got = read_varint(buf, 1)
        if got is None:
            return out, buf
        n, i = got
        if len(buf) < i + n:
            break
        out.append(buf[: i + n])
        buf = buf[i + n :]
    return out, buf


def read_packets(s: socket.socket, n: int, timeout: float = 5.0) -> list[bytes]:
    """Exactly the next `n` packets (no partial or extra packet may arrive with them)."""
    s.settimeout(timeout)
    got: list[bytes] = []
    buf = b""
    while len(got) < n:
        chunk = s.recv(65536)
        assert chunk, f"closed after {len(got)} packets: {got}"
        pkts, buf = split_packets(buf + chunk)
        got += pkts
    assert not buf and len(got) == n, got
    return got
