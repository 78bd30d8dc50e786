"""Several MQTT proxies over one core (`mqtt_processes = N`, `lightgate proxy --core`).

Three proxies on loopback: the one `serve` starts on its MQTT port, and two more `lightgate
proxy` processes against the same core link, each on a port of its own, so a test decides which
proxy each client reaches (with SO_REUSEPORT the kernel would pick). What these check lives in
the core (lightgate/owners.py): a client id has one owner across proxies, a persistent session
follows its client to whichever proxy it reaches, and a dead proxy's wills are published.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_process import ROOT, GatewayProcess
from mqtt_helpers import V5, V311, Client, props, raw, read_packets, read_varint, split_packets
from paho.mqtt.packettypes import PacketTypes

READY = "lightgate proxy ready "


class Proxy:
    """One more `lightgate proxy` against the gateway's core link, on its own port."""

    def __init__(self, data: Path, name: str) -> None:
        args = [
            sys.executable, "-m", "lightgate", "proxy", "--core",
            f"unix:{(data / 'core.sock').resolve()}", "--mqtt-port", "0", "--ws-port", "-1",
            "--mqtts-port", "-1", "--wss-port", "-1", "--proxy-id", name,
            "--set", "sys_interval_s=1",
        ]  # fmt: skip
        self.log = open(data.parent / f"{name}.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log,
            env={**os.environ, "LIGHTGATE_LOG_FORMAT": "text"},
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()
        assert line.startswith(READY), line
        self.port = int(line[len(READY) :].split()[0].rpartition(":")[2])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def three(tmp_path: Path) -> Iterator[tuple[GatewayProcess, list[int], list[Proxy]]]:
    """A gateway with one proxy child, and two more proxies: the three ports, in order."""
    data = tmp_path / "data"
    gw = GatewayProcess(data, ["--set", "mqtt_processes=1", "--set", "sys_interval_s=1"]).start()
    extra: list[Proxy] = []
    try:
        extra = [Proxy(data, "edge-2"), Proxy(data, "edge-3")]
        yield gw, [gw.port("mqtt"), *(p.port for p in extra)], extra
    finally:
        for p in extra:
            p.stop()
        gw.stop()


def test_same_client_id_on_two_proxies_takes_over(
    three: tuple[GatewayProcess, list[int], list[Proxy]],
) -> None:
    """The second CONNECT of a client id, on another proxy, ends the first (v5 0x8E) before its
    CONNACK, and gets the session (present, with its subscription)."""
    _gw, ports, _ = three
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    first = Client(ports[0], "dev-1", V5).connect(props=expiry)
    first.subscribe("take/#", 1)
    second = Client(ports[1], "dev-1", V5).connect(clean=False, props=expiry)
    assert first.disconnected.wait(5)
    assert first.disconnect_reason == 0x8E  # session taken over
    assert second.session_present
    pub = Client(ports[2], "pub").connect()
    pub.publish("take/x", b"to the new owner", 1)
    assert second.expect(1)[0].payload == b"to the new owner"
    first.expect_none(0.3)
    # and back again, to the first proxy: the owner is per client id, not per proxy
    third = Client(ports[0], "dev-1", V5).connect(clean=False, props=expiry)
    assert second.disconnected.wait(5) and second.disconnect_reason == 0x8E
    assert third.session_present
    # `$SYS` counts every proxy's clients: third (proxy 1), pub (proxy 3), this one (proxy 2)
    sys = Client(ports[1], "sys").connect()
    sys.subscribe("$SYS/broker/clients/connected", 0)
    seen = []
    deadline = time.monotonic() + 10
    while b"3" not in seen and time.monotonic() < deadline:
        seen += [m.payload for m in sys.expect(1, timeout=5)]
    assert b"3" in seen, seen


def test_persistent_session_moves_between_proxies_mid_stream(
    three: tuple[GatewayProcess, list[int], list[Proxy]],
) -> None:
    """A QoS 1 and a QoS 2 stream to a persistent subscriber whose connection drops and comes
    back on another proxy, twice, while messages flow: every QoS 1 message arrives, every
    QoS 2 message exactly once (its in-flight state moved with the session)."""
    _gw, ports, _ = three
    n = 300
    sub = Client(ports[0], "mover", V311)
    sub.connect(clean=False)
    sub.subscribe("mv/#", 2)
    pub = Client(ports[2], "mv-pub").connect()

    def publish() -> None:
        for i in range(n):
            pub.publish("mv/q1", f"a{i}", 1, wait=False)
            pub.publish("mv/q2", f"b{i}", 2, wait=i % 20 == 19)
            time.sleep(0.002)
        pub.publish("mv/end", b"end", 2)

    t = threading.Thread(target=publish)
    t.start()
    got: list[str] = []

    def take(count: int) -> None:
        got.extend(m.payload.decode() for m in sub.expect(count, timeout=30))

    take(120)
    for port in (ports[1], ports[0]):
        sub.kill()  # the connection drops (no DISCONNECT) ...
        sub.port = port  # ... and the same client comes back through another proxy
        sub.connect(clean=False)
        assert sub.session_present
        take(100)
    t.join(60)
    deadline = time.monotonic() + 30
    while "end" not in got and time.monotonic() < deadline:
        take(1)
    counts = Counter(got)
    missing1 = [i for i in range(n) if counts[f"a{i}"] == 0]
    assert not missing1, f"QoS 1 messages lost: {missing1[:10]}"
    qos2 = [counts[f"b{i}"] for i in range(n)]
    assert qos2 == [1] * n, (
        f"QoS 2 not exactly once: {[(i, c) for i, c in enumerate(qos2) if c != 1][:10]}"
    )
    order = [int(p[1:]) for p in got if p.startswith("b")]
    assert order == sorted(order)


def test_killed_proxy_clients_move_on_wills_published(
    three: tuple[GatewayProcess, list[int], list[Proxy]],
) -> None:
    """`kill -9` of one proxy under load: its wills are published by the core (after their
    delay), its publisher and persistent subscriber continue on another proxy, and nothing
    that was acknowledged is lost."""
    _gw, ports, extra = three
    victim, other = extra[0], ports[2]
    watcher = Client(ports[0], "watcher").connect()
    watcher.subscribe("will/#", 1)
    will_props = props(PacketTypes.WILLMESSAGE, WillDelayInterval=1)
    expiry = props(PacketTypes.CONNECT, SessionExpiryInterval=60)
    Client(victim.port, "dies-now").connect(will=("will/now", b"gone now", 1, False))
    Client(victim.port, "dies-later", V5).connect(
        props=expiry, will=("will/later", b"gone later", 1, True), will_props=will_props
    )
    back = Client(victim.port, "comes-back", V5)
    back.connect(props=expiry, will=("will/back", b"not due", 1, False),
                 will_props=props(PacketTypes.WILLMESSAGE, WillDelayInterval=2))  # fmt: skip
    sub = Client(victim.port, "keeper", V311)
    sub.connect(clean=False)
    sub.subscribe("load/#", 1)
    pub = Client(victim.port, "loader", V311)
    pub.connect(clean=False)
    acked: list[str] = []
    i = 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # under load: QoS 1, each acknowledged before the next
        pub.publish("load/x", f"m{i}", 1)
        acked.append(f"m{i}")
        i += 1
    killed_at = time.monotonic()
    victim.kill()
    back.kill()
    back.port = other
    back.connect(clean=False, props=expiry)  # back within its will delay: no will
    assert back.session_present
    wills = {m.topic: (m.payload, time.monotonic() - killed_at) for m in watcher.expect(2, 15)}
    assert wills["will/now"][0] == b"gone now"
    assert wills["will/later"][0] == b"gone later"
    assert wills["will/later"][1] >= 0.9  # after its will delay, not at once
    watcher.expect_none(max(0.5, 2.5 - (time.monotonic() - killed_at)))  # not will/back
    # its clients reconnect to another proxy and go on
    pub.kill()
    pub.port = other
    pub.connect(clean=False)
    for j in range(i, i + 50):
        pub.publish("load/x", f"m{j}", 1)
        acked.append(f"m{j}")
    sub.kill()
    sub.port = other
    sub.connect(clean=False)
    assert sub.session_present
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while not set(acked) <= seen and time.monotonic() < deadline:
        try:
            seen.update(m.payload.decode() for m in sub.expect(1, timeout=1))
        except AssertionError:
            pass
    lost = [a for a in acked if a not in seen]
    assert not lost, f"{len(lost)} acknowledged messages lost, first {lost[:5]}"
    # the retained will is the core's too: a new subscriber on any proxy gets it
    late = Client(ports[0], "late").connect()
    late.subscribe("will/later", 1)
    assert late.expect(1)[0].payload == b"gone later"


def _raw_publishes(sock: socket.socket, wait: float) -> list[str]:
    """Payloads of the PUBLISH packets arriving on a raw connection within `wait` s (never
    acknowledged: a member that holds on to its messages)."""
    sock.settimeout(0.2)
    buf, out = b"", []
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        if not chunk:
            break
        pkts, buf = split_packets(buf + chunk)
        for p in pkts:
            if p[0] >> 4 != 3:
                continue
            _n, i = read_varint(p, 1)  # type: ignore[misc]
            tlen = int.from_bytes(p[i : i + 2], "big")
            i += 2 + tlen + (2 if p[0] & 0x06 else 0)
            out.append(p[i:].decode())
    return out


def test_share_group_across_three_proxies(
    three: tuple[GatewayProcess, list[int], list[Proxy]],
) -> None:
    """`$share/g/...` with one member on each proxy: each message goes to exactly one member;
    when the member that never acknowledged leaves, its messages reach the other members."""
    _gw, ports, _ = three
    filt = "$share/g/sh/#"
    m1 = Client(ports[0], "m1").connect()
    m1.subscribe(filt, 1)
    m2 = Client(ports[1], "m2").connect()
    m2.subscribe(filt, 1)
    m3 = raw(ports[2])  # a member that takes messages and acknowledges none
    m3.sendall(bytes([0x10, 14, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 2]) + b"m3")
    read_packets(m3, 1)  # CONNACK
    topic = filt.encode()
    m3.sendall(bytes([0x82, 5 + len(topic), 0, 1, 0, len(topic)]) + topic + bytes([1]))
    read_packets(m3, 1)  # SUBACK
    n = 300
    pub = Client(ports[0], "sh-pub").connect()
    for i in range(n):
        pub.publish("sh/x", f"s{i}", 1, wait=i % 50 == 49)
    got3 = _raw_publishes(m3, 2.0)

    def drain(c: Client) -> list[str]:
        out = []
        while True:
            try:
                out.append(c.messages.get(timeout=0.5).payload.decode())
            except Exception:
                return out

    got1, got2 = drain(m1), drain(m2)
    every = [f"s{i}" for i in range(n)]
    assert sorted(got1 + got2 + got3) == sorted(every)  # each message to exactly one member
    assert got1 and got2 and got3  # ... and all three proxies' members took some
    m3.close()  # leaves with every message it got unacknowledged
    again = []
    deadline = time.monotonic() + 20
    while len(again) < len(got3) and time.monotonic() < deadline:
        again += drain(m1) + drain(m2)
    assert sorted(again) == sorted(got3)  # redelivered, once, to the other members


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_core_killed_takes_every_proxy_along_and_they_come_back(tmp_path: Path) -> None:
    """`mqtt_processes = 3` on one port (SO_REUSEPORT): `kill -9` of the core ends all three
    proxies; a new `serve` brings three back, and a persistent subscriber gets everything
    that was acknowledged."""
    data = tmp_path / "data"
    args = ["--set", "mqtt_processes=3"]
    gw = GatewayProcess(data, args).start()
    try:
        kids = _children(gw.proc.pid)  # type: ignore[union-attr]
        assert len(kids) == 3
        port = gw.port("mqtt")
        sub = Client(port, "survivor", V311)
        sub.connect(clean=False)
        sub.subscribe("core/#", 1)
        sub.disconnect()
        pubs = [Client(port, f"p{k}").connect() for k in range(6)]  # spread over the proxies
        acked = []
        for i in range(60):
            pubs[i % 6].publish("core/x", f"c{i}", 1)
            acked.append(f"c{i}")
        # /metrics sums the labelled figures of every proxy: all six connections are counted
        url = f"http://127.0.0.1:{gw.port('http')}/metrics"
        text = urllib.request.urlopen(url).read().decode()
        conns = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("lightgate_connections{") and 'protocol="mqtt"' in line
        )
        assert conns == 6, [ln for ln in text.splitlines() if "connections" in ln]
    finally:
        gw.kill()
    deadline = time.monotonic() + 10
    while any(_alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(k) for k in kids), "a proxy outlived its core"
    gw2 = GatewayProcess(data, args).start()
    try:
        assert len(_children(gw2.proc.pid)) == 3  # type: ignore[union-attr]
        sub = Client(gw2.port("mqtt"), "survivor", V311)
        sub.connect(clean=False)
        assert sub.session_present
        got = [m.payload.decode() for m in sub.expect(60, timeout=20)]
        assert sorted(got) == sorted(acked)
    finally:
        gw2.stop()
