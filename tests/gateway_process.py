"""Start a real `lightgate serve` process for end-to-end tests and stop it by its PID.

Every listener binds 127.0.0.1 on port 0; the ready line tells the ports. The process is stopped
with SIGTERM (graceful) or SIGKILL (crash tests), never by name.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class GatewayProcess:
    data_dir: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    endpoints: dict[str, tuple[str, int]] = field(default_factory=dict)
    ready_line: str = ""
    log_path: Path | None = None

    def start(self, timeout: float = 60.0) -> GatewayProcess:
        args = [
            sys.executable,
            "-m",
            "lightgate",
            "serve",
            "--data-dir",
            str(self.data_dir),
            "--mqtt-port",
            "0",
            "--ws-port",
            "0",
            # the TLS twins start only with a certificate; then on free ports too
            "--wss-port",
            "0",
            "--kafka-tls-port",
            "0",
            "--kafka-port",
            "0",
            "--http-port",
            "0",
            *self.extra_args,
        ]
        # Latency probes off unless a test asks (`--set probe_interval_ms=...` wins over the
        # env): users' figures leave them out, but their one message a second would add to the
        # latency histograms, log records and notify events other tests count.
        env = {
            **os.environ,
            "LIGHTGATE_LOG_FORMAT": "text",
            "LIGHTGATE_PROBE_INTERVAL_MS": "0",
            **self.env,
        }
        self.log_path = self.data_dir.parent / f"{self.data_dir.name}-gateway.log"
        log_fh = open(self.log_path, "ab")  # noqa: SIM115 - the child owns it while it runs
        self.proc = subprocess.Popen(
            args, cwd=ROOT, stdout=subprocess.PIPE, stderr=log_fh, env=env, start_new_session=True
        )
        log_fh.close()
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.kill()
                raise RuntimeError(f"gateway did not become ready; log:\n{self.log_text()}")
            if sel.select(timeout=min(left, 0.5)):
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk and self.proc.poll() is not None:
                    continue
                buf += chunk
        sel.close()
        self.ready_line = buf.split(b"\n", 1)[0].decode()
        self.endpoints = parse_ready_line(self.ready_line)
        return self

    def port(self, name: str) -> int:
        return self.endpoints[name][1]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        """Graceful stop (SIGTERM); returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL: the crash case."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def parse_ready_line(line: str) -> dict[str, tuple[str, int]]:
    words = line.split()
    if words[:2] != ["lightgate", "ready"]:
        raise ValueError(f"not a ready line: {line!r}")
    out = {}
    for word in words[2:]:
        name, _, addr = word.partition("=")
        host, _, port = addr.rpartition(":")
        out[name] = (host, int(port))
    return out
