"""Reading the configuration: TOML, `LIGHTGATE_*` env vars and CLI flags into a `GatewayConfig`,
each value coerced and checked against its row of the table (lightgate/config.py), unknown and
removed keys named with a hint, and the derived figures (`proxy_count`).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from lightgate.config import ConfigError, GatewayConfig, KeySpec

# `LIGHTGATE_*` environment names that are not config keys (not warned about as unknown).
ENV_NOT_KEYS = frozenset(
    {
        "LIGHTGATE_CONFIG",  # the TOML file, like --config
        "LIGHTGATE_ANALYTICS_OUT",  # `lightgate analytics` / the notebook: output directory
        "LIGHTGATE_TEST_INPROCESS",  # tests: run the MQTT broker fixture in-process
        "LIGHTGATE_NO_UVLOOP",  # bench: compare event loops
    }
)


@dataclass(frozen=True, slots=True)
class Key:
    """A row of the table as the validator and the docs read it."""

    name: str
    type: type
    default: Any
    spec: KeySpec

    def allowed(self) -> str:
        """The allowed values in words, as error messages and docs show them."""
        s = self.spec
        if s.allowed:
            return s.allowed
        if s.choices:
            return ", ".join(f"`{c}`" for c in s.choices)
        if self.type is bool:
            return "`true`, `false`"
        if s.lo is None and s.hi is None:
            return "any"
        span = f"{s.lo}..{s.hi}" if s.hi is not None else f">= {s.lo}"
        return " or ".join([*(f"`{w}`" for w in s.words), *(str(v) for v in s.also), span])

    def check(self, value: Any) -> None:
        s = self.spec
        if s.choices and value not in s.choices:
            raise ConfigError(
                f"{self.name}: {value!r} is not one of {self.allowed()}".replace("`", "")
            )
        if self.type is not int or value in s.also or value in s.words:
            return
        if (s.lo is not None and value < s.lo) or (s.hi is not None and value > s.hi):
            raise ConfigError(f"{self.name} = {value} is out of range: allowed {self.allowed()}")


def _table() -> dict[str, Key]:
    default = GatewayConfig()
    out: dict[str, Key] = {}
    for f in fields(GatewayConfig):
        if f.name == "extra":
            continue
        if "key" not in f.metadata:
            raise TypeError(f"GatewayConfig.{f.name}: declare it with key(default, description)")
        value = getattr(default, f.name)
        out[f.name] = Key(f.name, type(value), value, f.metadata["key"])
    return out


KEYS: dict[str, Key] = _table()


def closest_key(name: str) -> str | None:
    """The known key nearest to a mistyped one (difflib), for "did you mean" hints."""
    match = difflib.get_close_matches(name.lower().replace("-", "_"), KEYS, n=1, cutoff=0.6)
    return match[0] if match else None


# Keys that existed once: naming one says what replaced it instead of "unknown key".
REMOVED_KEYS = {
    "notify_transport": "notifications travel over the core link; delete this line",
    "notify_port": "notifications travel over the core link (core_listen); delete this line",
}


def unknown_key_error(name: str, where: str) -> ConfigError:
    if name in REMOVED_KEYS:
        return ConfigError(f"{where}: key {name!r} was removed: {REMOVED_KEYS[name]}")
    near = closest_key(name)
    hint = f" (did you mean {near!r}?)" if near else " (see docs/configuration.md)"
    return ConfigError(f"{where}: unknown key {name!r}{hint}")


def unknown_env_names(env: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """One warning per `LIGHTGATE_*` variable that names no key (such a variable is ignored)."""
    env = os.environ if env is None else env
    out = []
    for name in sorted(env):
        if not name.startswith("LIGHTGATE_") or name in ENV_NOT_KEYS:
            continue
        bare = name[len("LIGHTGATE_") :].lower()
        if bare in KEYS or bare.startswith(CLIENT_PREFIX):
            continue
        near = closest_key(bare)
        hint = f"; did you mean LIGHTGATE_{near.upper()}?" if near else ""
        out.append(f"environment variable {name} is not a config key, ignored{hint}")
    return out


_BOOL_WORDS = {
    "1": "true",
    "yes": "true",
    "on": "true",
    "0": "false",
    "no": "false",
    "off": "false",
}


def _coerce(name: str, value: Any) -> Any:
    k = KEYS[name]
    want = k.type
    if k.spec.words and isinstance(value, str) and value.strip().lower() in k.spec.words:
        return value.strip().lower()
    if k.spec.choices and isinstance(value, str):
        text = value.strip().lower()
        if "true" in k.spec.choices:  # a tri-state key takes the bool spellings too
            text = _BOOL_WORDS.get(text, text)
        return text
    if k.spec.choices and isinstance(value, bool):
        return "true" if value else "false"  # `allow_anonymous = true`, a TOML boolean
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
    for name, value in table.items():
        flat = f"{prefix}{name}".replace("-", "_")
        if isinstance(value, dict):
            out.update(_flatten(value, prefix=f"{flat}_"))
        else:
            out[flat] = value
    return out


def load_config(
    config_file: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> GatewayConfig:
    """Build the config: defaults < TOML file < `LIGHTGATE_*` env < explicit overrides (CLI flags)."""
    env = dict(os.environ if env is None else env)
    values: dict[str, Any] = {}
    client: dict[str, Any] = {}  # kafka_client_<name> -> the Kafka client's keyword <name>
    bridges: list[Any] = []  # [[bridge]] tables, as BridgeSettings (lightgate/bridge_config.py)
    path = config_file or env.get("LIGHTGATE_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                table = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path}: is a directory") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        if "bridge" in table:
            from lightgate.bridge_config import bridges_from_toml

            bridges = bridges_from_toml(table.pop("bridge"), Path(path).parent)
        for name, value in _flatten(table).items():
            bare = name
            if name.startswith(CLIENT_PREFIX):
                client[name[len(CLIENT_PREFIX) :]] = value
                continue
            if bare not in KEYS and "_" in name:
                # `[store] fsync = ...` flattens to store_fsync; accept the bare key as well.
                bare = name.split("_", 1)[1]
            if bare not in KEYS:
                raise unknown_key_error(name, f"config file {path}")
            values[bare] = _coerce(bare, value)
    for name in KEYS:
        env_value = env.get(f"LIGHTGATE_{name.upper()}")
        if env_value is not None:
            values[name] = _coerce(name, env_value)
    for env_name, env_value in env.items():
        if env_name.startswith("LIGHTGATE_KAFKA_CLIENT_"):
            client[env_name[len("LIGHTGATE_KAFKA_CLIENT_") :].lower()] = _client_value(env_value)
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name.startswith(CLIENT_PREFIX):
            client[name[len(CLIENT_PREFIX) :]] = _client_value(value)
            continue
        if name not in KEYS:
            raise unknown_key_error(name, "--set")
        values[name] = _coerce(name, value)
    cfg = GatewayConfig(**values)
    if client:
        cfg.extra["kafka_client"] = client
    if bridges:
        cfg.extra["bridges"] = bridges
    _validate(cfg)
    return cfg


CLIENT_PREFIX = "kafka_client_"


def _client_value(value: Any) -> Any:
    """A `kafka_client_*` value from the environment or --set (a string): true/false and
    integers as such, anything else as given."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def _validate(cfg: GatewayConfig) -> None:
    for name, k in KEYS.items():
        k.check(getattr(cfg, name))
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key must be set together")
    for name in ("tls_cert", "tls_key", "tls_ca", "core_secret_file", "password_file", "acl_file"):
        path = getattr(cfg, name)
        if path and not Path(path).is_file():
            raise ConfigError(f"{name}: no such file: {path}")
    for name in ("tls_require_client_cert", "tls_identity_as_username"):
        if getattr(cfg, name) and not cfg.tls_ca:
            raise ConfigError(
                f"{name} needs tls_ca: the CA certificates that sign client certificates"
            )
    if cfg.log == "kafka" and not cfg.kafka_bootstrap:
        raise ConfigError('log = "kafka" needs kafka_bootstrap ("host:port,...")')
    if cfg.core_secret and cfg.core_secret_file:
        raise ConfigError("core_secret and core_secret_file: set one, not both")


def proxy_count(cfg: GatewayConfig) -> int:
    """How many MQTT proxy processes `serve` starts (0: the proxy runs inside it).

    `auto`: one per core this process may run on, minus one for the core (store, dispatch,
    Kafka) when there are more than 2; on 2 cores both proxies share a core with the core."""
    n = cfg.mqtt_processes
    if n != "auto":
        return int(n)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - 1 if cores > 2 else cores)


def config_from_json(text: str) -> GatewayConfig:
    """A resolved config passed from `serve` to its proxy process (every key, already checked)."""
    import json

    values = {k: _coerce(k, v) for k, v in json.loads(text).items() if k in KEYS}
    cfg = GatewayConfig(**values)
    _validate(cfg)
    return cfg


def config_keys() -> dict[str, Any]:
    """Every key with its default, for docs and `lightgate serve --help`."""
    return {name: k.default for name, k in KEYS.items()}
