"""The MQTT proxy in its own process: the shape, and the core link's address and security.

With `mqtt_processes = 1`, `lightgate serve` is two processes on two cores (N: N proxies):

- the **core** (this process): store, dispatcher and light queues (LevelDB), notify, the Kafka
  listener and HTTP. It serves the store, the light queues and notify on the core link
  (`core_listen`, by default a Unix socket in the data dir);
- the **proxy** (`lightgate proxy`, a child started and watched by `ProxySupervisor`): every MQTT
  listener (TCP, TLS, WebSocket), sessions and delivery. It parses PUBLISHes and builds their
  RecordBatches itself, appends them through the link, and delivers the light-queue entries the
  core pushes for the queues it watches (pulling only to catch up), resolving its own recent
  messages without asking the core.

The same `lightgate proxy --core HOST:PORT` runs on another host against a core whose
`core_listen` faces the network: the split is a configuration, not a different program. With
`mqtt_processes = N` (or `auto`) `serve` starts N proxies on the same ports (SO_REUSEPORT), and
more may join from other hosts; what must be one across them (client ids, sessions nobody holds,
wills, `$share` positions, `$SYS` sums, flow control) is the core's: lightgate/owners.py,
lightgate/shares.py, with the proxy's half in mqtt_proxy/backends/cluster.py.

Where the pieces are (docs/architecture.md, "The core link"): the core's end in
lightgate/core_link.py (services in lightgate/link_services.py, method numbers in
lightgate/link_registry.py), the proxy's main in lightgate/proxy_main.py, the supervisor in
lightgate/supervisor.py; this module keeps what both ends read from the config.

Lifecycle: the child prints `lightgate proxy ready mqtt=... ws=...`, the core then prints its own
ready line with those endpoints. If the child dies, the core logs it and starts a new one on the
same ports (the core holds the dead proxy's persistent sessions, re-holding their queues after
the link's holds were released, and publishes its wills; a client's CLAIM on any proxy resumes
its session). The child dies with the core (PR_SET_PDEATHSIG) and exits when the link drops.
Graceful stop: the core stops the child first (it flushes sessions and waits for its appends to
be durable), then itself.
"""

from __future__ import annotations

import os
import ssl
from pathlib import Path

from lightgate.config import ConfigError, GatewayConfig

READY_PREFIX = "lightgate proxy ready"
SECRET_ENV = "LIGHTGATE_CORE_SECRET"  # how `serve` hands the secret to its proxy child
# How `serve` hands its proxy children the secret that proves its latency probes (hex).
INTERNAL_SECRET_ENV = "LIGHTGATE_INTERNAL_SECRET"


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


def core_link_security(
    cfg: GatewayConfig, *, server: bool, address: str = ""
) -> tuple[bytes | None, ssl.SSLContext | None]:
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
