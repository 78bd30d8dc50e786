"""`ProxySupervisor`: the core starts its `lightgate proxy` children (`mqtt_processes`), learns
their endpoints, and restarts any that dies (lightgate/split.py, "Lifecycle")."""

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
from lightgate.split import INTERNAL_SECRET_ENV, READY_PREFIX, SECRET_ENV, core_secret

log = logging.getLogger("lightgate.split")


class ProxySupervisor:
    """Starts `count` `lightgate proxy` children on the same ports, restarts any that dies.

    The first child binds the configured ports (0 picks free ones); the others, and every
    restarted child, bind the ports the first one reported, with SO_REUSEPORT, so clients
    keep one address whichever proxy the kernel hands their connection to."""

    def __init__(
        self, cfg: GatewayConfig, core: str, count: int = 1, internal_secret: bytes = b""
    ) -> None:
        self.cfg = cfg
        self.internal_secret = internal_secret  # proves serve's probes to the children
        self.core = core
        self.count = max(1, count)
        self.endpoints: dict[str, tuple[str, int]] = {}
        self.restarts = 0
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._watch: list[asyncio.Task[None]] = []
        self._stopping = False

    def _args(self, index: int) -> list[str]:
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
            if name in self.endpoints:  # later and restarted children bind the ports clients know
                conf[key] = self.endpoints[name][1]
        return [
            sys.executable, "-m", "lightgate", "proxy", "--core", self.core,
            "--proxy-id", f"mqtt-{index}", "--config-json", json.dumps(conf),
            "--exit-with-parent",
        ]  # fmt: skip

    async def start(self, timeout: float = 60.0) -> dict[str, tuple[str, int]]:
        await self._spawn(1, timeout)
        if self.count > 1:
            await asyncio.gather(*(self._spawn(i, timeout) for i in range(2, self.count + 1)))
        loop = asyncio.get_running_loop()
        self._watch = [loop.create_task(self._watch_child(i)) for i in self._procs]
        return self.endpoints

    @property
    def pids(self) -> list[int]:
        """The running children's process ids, in proxy order (tests, `ps`)."""
        return [p.pid for _i, p in sorted(self._procs.items()) if p.returncode is None]

    async def _spawn(self, index: int, timeout: float) -> None:
        env = dict(os.environ)
        secret = core_secret(self.cfg)
        env.pop(SECRET_ENV, None)
        if secret is not None:
            env[SECRET_ENV] = secret.decode()
        env[INTERNAL_SECRET_ENV] = self.internal_secret.hex()
        proc = await asyncio.create_subprocess_exec(
            *self._args(index),
            stdout=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            env=env,
        )
        self._procs[index] = proc
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
        if not self.endpoints:
            self.endpoints = eps
        log.info("mqtt proxy process mqtt-%d (pid %d) ready", index, proc.pid,
                 extra={"endpoints": text})  # fmt: skip

    async def _watch_child(self, index: int) -> None:
        while not self._stopping:
            proc = self._procs[index]
            code = await proc.wait()
            if self._stopping:
                return
            self.restarts += 1
            log.error("the MQTT proxy process mqtt-%d (pid %d) exited with %s; starting a new one",
                      index, proc.pid, code)  # fmt: skip
            await asyncio.sleep(min(5.0, 0.2 * self.restarts))
            try:
                await self._spawn(index, 60.0)
            except OSError as exc:
                log.error("restarting the MQTT proxy mqtt-%d failed: %s", index, exc)

    def reload(self) -> None:
        """Forward SIGHUP: each child re-reads password_file and acl_file itself."""
        for proc in self._procs.values():
            if proc.returncode is None:
                proc.send_signal(signal.SIGHUP)

    async def close(self) -> None:
        """Graceful: SIGTERM the children and wait for them (each flushes through the link)."""
        self._stopping = True
        live = [p for p in self._procs.values() if p.returncode is None]
        for proc in live:
            proc.send_signal(signal.SIGTERM)

        async def reap(proc: asyncio.subprocess.Process) -> None:
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                log.error("the MQTT proxy %d did not stop in 20 s; killing it", proc.pid)
                proc.kill()
                await proc.wait()

        await asyncio.gather(*(reap(p) for p in live))
        for task in self._watch:
            task.cancel()
