"""`ProxySupervisor`: the core starts the `lightgate proxy` child, learns its endpoints, and
restarts it when it dies (lightgate/split.py, "Lifecycle")."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lightgate.config import GatewayConfig
from lightgate.split import READY_PREFIX, SECRET_ENV, core_secret

log = logging.getLogger("lightgate.split")


class ProxySupervisor:
    """Starts `lightgate proxy` as a child, learns its endpoints, restarts it if it dies."""

    def __init__(self, cfg: GatewayConfig, core: str) -> None:
        self.cfg = cfg
        self.core = core
        self.endpoints: dict[str, tuple[str, int]] = {}
        self.restarts = 0
        self._proc: asyncio.subprocess.Process | None = None
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False

    def _args(self) -> list[str]:
        conf = asdict(self.cfg)
        conf.pop("extra", None)
        conf.pop("core_secret", None)  # not in argv, where `ps` shows it: _child_env has it
        conf["core_secret_file"] = ""
        conf["data_dir"] = str(Path(self.cfg.data_dir).resolve())
        for name in ("password_file", "acl_file"):
            if conf.get(name):
                conf[name] = str(Path(conf[name]).resolve())
        ports = (("mqtt", "mqtt_port"), ("mqtts", "mqtts_port"), ("ws", "ws_port"),
                 ("wss", "wss_port"))  # fmt: skip
        for name, key in ports:
            if name in self.endpoints:  # a restarted child binds the ports clients know
                conf[key] = self.endpoints[name][1]
        return [
            sys.executable, "-m", "lightgate", "proxy", "--core", self.core,
            "--proxy-id", "mqtt-1", "--config-json", json.dumps(conf),
            "--exit-with-parent",
        ]  # fmt: skip

    async def start(self, timeout: float = 60.0) -> dict[str, tuple[str, int]]:
        await self._spawn(timeout)
        self._watch = asyncio.get_running_loop().create_task(self._watch_child())
        return self.endpoints

    async def _spawn(self, timeout: float) -> None:
        env = dict(os.environ)
        secret = core_secret(self.cfg)
        env.pop(SECRET_ENV, None)
        if secret is not None:
            env[SECRET_ENV] = secret.decode()
        proc = await asyncio.create_subprocess_exec(
            *self._args(),
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
        )
        self._proc = proc
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = await asyncio.wait_for(proc.stdout.readline(), max(0.1, left))
            except TimeoutError:
                line = b""
            if not line:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                raise OSError(f"the MQTT proxy process did not start (exit {proc.returncode})")
            text = line.decode(errors="replace").strip()
            if text.startswith(READY_PREFIX):
                break
        eps = {}
        for word in text[len(READY_PREFIX) :].split():
            name, _, addr = word.partition("=")
            host, _, port = addr.rpartition(":")
            eps[name] = (host, int(port))
        self.endpoints = eps
        log.info("mqtt proxy process %d ready", proc.pid, extra={"endpoints": text})

    async def _watch_child(self) -> None:
        while not self._stopping:
            proc = self._proc
            assert proc is not None
            code = await proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.error("the MQTT proxy process %d exited with %s; starting a new one",
                      proc.pid, code)  # fmt: skip
            await asyncio.sleep(min(5.0, 0.2 * self.restarts))
            try:
                await self._spawn(60.0)
            except OSError as exc:
                log.error("restarting the MQTT proxy failed: %s", exc)

    def reload(self) -> None:
        """Forward SIGHUP: the child re-reads password_file and acl_file itself."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGHUP)

    async def close(self) -> None:
        """Graceful: SIGTERM the child and wait for it (it flushes through the link first)."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                log.error("the MQTT proxy did not stop in 20 s; killing it")
                proc.kill()
                await proc.wait()
        if self._watch is not None:
            self._watch.cancel()
