"""The MQTT proxy in its own process: the core's side of the link, the proxy's main, the supervisor.

With `mqtt_processes = 1`, `lightgate serve` is two processes on two cores:

- the **core** (this process): store, dispatcher and light queues (LevelDB), notify, the Kafka
  listener and HTTP. It serves the store, the light queues and notify on the core link
  (`core_listen`, by default a Unix socket in the data dir);
- the **proxy** (`lightgate proxy`, a child started and watched by `ProxySupervisor`): every MQTT
  listener (TCP, TLS, WebSocket), sessions and delivery. It parses PUBLISHes and builds their
  RecordBatches itself, appends them through the link, and delivers the light-queue entries the
  core pushes for the queues it watches (pulling only to catch up), resolving its own recent
  messages without asking the core.

The same `lightgate proxy --core HOST:PORT` runs on another host against a core whose
`core_listen` faces the network: the split is a configuration, not a different program. One proxy per core for now (sessions and `$share` groups live in the proxy;
several proxies would need the core to own client-id takeover and shared-group positions).

Lifecycle: the child prints `lightgate proxy ready mqtt=... ws=...`, the core then prints its own
ready line with those endpoints. If the child dies, the core logs it and starts a new one on the
same ports (persistent sessions resume from the core's store; the dead link's queue holds were
released). The child dies with the core (PR_SET_PDEATHSIG) and exits when the link drops.
Graceful stop: the core stops the child first (it flushes sessions and waits for its appends to
be durable), then itself.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightgate.config import ConfigError, GatewayConfig
from mqtt_proxy.cluster import TAKE, WAKE
from notify import Mailbox, frames
from store.rpc import AUTH_FAILED, RpcError, RpcPeer, RpcServer, connect

log = logging.getLogger("lightgate.split")

HELLO, STATS = 64, 65  # proxy → core: its id (one-way); core → proxy: its counters (JSON)
REGISTER, UNREGISTER, EVENTS = 66, 67, 68  # notify over the link (bodies as notify.frames)
READY_PREFIX = "lightgate proxy ready"
SECRET_ENV = "LIGHTGATE_CORE_SECRET"  # how `serve` hands the secret to its proxy child


def core_address(cfg: GatewayConfig) -> str:
    """Where the core link listens: `core_listen`, else a Unix socket in the data dir (an
    abstract one when that path is too long for a socket address)."""
    if cfg.core_listen:
        return cfg.core_listen
    path = str((cfg.data_path / "core.sock").resolve())
    if len(path.encode()) <= 100:
        return f"unix:{path}"
    return f"unix:\0lightgate-core-{os.getpid()}"


def core_secret(cfg: GatewayConfig) -> bytes | None:
    """`core_secret`, or the content of `core_secret_file` (trailing newline stripped)."""
    if cfg.core_secret_file:
        try:
            text = Path(cfg.core_secret_file).read_text()
        except (OSError, UnicodeError) as exc:
            raise ConfigError(
                f"core_secret_file {cfg.core_secret_file}: cannot read: {exc}"
            ) from None
        text = text.rstrip("\r\n")
        if not text:
            raise ConfigError(f"core_secret_file {cfg.core_secret_file}: is empty")
        return text.encode()
    return cfg.core_secret.encode() or None


def core_link_security(cfg: GatewayConfig, *, server: bool, address: str = "") -> tuple[Any, Any]:
    """(secret, TLS context) of the core link at `address` (the core's own: `core_address`).

    A TCP link carries every message and reaches the store: it needs `core_secret`, and with
    `core_tls` it is encrypted too. A Unix socket is guarded by its file permissions; a secret
    configured is still checked there, TLS is not used."""
    from lightgate.tls import core_client_context, server_context

    address = address or core_address(cfg)
    secret = core_secret(cfg)
    if address.startswith("unix:"):
        return secret, None
    if secret is None:
        end = "core_listen" if server else "--core"
        raise ConfigError(
            f"{end} {address} is a TCP core link: set core_secret (or core_secret_file, "
            "--core-secret-file, LIGHTGATE_CORE_SECRET) to the same value on the core and "
            "every proxy"
        )
    if not cfg.core_tls:
        return secret, None
    if server:
        if not (cfg.tls_cert and cfg.tls_key):
            raise ConfigError("core_tls needs tls_cert and tls_key on the core")
        return secret, server_context(cfg)
    return secret, core_client_context(cfg)


class CoreLink:
    """The core's end: store + light queues on the link, notify routed over it, proxies by id.

    Notify travels on the same link as the light queues' pushed entries: a dispatch round
    pushes a watched queue's new entries and then its event, in that order on one socket, so
    the proxy never asks the core for entries that were already on their way to it.
    """

    def __init__(
        self,
        store: Any,
        queues: Any,
        notifier: Any,
        *,
        secret: bytes | None = None,
        ssl_ctx: Any = None,
    ) -> None:
        from lightgate.owners import ClientRegistry
        from lightgate.shares import SharedGroups
        from lightqueue.remote import LightQueueService
        from store.remote import StoreService

        self.store_service = StoreService(store)
        self.queue_service = LightQueueService(queues)
        self.clients = ClientRegistry(store, queues)
        self.shares = SharedGroups(queues)
        self.routes = notifier.routes
        self.proxies: dict[str, RpcPeer] = {}
        methods = {
            **self.store_service.methods(),
            **self.queue_service.methods(),
            **self.clients.methods(),
            **self.shares.methods(),
            HELLO: self._hello,
            REGISTER: self._register,
            UNREGISTER: self._unregister,
        }
        self.server = RpcServer(
            methods,
            on_connect=self._connected,
            on_lost=self._lost,
            secret=secret,
            ssl_ctx=ssl_ctx,
        )

    async def start(self, address: str) -> str:
        self.clients.start()
        return await self.server.start(address)

    def _connected(self, peer: RpcPeer) -> None:
        self.store_service.peer_connected(peer)
        self.queue_service.peer_connected(peer)

    def _hello(self, peer: RpcPeer, body: bytes) -> None:
        proxy_id = body.decode()
        old = self.proxies.get(proxy_id)
        if old is not None and old is not peer:
            old.abort()  # a restarted proxy: the old link's routes go with it
        peer.name = proxy_id
        peer.state["proxy_id"] = proxy_id
        self.proxies[proxy_id] = peer
        self.routes.drop(proxy_id)
        box = self.routes.mailbox(proxy_id)
        box.on_ready = lambda b: self._ready(peer)
        log.info("proxy %s connected to the core link", proxy_id)

    def _ready(self, peer: RpcPeer) -> None:
        if not peer.state.get("drain"):
            peer.state["drain"] = True
            asyncio.get_running_loop().call_soon(self._drain, peer)

    def _drain(self, peer: RpcPeer) -> None:
        """Everything coalesced for this proxy since the last drain, in one EVENTS frame."""
        peer.state["drain"] = False
        pid = peer.state.get("proxy_id")
        if pid is None or self.proxies.get(pid) is not peer:
            return
        pending = self.routes.mailbox(pid).take()
        if pending:
            peer.send(EVENTS, frames.events_body(pending.items()))

    def _register(self, peer: RpcPeer, body: bytes) -> None:
        pid = peer.state.get("proxy_id")
        if pid is not None:
            self.routes.register(pid, frames.decode_body(frames.REGISTER, body), announce=True)

    def _unregister(self, peer: RpcPeer, body: bytes) -> None:
        pid = peer.state.get("proxy_id")
        if pid is not None:
            self.routes.unregister(pid, frames.decode_body(frames.UNREGISTER, body))

    def _lost(self, peer: RpcPeer, exc: Exception | None) -> None:
        self.store_service.peer_lost(peer)
        self.queue_service.peer_lost(peer)
        self.clients.peer_lost(peer)
        self.shares.peer_lost(peer)
        pid = peer.state.get("proxy_id")
        if pid is not None and self.proxies.get(pid) is peer:
            del self.proxies[pid]
            self.routes.drop(pid)
            log.info("proxy %s left the core link", pid)

    async def stats(self) -> dict[str, Any]:
        """The MQTT counters of every connected proxy, summed (numbers only)."""
        return (await self.figures(with_metrics=False))[0]

    async def figures(self, with_metrics: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """(counters summed over the proxies, the `MqttServer.metrics()` of the first one that
        answers): what the one-process gateway reads from its own MqttServer. One proxy per
        core today; summing labelled figures across several is left for then. A proxy that
        does not answer is logged once until it answers again."""
        out: dict[str, Any] = {}
        metrics: dict[str, Any] = {}
        for peer in list(self.proxies.values()):
            try:
                body = b"m" if with_metrics else b""
                stats = json.loads(await asyncio.wait_for(peer.call(STATS, body), 2.0))
            except Exception as exc:
                if not peer.state.get("stats_failing"):
                    log.warning("no stats from proxy %s: %r", peer.name, exc)
                peer.state["stats_failing"] = True
                continue
            peer.state["stats_failing"] = False
            if not metrics:
                metrics = stats.pop("metrics", None) or {}
            for k, v in stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
                elif k != "metrics":
                    out.setdefault(k, v)
        return out, metrics

    async def close(self) -> None:
        await self.server.close()


# -- the proxy process -------------------------------------------------------------------------
class LinkNotifier:
    """A proxy's notifier over the core link: the interface of `InProcessNotifier` that the
    MQTT proxy uses (register, unregister, drop, batches), events coalesced in a Mailbox."""

    def __init__(self, proxy_id: str) -> None:
        self.proxy_id = proxy_id
        self.peer: RpcPeer | None = None
        self._interest: set[str] = set()
        self._box = Mailbox(proxy_id)

    def methods(self) -> dict[int, Any]:
        return {EVENTS: self._on_events}

    def attach(self, peer: RpcPeer) -> None:
        self.peer = peer
        peer.closed.add_done_callback(lambda _f: self._box.close())

    def _on_events(self, peer: RpcPeer, body: bytes) -> None:
        interest, box = self._interest, self._box
        for q, seq in frames.decode_body(frames.EVENTS, body):  # type: ignore[attr-defined]
            if q in interest:
                box.put(q, seq)

    def register(self, proxy_id: str, queues: Any, announce: bool = True) -> None:
        """Add interest; the core answers each new queue with its current last sequence."""
        new = [q for q in queues if q not in self._interest]
        if new and self.peer is not None:
            self._interest.update(new)
            self.peer.send(REGISTER, frames.queues_body(new))

    def unregister(self, proxy_id: str, queues: Any) -> None:
        gone = [q for q in queues if q in self._interest]
        self._interest.difference_update(gone)
        for q in gone:
            self._box.pending.pop(q, None)
        if gone and self.peer is not None:
            self.peer.send(UNREGISTER, frames.queues_body(gone))

    def drop(self, proxy_id: str) -> None:
        self.unregister(proxy_id, list(self._interest))

    async def batches(self, proxy_id: str) -> Any:
        box = self._box
        while True:
            await box.wait()
            if box.closed and not box.pending:
                return
            yield box.take()


def exit_with_parent() -> None:
    """Linux: die with the process that started us (a `kill -9` of the core takes us along)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


async def run_proxy(cfg: GatewayConfig, core: str, proxy_id: str) -> int:
    """`lightgate proxy`: MQTT listeners over a remote core until SIGTERM or the link drops."""
    from lightgate.app import build_security, reload_security
    from lightgate.config import ConfigError
    from lightgate.tls import tls_context
    from lightqueue.remote import RemoteLightQueues
    from mqtt_proxy.server import MqttServer
    from mqtt_proxy.settings import ProxySettings
    from store.remote import RemoteStore

    rs, rq, notifier = RemoteStore(), RemoteLightQueues(), LinkNotifier(proxy_id)
    server: MqttServer | None = None

    def stats(peer: RpcPeer, body: bytes) -> bytes:
        if server is None:
            return b"{}"
        if body != b"m":  # counters only (the core's 1 s rate sample)
            return json.dumps(server.stats()).encode()
        return json.dumps({**server.stats(), "metrics": server.metrics()}).encode()

    from mqtt_proxy.cluster import ProxyCluster

    cluster: ProxyCluster | None = None

    def take(peer: RpcPeer, body: bytes) -> bytes:
        return b"[]" if cluster is None else cluster.methods()[TAKE](peer, body)

    def wake(peer: RpcPeer, body: bytes) -> None:
        if cluster is not None:
            cluster.methods()[WAKE](peer, body)

    methods = {**rs.methods(), **rq.methods(), **notifier.methods(), STATS: stats, TAKE: take,
               WAKE: wake}  # fmt: skip
    secret, ssl_ctx = core_link_security(cfg, server=False, address=core)
    try:
        peer = await connect(core, methods, name="core", secret=secret, ssl_ctx=ssl_ctx)
    except RpcError as exc:  # the handshake failed; a refusal was logged already (store.rpc)
        if exc.code != AUTH_FAILED:
            print(f"lightgate proxy: the core link to {core} failed: {exc}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        print(f"lightgate proxy: cannot reach the core at {core}: {exc}", file=sys.stderr)
        return 1
    peer.send(HELLO, proxy_id.encode())
    for part in (rs, rq, notifier):
        part.attach(peer)
    cluster = ProxyCluster(peer)
    await rs.start()
    try:
        security = build_security(cfg)
    except ConfigError as exc:
        print(f"lightgate proxy: {exc}", file=sys.stderr)
        peer.close()
        return 2
    # Each process reads the files itself: `serve` forwards its SIGHUP here (ProxySupervisor).
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_security, security)
    server = MqttServer(
        rs,
        rq,
        notifier,
        ProxySettings.from_config(cfg),
        proxy_id=proxy_id,
        remote=True,
        security=security,
    )
    server.backend.cluster = cluster
    server.delivery.leases = cluster
    cluster.server = server
    endpoints: dict[str, tuple[str, int]] = {}
    try:
        await server.start()
        if cfg.mqtt_port != -1:
            endpoints["mqtt"] = await server.start_tcp(cfg.host, cfg.mqtt_port)
        if cfg.tls_cert and cfg.mqtts_port != -1:
            endpoints["mqtts"] = await server.start_tls(cfg.host, cfg.mqtts_port, tls_context(cfg))
        if cfg.ws_port != -1:
            endpoints["ws"] = await server.start_ws(cfg.host, cfg.ws_port)
        if cfg.tls_cert and cfg.wss_port != -1:
            endpoints["wss"] = await server.start_ws(cfg.host, cfg.wss_port, tls_context(cfg))
    except OSError as exc:
        print(f"lightgate proxy: cannot start: {exc}", file=sys.stderr)
        await server.close()
        peer.close()
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    peer.closed.add_done_callback(lambda _f: stop.set())
    parts = " ".join(f"{k}={h}:{p}" for k, (h, p) in endpoints.items())
    print(f"{READY_PREFIX} {parts}".rstrip(), flush=True)
    log.info("mqtt proxy ready", extra={"proxy_id": proxy_id, "core": core})
    await stop.wait()
    lost = peer.closed.done()
    if lost:
        log.error("core link lost; the proxy stops (its supervisor starts a new one)")
    await server.close()
    if not lost:
        try:
            await asyncio.wait_for(rs.barrier(), 5)  # the core has what close() sent
        except Exception as exc:
            log.warning("no answer from the core before closing: %r", exc)
    peer.close()
    return 1 if lost else 0


# -- the supervisor in the core ------------------------------------------------------------------
class ProxySupervisor:
    """Starts `count` `lightgate proxy` children on the same ports, restarts any that dies.

    The first child binds the configured ports (0 picks free ones); the others, and every
    restarted child, bind the ports the first one reported, with SO_REUSEPORT, so clients
    keep one address whichever proxy the kernel hands their connection to."""

    def __init__(self, cfg: GatewayConfig, core: str, count: int = 1) -> None:
        self.cfg = cfg
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
