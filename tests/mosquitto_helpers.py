"""A real Mosquitto broker (Debian's) for the bridge tests: started on a free loopback port with
a generated mosquitto.conf, stopped by its PID; restartable on the same port with its
persistence file, so a far-side subscriber's queued messages survive the remote's restart."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from tansu import free_port

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto"
                                           if Path("/usr/sbin/mosquitto").exists() else None)  # fmt: skip


@dataclass
class Mosquitto:
    dir: Path
    port: int = 0
    extra: list[str] = field(default_factory=list)  # more mosquitto.conf lines (listener options)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def conf(self) -> Path:
        return self.dir / "mosquitto.conf"

    @property
    def log_path(self) -> Path:
        return self.dir / "mosquitto.log"

    def start(self) -> Mosquitto:
        assert MOSQUITTO is not None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        lines = [
            f"listener {self.port} 127.0.0.1",
            "persistence true",
            f"persistence_location {self.dir}/",
            "max_queued_messages 0",  # no limit: an offline subscriber's queue holds everything
            "max_inflight_messages 100",
            # Run as root (a container), Mosquitto drops to the `mosquitto` user and can then not
            # write its persistence file in our directory: stay who we are.
            *([f"user {pwd.getpwuid(os.getuid()).pw_name}"] if os.getuid() == 0 else []),
            "log_dest stderr",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            *(self.extra or ["allow_anonymous true"]),
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        with open(self.log_path, "ab") as fh:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited:\n{self.log_path.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mosquitto did not listen:\n{self.log_path.read_text()}")

    def stop(self) -> None:
        """SIGTERM (Mosquitto writes its persistence file), SIGKILL after 10 s."""
        p, self.proc = self.proc, None
        if p is None or p.poll() is not None:
            return
        os.kill(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(5)


class FarSide:
    """A paho subscriber on the remote with a persistent session (QoS 1), collecting payloads in
    arrival order; it reconnects by itself when the remote comes back."""

    def __init__(self, port: int, filt: str, client_id: str = "far-side", qos: int = 1) -> None:
        self.payloads: list[bytes] = []
        self.topics: list[str] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        c = self.client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                                      clean_session=False)  # fmt: skip
        c.reconnect_delay_set(0.1, 0.5)

        def on_connect(
            cl: mqtt.Client, ud: object, flags: object, rc: object, props: object = None
        ) -> None:
            cl.subscribe(filt, qos)

        def on_subscribe(*args: object) -> None:
            self._subscribed.set()

        def on_message(cl: mqtt.Client, ud: object, msg: mqtt.MQTTMessage) -> None:
            with self._lock:
                self.payloads.append(msg.payload)
                self.topics.append(msg.topic)

        c.on_connect = on_connect
        c.on_subscribe = on_subscribe
        c.on_message = on_message
        c.connect("127.0.0.1", port)
        c.loop_start()
        if not self._subscribed.wait(10):
            raise RuntimeError("far-side subscriber did not subscribe")

    def wait_for(self, n: int, timeout: float = 60.0) -> list[bytes]:
        """The payloads once at least `n` distinct ones arrived (duplicates allowed: at least once)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if len(set(self.payloads)) >= n:
                    return list(self.payloads)
            time.sleep(0.05)
        with self._lock:
            got = list(self.payloads)
        raise AssertionError(f"{len(set(got))} of {n} messages arrived in {timeout} s")

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def in_order_once_each(payloads: list[bytes], want: list[bytes]) -> None:
    """Every wanted payload arrived, and the first arrivals are in the wanted order (a resend
    after an outage may repeat a message: at least once, never out of order)."""
    seen: list[bytes] = []
    known: set[bytes] = set()
    for p in payloads:
        if p not in known:
            known.add(p)
            seen.append(p)
    missing = [w for w in want if w not in known]
    assert not missing, f"{len(missing)} lost, first {missing[:3]}"
    assert [p for p in seen if p in set(want)] == want, "out of order"
