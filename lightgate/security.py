"""Who may connect and what they may do: the gateway's `Security` (users from password_file, rules
from acl_file, anonymous access) built from the config, and its reload on SIGHUP. Shared by the
MQTT and Kafka servers, and built again by each `lightgate proxy` process from the same config."""

from __future__ import annotations

import ipaddress
import logging
import socket

from lightgate.config import ConfigError, GatewayConfig
from store.auth import AuthFileError, Security

log = logging.getLogger("lightgate")


def allow_anonymous(cfg: GatewayConfig) -> bool:
    """`allow_anonymous`: `auto` is true only for a gateway reachable from this host alone (every
    listener binds `host`, which must resolve to loopback addresses only) with no password file."""
    if cfg.allow_anonymous != "auto":
        return cfg.allow_anonymous == "true"
    if cfg.password_file:
        return False
    return is_loopback(cfg.host)


def is_loopback(host: str) -> bool:
    if host in ("", "0.0.0.0", "::"):
        return False
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def build_security(cfg: GatewayConfig) -> Security:
    """The Security of this config; a file that does not parse is a ConfigError (path:line)."""
    try:
        return Security.load(
            password_file=cfg.password_file,
            acl_file=cfg.acl_file,
            allow_anonymous=allow_anonymous(cfg),
        )
    except AuthFileError as exc:
        raise ConfigError(str(exc)) from None


def reload_security(security: Security) -> bool:
    """Reload both files; one log line per outcome (the error names path:line)."""
    errors = security.reload()
    for error in errors:
        log.error("reload refused, the previous users and ACL stay: %s", error)
    if not errors:
        log.info(
            "users and ACL reloaded",
            extra={
                "users": len(security.passwords) if security.passwords is not None else 0,
                "acl_rules": security.acl.rule_count(),
            },
        )
    return not errors
