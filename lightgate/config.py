"""Gateway configuration: one TOML file, overridden by `LIGHTGATE_*` env vars, overridden by CLI flags.

Every key is flat (`mqtt_port = 1883`) so that the three sources name things the same way; a TOML
table such as `[store]` is accepted too and flattened as `store_<key>` only when that key exists.
Every default is documented in docs/configuration.md; a test keeps the two in step.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unknown or of the wrong type."""


@dataclass(slots=True)
class GatewayConfig:
    # Listeners. 0 picks a free port, -1 disables the listener.
    data_dir: str = "./data"
    host: str = "127.0.0.1"
    mqtt_port: int = 1883
    mqtts_port: int = 8883
    ws_port: int = 8083
    kafka_port: int = 9092
    http_port: int = 8080
    tls_cert: str = ""
    tls_key: str = ""

    # Store (commitlog).
    default_partitions: int = 4
    fsync: str = "always"
    fsync_interval_ms: int = 50
    segment_bytes: int = 256 * 1024 * 1024
    retention_ms: int = 7 * 24 * 3600 * 1000
    retention_bytes: int = -1
    retention_check_interval_ms: int = 60_000

    # MQTT.
    max_packet_size: int = 1024 * 1024
    max_keepalive: int = 600
    receive_maximum: int = 64
    max_session_expiry: int = 7 * 24 * 3600
    max_replay_depth_ms: int = 7 * 24 * 3600 * 1000
    sys_interval_s: int = 10
    allow_anonymous: bool = True
    filter_grace_ms: int = 60_000

    # Kafka.
    kafka_auto_create_topics: bool = True
    kafka_max_frame_bytes: int = 100 * 1024 * 1024

    # Processes: 0 runs the MQTT proxy inside `serve`; 1 runs it in a child process that reaches
    # the store and light queues over the core link (lightgate/split.py), using a second core.
    mqtt_processes: int = 0
    core_listen: str = ""  # the core link's address: "" = DATA/core.sock, or host:port, unix:/path
    recent_cache_bytes: int = 64 * 1024 * 1024  # per proxy: its appended messages kept for delivery

    # Notify: "inprocess" for the embedded default, "tcp" to serve proxies in other processes.
    notify_transport: str = "inprocess"
    notify_port: int = -1

    # Logging: "json" (structured) or "text".
    log_format: str = "json"
    log_level: str = "info"

    # Process: CPython's young-generation GC threshold (lightgate.cli.tune_gc); 0 = defaults.
    gc_gen0: int = 50_000

    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir)


_FIELDS = {f.name: f for f in fields(GatewayConfig) if f.name != "extra"}
_TYPES: dict[str, type] = {}
for _name, _f in _FIELDS.items():
    _TYPES[_name] = type(getattr(GatewayConfig(), _name))


def _coerce(name: str, value: Any) -> Any:
    want = _TYPES[name]
    if isinstance(value, want) and not (want is int and isinstance(value, bool)):
        return value
    if isinstance(value, str):
        text = value.strip()
        try:
            if want is bool:
                lowered = text.lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            if want is int:
                return int(text)
            if want is float:
                return float(text)
        except ValueError:
            raise ConfigError(f"{name}: expected {want.__name__}, got {value!r}") from None
        return text
    if want is float and isinstance(value, int):
        return float(value)
    raise ConfigError(f"{name}: expected {want.__name__}, got {type(value).__name__} {value!r}")


def _flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}".replace("-", "_")
        if isinstance(value, dict):
            out.update(_flatten(value, prefix=f"{name}_"))
        else:
            out[name] = value
    return out


def load_config(
    config_file: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> GatewayConfig:
    """Build the config: defaults < TOML file < `LIGHTGATE_*` env < explicit overrides (CLI flags)."""
    env = dict(os.environ if env is None else env)
    values: dict[str, Any] = {}
    path = config_file or env.get("LIGHTGATE_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                table = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        for key, value in _flatten(table).items():
            bare = key
            if bare not in _FIELDS and "_" in key:
                # `[store] fsync = ...` flattens to store_fsync; accept the bare key as well.
                bare = key.split("_", 1)[1]
            if bare not in _FIELDS:
                raise ConfigError(f"config file {path}: unknown key {key!r}")
            values[bare] = _coerce(bare, value)
    for name in _FIELDS:
        env_value = env.get(f"LIGHTGATE_{name.upper()}")
        if env_value is not None:
            values[name] = _coerce(name, env_value)
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in _FIELDS:
            raise ConfigError(f"unknown setting {name!r}")
        values[name] = _coerce(name, value)
    cfg = GatewayConfig(**values)
    _validate(cfg)
    return cfg


def _validate(cfg: GatewayConfig) -> None:
    for name in ("mqtt_port", "mqtts_port", "ws_port", "kafka_port", "http_port", "notify_port"):
        port = getattr(cfg, name)
        if port < -1 or port > 65535:
            raise ConfigError(f"{name}: {port} is not a port (0 = pick a free one, -1 = disabled)")
    if cfg.fsync not in ("always", "interval_ms", "never"):
        raise ConfigError(f"fsync: expected always, interval_ms or never, got {cfg.fsync!r}")
    if cfg.default_partitions < 1:
        raise ConfigError("default_partitions must be >= 1")
    if cfg.mqtt_processes not in (0, 1):
        raise ConfigError(
            "mqtt_processes: 0 (the proxy in serve) or 1 (one proxy process); more proxies per "
            "core need cross-proxy session ownership, which is not built yet"
        )
    if cfg.recent_cache_bytes < 0:
        raise ConfigError("recent_cache_bytes must be >= 0")
    if cfg.notify_transport not in ("inprocess", "tcp"):
        raise ConfigError("notify_transport: expected inprocess or tcp")
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key must be set together")
    if cfg.log_format not in ("json", "text"):
        raise ConfigError("log_format: expected json or text")


def config_from_json(text: str) -> GatewayConfig:
    """A resolved config passed from `serve` to its proxy process (every key, already checked)."""
    import json

    values = {k: _coerce(k, v) for k, v in json.loads(text).items() if k in _FIELDS}
    cfg = GatewayConfig(**values)
    _validate(cfg)
    return cfg


def config_keys() -> dict[str, Any]:
    """Every key with its default, for docs and `lightgate serve --help`."""
    default = GatewayConfig()
    return {name: getattr(default, name) for name in _FIELDS}
