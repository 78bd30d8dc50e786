"""`mqtt_processes = 1` and `lightgate proxy`: the MQTT proxy in its own process, over the core link.

Every MQTT end-to-end test already runs in this mode too (the `broker` fixture); these cover what
only the split has: the proxy process dying and coming back, the core dying and taking the proxy
along, and a standalone `lightgate proxy` against a core that only listens on its core link.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from gateway_process import ROOT, GatewayProcess, parse_ready_line
from mqtt_helpers import V311, Client
from ops_helpers import scrape

from store import segment_reader as sr


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split()]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.split(") ", 1)[1][0] != "Z"  # a zombie has exited


def _wait(cond: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _connects(port: int) -> bool:
    try:
        Client(port, f"probe-{time.monotonic_ns()}").connect().disconnect()
        return True
    except Exception:
        return False


def _values(data_dir: Path, log_topic: str) -> list[bytes]:
    out = []
    for part in range(sr.list_topics(data_dir).get(log_topic, 0)):
        out += [r.value for r in sr.iter_records_from(data_dir, log_topic, part)]
    return out


def test_proxy_process_killed_is_restarted_and_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    gw = GatewayProcess(tmp_path / "data", ["--set", "mqtt_processes=1"]).start()
    try:
        port = gw.port("mqtt")
        (proxy,) = _children(gw.proc.pid)  # type: ignore[union-attr]
        sub = Client(port, "keeper", V311).connect(clean=False)
        sub.subscribe("crash/#", 1)
        sub.disconnect()
        pub = Client(port, "pub1").connect()
        for i in range(30):
            pub.publish("crash/a", f"before-{i}", 1)  # returns once PUBACKed
        os.kill(proxy, signal.SIGKILL)
        _wait(lambda: not _alive(proxy), 10, "the proxy to die")
        _wait(lambda: _children(gw.proc.pid) and _connects(port), 30, "a new proxy")  # type: ignore[union-attr]
        assert _children(gw.proc.pid) != [proxy]  # type: ignore[union-attr]
        pub = Client(port, "pub2").connect()
        for i in range(30):
            pub.publish("crash/a", f"after-{i}", 1)
        sub = Client(port, "keeper", V311).connect(clean=False)
        got = [m.payload.decode() for m in sub.expect(60, timeout=20)]
        want = [f"before-{i}" for i in range(30)] + [f"after-{i}" for i in range(30)]
        assert got == want  # the persistent session resumed from the core, in order
        # The restarted proxy's counters reach /metrics through the core, in its own series.
        m = scrape(gw.port("http"))
        key = (("direction", "in"), ("process", "mqtt-1"), ("protocol", "mqtt"))
        assert m[("lightgate_messages_total", key)] == 30, m
        assert "exited with" in gw.log_text()
    finally:
        gw.stop()


def test_core_killed_takes_the_proxy_along_and_keeps_acknowledged(tmp_path: Path) -> None:
    data = tmp_path / "data"
    gw = GatewayProcess(data, ["--set", "mqtt_processes=1"]).start()
    (proxy,) = _children(gw.proc.pid)  # type: ignore[union-attr]
    pub = Client(gw.port("mqtt"), "p").connect()
    acked = []
    for i in range(200):
        pub.publish("kill/t", f"m{i}", 1)
        acked.append(f"m{i}".encode())
    gw.kill()  # SIGKILL the core mid-session
    _wait(lambda: not _alive(proxy), 10, "the proxy to exit with its core")
    assert _values(data, "kill") == acked  # every PUBACKed message is in the log, in order
    gw2 = GatewayProcess(data, ["--set", "mqtt_processes=1"]).start()  # same data dir again
    try:
        sub = Client(gw2.port("mqtt"), "s").connect()
        sub.subscribe("$replay/0/kill/#", 1)
        assert [m.payload for m in sub.expect(200, timeout=20)] == acked
    finally:
        gw2.stop()


def test_standalone_proxy_against_a_core_only_serve(tmp_path: Path) -> None:
    """`serve` with its MQTT listeners off and `core_listen` on TCP is a core; `lightgate proxy`
    in another process serves MQTT from it, and Kafka clients of the core see the messages."""
    secret = tmp_path / "core.secret"
    secret.write_text("shared by the core and its proxies\n")
    core = GatewayProcess(
        tmp_path / "data",
        ["--mqtt-port", "-1", "--ws-port", "-1", "--set", "core_listen=127.0.0.1:0",
         "--core-secret-file", str(secret)],
    ).start()  # fmt: skip
    proc = None
    try:
        assert "mqtt" not in core.endpoints and "core" in core.endpoints
        args = [
            sys.executable, "-m", "lightgate", "proxy", "--core",
            f"127.0.0.1:{core.port('core')}", "--mqtt-port", "0", "--ws-port", "-1",
            "--mqtts-port", "-1", "--proxy-id", "edge-1", "--core-secret-file", str(secret),
        ]  # fmt: skip
        proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "LIGHTGATE_LOG_FORMAT": "text"},
        )  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline().decode().strip()
        assert line.startswith("lightgate proxy ready mqtt=127.0.0.1:"), line
        port = parse_ready_line(line.replace("lightgate proxy ready", "lightgate ready"))["mqtt"][1]
        sub = Client(port, "edge-sub").connect()
        sub.subscribe("edge/#", 1)
        Client(port, "edge-pub").connect().publish("edge/x", "over the link", 1)
        assert sub.expect(1)[0].payload == b"over the link"
        import kafka

        consumer = kafka.KafkaConsumer(
            "edge", bootstrap_servers=f"127.0.0.1:{core.port('kafka')}",
            auto_offset_reset="earliest", consumer_timeout_ms=10_000,
        )  # fmt: skip
        try:
            assert next(iter(consumer)).value == b"over the link"
        finally:
            consumer.close()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0  # a clean stop of the proxy
        core.stop()


def test_a_subscribe_cut_off_by_its_connection_holds_nothing(tmp_path: Path) -> None:
    """SUBSCRIBE and the connection's end arrive together: the core's answer (the held queue)
    comes after the clean session is gone, and the hold must be given back, or the filter
    queue would be indexed forever."""
    import socket

    from mqtt_helpers import read_packets

    gw = GatewayProcess(
        tmp_path / "data", ["--set", "mqtt_processes=1", "--set", "filter_grace_ms=100"]
    ).start()
    try:
        port = gw.port("mqtt")

        def filters() -> float:
            url = f"http://127.0.0.1:{gw.port('http')}/metrics"
            for line in urllib.request.urlopen(url).read().decode().splitlines():
                if line.startswith("lightgate_wildcard_queues "):
                    return float(line.split()[1])
            raise AssertionError("no lightgate_wildcard_queues metric")

        connect = bytes([0x10, 16, 0, 4]) + b"MQTT" + bytes([4, 2, 0, 60, 0, 4]) + b"gone"
        subscribe = bytes([0x82, 10, 0, 1, 0, 5]) + b"cut/#" + bytes([0])
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(connect)
            read_packets(s, 1)  # CONNACK
            s.sendall(subscribe)
            s.close()  # before the SUBACK: the proxy asks the core, then loses the client
        _wait(lambda: filters() == 0, 10, "the filter queue to be dropped (no hold left)")
    finally:
        gw.stop()
