"""The gateway under test in the MQTT end-to-end tests (the `broker` and `embedded` fixtures in
conftest.py run it).

Two ways to run the gateway under test, same interface (`port`, `ws_port`, `tls_port`,
`restart()`; `ProcessBroker` also has `crash_restart()`, SIGKILL then start):
- `InProcessBroker`: the real Store, light queues, notifier and `MqttServer` on their own event
  loop in a background thread, so tests can set the embedder hooks (`server.authenticate`, ACLs).
- `ProcessBroker`: a real `lightgate serve` subprocess (tests/gateway_process.py), as one
  process or with `split=True` as two (`mqtt_processes=1`: the MQTT proxy in a child process
  over the core link); the `broker` fixture runs every test in both modes
  (LIGHTGATE_TEST_INPROCESS=1 forces the in-process one). Tests that need the embedder hooks
  skip on it.
Both read what was stored with `records(log_topic)`, through the lock-free segment reader.
Tests are written with blocking paho clients (tests/mqtt_helpers.py) either way.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def make_tls_context(tmp: Path) -> tuple[ssl.SSLContext, Path]:
    """A throwaway self-signed cert (openssl CLI) and a server context for it."""
    import subprocess

    cert, key = tmp / "cert.pem", tmp / "key.pem"
    if not cert.exists():
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
             "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
            check=True, capture_output=True,
        )  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx, cert


class InProcessBroker:
    in_process = True

    def __init__(self, data_dir: Path, settings: dict[str, Any] | None = None) -> None:
        self.data_dir = data_dir
        self.settings_overrides = settings or {}
        self.port = self.ws_port = self.tls_port = 0
        self.cert: Path | None = None
        self.server: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._parts: dict[str, Any] = {}

    def start(self) -> InProcessBroker:
        ready: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.result(timeout=60)
        return self

    def _run(self, ready: Future[None]) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._main(ready))
        except BaseException as exc:  # pragma: no cover - surfaced through `ready`
            if not ready.done():
                ready.set_exception(exc)
        finally:
            loop.close()

    async def _main(self, ready: Future[None]) -> None:
        from mqtt_proxy.backends.backend import LocalBackend
        from mqtt_proxy.server import MqttServer
        from mqtt_proxy.settings import ProxySettings
        from store import Store, StoreConfig

        self._stop = asyncio.Event()
        store = await Store.open(self.data_dir, StoreConfig(fsync="always"))
        queues, notifier, extra = await open_queues(store, self.data_dir)
        settings = ProxySettings(**{"sys_interval_s": 1, **self.settings_overrides})
        backend = LocalBackend(store, queues, notifier, "mqtt-0", settings.recent_cache_bytes)
        server = MqttServer(backend, settings)
        self.server = server
        _, self.port = await server.start_tcp("127.0.0.1", self.port)
        _, self.ws_port = await server.start_ws("127.0.0.1", self.ws_port)
        ctx, self.cert = make_tls_context(self.data_dir.parent)
        _, self.tls_port = await server.start_tls("127.0.0.1", self.tls_port, ctx)
        ready.set_result(None)
        await self._stop.wait()
        await server.close()
        for closer in extra:
            await closer()
        await store.close()

    def call(self, fn: Any, *args: Any) -> Any:
        """Run `fn(*args)` on the broker's loop and return its result."""
        assert self._loop is not None

        async def run() -> Any:
            res = fn(*args)
            if asyncio.iscoroutine(res):
                res = await res
            return res

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(30)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)
            self._thread = None

    def restart(self) -> None:
        """Graceful stop and start on the same data dir and ports."""
        self.stop()
        self.start()

    def records(self, log_topic: str) -> list[Any]:
        return read_records(self.data_dir, log_topic)

    def stats(self) -> dict[str, Any]:
        return dict(self.call(self.server.stats))


class ProcessBroker:
    """`lightgate serve` as a subprocess on port 0 (MQTT, WebSocket and MQTT/TLS)."""

    in_process = False
    server = None

    def __init__(self, data_dir: Path, split: bool = False, pure: bool = False) -> None:
        from gateway_process import GatewayProcess

        _, self.cert = make_tls_context(data_dir.parent)
        key = data_dir.parent / "key.pem"
        self.data_dir = data_dir
        self.split = split
        mode = ["--set", "mqtt_processes=1"] if split else []
        self.gw = GatewayProcess(
            data_dir,
            ["--mqtts-port", "0", "--set", "sys_interval_s=1", *mode],
            {
                "LIGHTGATE_TLS_CERT": str(self.cert),
                "LIGHTGATE_TLS_KEY": str(key),
                # "pure": the compiled hot loops off (store/speedups.py), in the modules that
                # conftest.BOTH_IMPLS runs against both implementations
                **({"LIGHTGATE_NO_EXTENSIONS": "1"} if pure else {}),
            },
        )
        self.port = self.ws_port = self.tls_port = 0

    def start(self) -> ProcessBroker:
        self.gw.start()
        self.port = self.gw.port("mqtt")
        self.ws_port = self.gw.port("ws")
        self.tls_port = self.gw.port("mqtts")
        return self

    def stop(self) -> None:
        self.gw.stop()

    def stats(self) -> dict[str, float]:
        """The MQTT proxies' counters, scraped from /metrics and summed over processes:
        `lightgate_mqtt_X_total` as X, MQTT traffic as messages_/bytes_ received/sent."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{self.gw.port('http')}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("lightgate_mqtt_") and s.name.endswith("_total"):
                    key = s.name.removeprefix("lightgate_mqtt_").removesuffix("_total")
                elif s.name in ("lightgate_messages_total", "lightgate_bytes_total"):
                    if s.labels.get("protocol") != "mqtt":
                        continue
                    kind = s.name.removeprefix("lightgate_").removesuffix("_total")
                    way = "received" if s.labels["direction"] == "in" else "sent"
                    key = f"{kind}_{way}"
                else:
                    continue
                out[key] = out.get(key, 0.0) + s.value
        return out

    def restart(self) -> None:
        self.stop()
        self.start()

    def crash_restart(self) -> None:
        """SIGKILL (no graceful flush), then start again on the same data dir (new ports)."""
        self.gw.kill()
        self.start()

    def records(self, log_topic: str) -> list[Any]:
        return read_records(self.data_dir, log_topic)


def read_records(data_dir: Path, log_topic: str) -> list[Any]:
    """Every record of a log topic, as another process (Spark) would read it."""
    from store import segment_reader as sr

    out = []
    for part in range(sr.list_topics(data_dir).get(log_topic, 0)):
        out += list(sr.iter_records_from(data_dir, log_topic, part))
    return out


def serve_has_mqtt() -> bool:
    """Does `lightgate serve` run the MQTT proxy yet? (wiring lands in lightgate/app.py)"""
    app = ROOT / "lightgate" / "app.py"
    return app.exists() and "MqttServer" in app.read_text()


async def open_queues(store: Any, data_dir: Path) -> tuple[Any, Any, list[Any]]:
    """Light queues dispatching into an in-process notifier, as `lightgate serve` wires them."""
    from lightqueue.queues import LightQueueConfig, open_light_queues
    from notify import InProcessNotifier

    queues = open_light_queues(data_dir, store, config=LightQueueConfig(filter_grace_s=2.0))
    notifier = InProcessNotifier(last_seq_of=queues.last_seq, resync_interval=1.0)
    queues.set_sink(notifier.publish)
    await queues.start()
    notifier.start()
    return queues, notifier, [queues.close, notifier.close]
