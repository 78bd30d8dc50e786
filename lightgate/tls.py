"""TLS contexts of the listeners and the core link, built from `tls_cert`, `tls_key`, `tls_ca`.

One place builds them so that every failure names the key and the file (OpenSSL's own messages
name neither). Client certificates:

- MQTT listeners (`mqtts`, `wss`) verify a presented certificate against `tls_ca` and accept a
  client without one at the TLS level: the CONNECT handler then refuses it with a reason code
  (0x05 / 0x87) when `tls_require_client_cert` or `tls_identity_as_username` asks for one, which
  tells an MQTT client why, where a failed handshake tells it nothing;
- Kafka/TLS and the core link have no such answer, so `tls_require_client_cert` fails their
  handshake (as Kafka's `ssl.client.auth=required` does).
"""

from __future__ import annotations

import ssl
from typing import Any

from lightgate.config import ConfigError, GatewayConfig


def _no_passphrase() -> bytes:
    raise ConfigError("tls_key is encrypted with a passphrase; give lightgate an unencrypted key")


def _load_chain(ctx: ssl.SSLContext, cfg: GatewayConfig) -> None:
    try:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key, password=_no_passphrase)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"tls_cert {cfg.tls_cert} / tls_key {cfg.tls_key}: cannot load: {exc}"
        ) from None


def _load_ca(ctx: ssl.SSLContext, cfg: GatewayConfig) -> None:
    try:
        ctx.load_verify_locations(cafile=cfg.tls_ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls_ca {cfg.tls_ca}: cannot load: {exc}") from None


def server_context(cfg: GatewayConfig, *, enforce_client_cert: bool = True) -> ssl.SSLContext:
    """A listener's context. `enforce_client_cert=False` (MQTT): verify a presented client
    certificate but let a client without one finish the handshake (CONNECT refuses it)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    _load_chain(ctx, cfg)
    if cfg.tls_ca:
        _load_ca(ctx, cfg)
        required = enforce_client_cert and cfg.tls_require_client_cert
        ctx.verify_mode = ssl.CERT_REQUIRED if required else ssl.CERT_OPTIONAL
    return ctx


def tls_context(cfg: GatewayConfig) -> ssl.SSLContext:
    """The MQTT listeners' context (mqtts, wss)."""
    return server_context(cfg, enforce_client_cert=False)


def core_client_context(cfg: GatewayConfig) -> ssl.SSLContext:
    """A proxy's side of a `core_tls` link: verify the core against `tls_ca` (the system's CAs
    without it) and the `--core` host name. With `tls_require_client_cert` (which the core has
    too) present `tls_cert`; not otherwise, as a server certificate is often not valid for
    client use and the core would refuse it where it asked for nothing."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if cfg.tls_ca:
        _load_ca(ctx, cfg)
    if cfg.tls_require_client_cert and cfg.tls_cert and cfg.tls_key:
        _load_chain(ctx, cfg)
    return ctx


class TlsReloader:
    """The listeners' contexts, their certificate and key loaded again on SIGHUP.

    An `SSLContext` takes a new chain in place: handshakes from then on present it, open
    connections keep theirs. The files are first loaded into a scratch context, so a bad or
    half-written pair (a key not matching its certificate) leaves every listener as it was.
    `tls_ca` is loaded again too; OpenSSL only adds to a context's trust store, so a CA removed
    from the file stays trusted until restart.
    """

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        self.contexts: list[ssl.SSLContext] = []

    def add(self, ctx: ssl.SSLContext) -> ssl.SSLContext:
        self.contexts.append(ctx)
        return ctx

    def reload(self) -> str | None:
        """Load the files again; the error (key and path named) or None."""
        cfg = self.cfg
        if not self.contexts or not (cfg.tls_cert and cfg.tls_key):
            return None
        try:
            server_context(cfg)  # everything loads, or nothing changes
            for ctx in self.contexts:
                _load_chain(ctx, cfg)
                if cfg.tls_ca:
                    _load_ca(ctx, cfg)
        except ConfigError as exc:
            return str(exc)
        return None


def check_tls_files(cfg: GatewayConfig) -> None:
    """Preflight: load every TLS file the config names, so a bad one stops `serve` before it
    opens anything, with the key and the path in the message."""
    if cfg.tls_cert and cfg.tls_key:
        server_context(cfg)
    elif cfg.tls_ca:
        _load_ca(ssl.create_default_context(ssl.Purpose.SERVER_AUTH), cfg)


def certificate_cn(cert: dict[str, Any]) -> str | None:
    """The subject CN of a verified peer certificate (`SSLObject.getpeercert()`), or None:
    the user name under `tls_identity_as_username` (the MQTT side reads it the same way in
    mqtt_proxy/connection/connect_handler.py, which may not import lightgate)."""
    for rdn in cert.get("subject", ()):
        for name, value in rdn:
            if name == "commonName" and value:
                return str(value)
    return None
