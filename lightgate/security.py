"""Who may connect and what they may do: the gateway's `Security` (users from password_file, rules
from acl_file, anonymous access) built from the config, and its reload on SIGHUP. Shared by the
MQTT and Kafka servers, and built again by each `lightgate proxy` process from the same config."""

from __future__ import annotations

import ipaddress
import logging
import socket

from lightgate.config import ConfigError, GatewayConfig
from lightgate.tls import TlsReloader
from store.auth import AuthFileError, Security
from store.auth.http_hook import HttpAuth, HttpHookSettings
from store.auth.jwt_auth import JwtAuth, JwtSettings

_JWT_ALGORITHMS = ("HS256", "RS256", "ES256")

log = logging.getLogger("lightgate")


def allow_anonymous(cfg: GatewayConfig) -> bool:
    """`allow_anonymous`: `auto` is true only for a gateway reachable from this host alone (every
    listener binds `host`, which must resolve to loopback addresses only) that knows no users: an
    operator who configured any source of identity (password file, token keys, an HTTP hook) means
    clients to carry one, so `auto` does not leave a door open beside it."""
    if cfg.allow_anonymous != "auto":
        return cfg.allow_anonymous == "true"
    if (
        cfg.password_file
        or cfg.auth_jwt_secret_file
        or cfg.auth_jwt_key_file
        or cfg.auth_jwt_jwks_url
        or cfg.auth_http_connect_url
    ):
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
        security = Security.load(
            password_file=cfg.password_file,
            acl_file=cfg.acl_file,
            allow_anonymous=allow_anonymous(cfg),
        )
        jwt_settings = jwt_settings_of(cfg)
        if jwt_settings.enabled:
            security.jwt = JwtAuth.load(jwt_settings)
    except AuthFileError as exc:
        raise ConfigError(str(exc)) from None
    hook = HttpHookSettings(
        connect_url=cfg.auth_http_connect_url,
        acl_url=cfg.auth_http_acl_url,
        connect_body=cfg.auth_http_connect_body,
        acl_body=cfg.auth_http_acl_body,
        timeout_s=cfg.auth_http_timeout_ms / 1000,
        cache_ttl_s=cfg.auth_http_cache_ttl_s,
        max_in_flight=cfg.auth_http_max_in_flight,
    )
    if hook.enabled:
        try:
            security.http = HttpAuth(hook)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return security


def jwt_settings_of(cfg: GatewayConfig) -> JwtSettings:
    algorithms = tuple(a.strip() for a in cfg.auth_jwt_algorithms.split(",") if a.strip())
    wrong = [a for a in algorithms if a not in _JWT_ALGORITHMS]
    if wrong or not algorithms:
        raise ConfigError(
            f"auth_jwt_algorithms: {', '.join(wrong) or 'empty'}: not among {', '.join(_JWT_ALGORITHMS)}"
        )
    return JwtSettings(
        secret_file=cfg.auth_jwt_secret_file,
        key_file=cfg.auth_jwt_key_file,
        jwks_url=cfg.auth_jwt_jwks_url,
        jwks_refresh_s=cfg.auth_jwt_jwks_refresh_s,
        jwks_min_interval_s=cfg.auth_jwt_jwks_min_interval_s,
        algorithms=algorithms,
        username_claim=cfg.auth_jwt_username_claim,
        acl_claim=cfg.auth_jwt_acl_claim,
        issuer=cfg.auth_jwt_issuer,
        audience=cfg.auth_jwt_audience,
        leeway_s=cfg.auth_jwt_leeway_s,
        require_exp=cfg.auth_jwt_require_exp,
    )


def reload_tls(certificates: TlsReloader) -> bool:
    """Load the listeners' certificate and key again; one log line per outcome."""
    error = certificates.reload()
    if error is not None:
        log.error("TLS reload refused, the previous certificate stays: %s", error)
    elif certificates.contexts:
        log.info("TLS certificate reloaded", extra={"listeners": len(certificates.contexts)})
    return error is None


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
