"""`[[bridge]]` tables: each becomes a checked `BridgeSettings` (mqtt_proxy/bridge).

A bridge is a table in a list, so it is not a row of `GatewayConfig`; its keys are the table
`BRIDGE_KEYS` below, from which docs/bridges.md's key table is written
(`python -m lightgate.config_docs`; a test keeps them equal). Errors name the bridge and the key,
as `bridge 'edge': keepalive = -1 is out of range: allowed 0..65535`.

A bridge's topic rules and settings may also come as a Mosquitto bridge section, unchanged
(the key `mosquitto`, a multi-line string, or `mosquitto_file`, a path): the keys of the table
win over the section's.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightgate.config import ConfigError
from mqtt_proxy.bridge import BridgeSettings, TopicRule, parse_topic_line


@dataclass(frozen=True, slots=True)
class BridgeKey:
    type: type
    default: Any
    doc: str
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()


_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
PROTOCOLS = {"3.1.1": 4, "5.0": 5, "mqttv311": 4, "mqttv50": 5, "5": 5, "4": 4}

BRIDGE_KEYS: dict[str, BridgeKey] = {
    "name": BridgeKey(str, "", "the bridge's name (required, unique): letters, digits, `.`, `_`, "
                      "`-`; it keys the bridge's position, so renaming starts it over"),
    "address": BridgeKey(str, "", "the remote broker, `host:port` (required; port 1883 when left out)"),
    "protocol": BridgeKey(str, "3.1.1", "MQTT version spoken to the remote", choices=("3.1.1", "5.0")),
    "client_id": BridgeKey(str, "", "client id on the remote; empty: `lightgate-bridge-<name>`"),
    "username": BridgeKey(str, "", "user name on the remote; empty: none"),
    "password": BridgeKey(str, "", "password on the remote (prefer `password_file`)"),
    "password_file": BridgeKey(str, "", "file whose first line is the password on the remote"),
    "keepalive": BridgeKey(int, 60, "MQTT keep alive in seconds; `0` turns pings off", lo=0, hi=65535),
    "clean_session": BridgeKey(bool, False, "start a clean session on the remote at each connect; "
                               "`false` keeps the remote session (and its `in` messages) across "
                               "reconnects"),
    "tls_ca": BridgeKey(str, "", "CA certificates that sign the remote's certificate; setting it "
                        "(or `tls_cert`) turns TLS on"),
    "tls_cert": BridgeKey(str, "", "client certificate presented to the remote (PEM)"),
    "tls_key": BridgeKey(str, "", "key of `tls_cert` (PEM)"),
    "tls_server_name": BridgeKey(str, "", "the name the remote's certificate must carry (and SNI); "
                                 "empty: the host of `address`"),
    "tls_insecure": BridgeKey(bool, False, "TLS without checking the remote's certificate (tests "
                              "only)"),
    "local_username": BridgeKey(str, "", "user whose ACL rules decide which local topics the `in` "
                                "rules may write; empty: the rules of anonymous clients"),
    "local_client_id": BridgeKey(str, "", "client id of the messages the bridge appends locally "
                                 "(its `%c` in ACL patterns); empty: `bridge-<name>`"),
    "max_inflight": BridgeKey(int, 1000, "QoS 1 messages sent and not yet acknowledged (the "
                              "remote's Receive Maximum bounds it too)", lo=1, hi=65535),
    "reconnect_min_ms": BridgeKey(int, 500, "first wait before reconnecting; doubled at each "
                                  "failure", lo=10, hi=3_600_000),
    "reconnect_max_ms": BridgeKey(int, 30_000, "longest wait between reconnects", lo=10,
                                  hi=3_600_000),
    "topics": BridgeKey(list, [], "topic rules, each a Mosquitto `topic` line without the word: "
                        "`<pattern> [out\\|in\\|both] [qos] [local-prefix] [remote-prefix]`"),
    "mosquitto": BridgeKey(str, "", "a Mosquitto bridge section as it stands (`connection`, "
                           "`address`, `topic`, `remote_username`, ...); the table's keys win"),
    "mosquitto_file": BridgeKey(str, "", "a Mosquitto config file holding the section "
                                "(`connection <name>`, or its only one)"),
}  # fmt: skip

# Mosquitto bridge options -> our key (values converted by _from_mosquitto).
_MOSQ = {
    "address": "address", "addresses": "address", "remote_clientid": "client_id",
    "remote_username": "username", "remote_password": "password",
    "keepalive_interval": "keepalive", "cleansession": "clean_session",
    "bridge_protocol_version": "protocol", "bridge_cafile": "tls_ca",
    "bridge_certfile": "tls_cert", "bridge_keyfile": "tls_key", "bridge_insecure": "tls_insecure",
    "local_clientid": "local_client_id", "local_username": "local_username",
    "bridge_max_inflight_messages": "max_inflight",
}  # fmt: skip
# Mosquitto options that do not apply here (state kept in the log, no notifications topic...).
_MOSQ_IGNORED = {
    "try_private", "notifications", "notifications_local_only", "notification_topic",
    "start_type", "restart_timeout", "idle_timeout", "threshold", "round_robin",
    "local_password", "bridge_attempt_unsubscribe", "bridge_outgoing_retain", "bridge_capath",
    "bridge_tls_version", "bridge_require_ocsp", "bridge_alpn", "bridge_bind_address",
    "bridge_max_packet_size", "bridge_identity", "bridge_psk", "local_cleansession",
    "bridge_reload_type", "bridge_receive_maximum", "bridge_session_expiry_interval",
    "bridge_max_topic_alias", "bridge_tcp_keepalive", "bridge_tcp_user_timeout",
}  # fmt: skip


def _err(name: str, msg: str) -> ConfigError:
    return ConfigError(f"bridge {name!r}: {msg}")


def mosquitto_section(text: str, name: str, where: str) -> dict[str, Any]:
    """Our keys from a Mosquitto bridge section (the one of `connection <name>`, or the only
    one; lines before the first `connection` are the broker's own settings and are skipped)."""
    sections: list[tuple[str, list[tuple[int, str, str]]]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        if word == "connection":
            sections.append((rest.strip(), []))
        elif sections:
            sections[-1][1].append((n, word, rest.strip()))
    if not sections:
        raise _err(name, f"{where}: no `connection` line")
    chosen = [s for s in sections if s[0] == name] or (sections if len(sections) == 1 else [])
    if not chosen:
        raise _err(name, f"{where}: no `connection {name}` among {[s[0] for s in sections]}")
    out: dict[str, Any] = {"topics": []}
    for n, word, rest in chosen[0][1]:
        if word == "topic":
            out["topics"].append(rest)
        elif word in _MOSQ:
            key = _MOSQ[word]
            value: Any = rest
            if key == "address":
                value = rest.split()[0]  # the first of `addresses`
            elif key in ("clean_session", "tls_insecure"):
                value = rest.lower() == "true"
            elif key in ("keepalive", "max_inflight"):
                value = _int(rest, name, f"{where} line {n}: {word}")
            out[key] = value
        elif word not in _MOSQ_IGNORED:
            raise _err(name, f"{where} line {n}: {word}: not a Mosquitto bridge option we know")
    return out


def _int(text: str, name: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _err(name, f"{what}: expected an integer, got {text!r}") from None


def _check(name: str, key: str, value: Any) -> Any:
    spec = BRIDGE_KEYS.get(key)
    if spec is None:
        match = difflib.get_close_matches(key, BRIDGE_KEYS, n=1, cutoff=0.6)
        near = match[0] if match else None
        hint = f" (did you mean {near!r}?)" if near else " (see docs/bridges.md)"
        raise _err(name, f"unknown key {key!r}{hint}")
    if spec.type is int and isinstance(value, str):
        value = _int(value, name, key)
    if spec.type is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, spec.type) or (spec.type is int and isinstance(value, bool)):
        raise _err(name, f"{key}: expected {spec.type.__name__}, got {value!r}")
    if isinstance(value, int) and ((spec.lo is not None and value < spec.lo)
                                   or (spec.hi is not None and value > spec.hi)):  # fmt: skip
        raise _err(name, f"{key} = {value} is out of range: allowed {spec.lo}..{spec.hi}")
    if key == "protocol" and value not in PROTOCOLS:
        raise _err(name, f"protocol: {value!r} is not one of 3.1.1, 5.0")
    return value


def bridge_settings(table: Any, index: int, base: Path | None = None) -> BridgeSettings:
    """One `[[bridge]]` table (the `index`-th) as BridgeSettings; ConfigError naming the key."""
    if not isinstance(table, dict):
        raise ConfigError(f"bridge #{index + 1}: expected a table ([[bridge]]), got {table!r}")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"bridge #{index + 1}: name: required, letters, digits, ., _ or - "
                          f"(got {name!r})")  # fmt: skip
    values: dict[str, Any] = {}
    mosq_text = table.get("mosquitto")
    mosq_file = table.get("mosquitto_file")
    if mosq_file:
        path = Path(str(mosq_file))
        if base is not None and not path.is_absolute():
            path = base / path
        try:
            values.update(mosquitto_section(path.read_text(), name, f"mosquitto_file {path}"))
        except OSError as exc:
            raise _err(name, f"mosquitto_file: cannot read {path}: {exc.strerror}") from None
    if mosq_text:
        values.update(mosquitto_section(str(mosq_text), name, "mosquitto"))
    for key, value in table.items():
        if key in ("mosquitto", "mosquitto_file"):
            _check(name, key, value)
            continue
        values[key] = value
    for key, value in list(values.items()):
        values[key] = _check(name, key, value)
    address = values.get("address", "")
    if not address:
        raise _err(name, "address: required (host:port of the remote broker)")
    host, _, port_text = address.rpartition(":") if ":" in address else (address, "", "1883")
    port = _int(port_text, name, "address port")
    if not host or not 0 < port < 65536:
        raise _err(name, f"address: {address!r} is not host:port")
    password: bytes | None = None
    if values.get("password_file"):
        try:
            password = Path(values["password_file"]).read_text().splitlines()[0].encode()
        except (OSError, IndexError):
            raise _err(name, f"password_file: cannot read a line from "
                       f"{values['password_file']}") from None  # fmt: skip
    elif values.get("password"):
        password = values["password"].encode()
    if password is not None and not values.get("username"):
        raise _err(name, "password needs a username (MQTT sends no password without one)")
    for key in ("tls_ca", "tls_cert", "tls_key"):
        if values.get(key) and not Path(values[key]).is_file():
            raise _err(name, f"{key}: no such file: {values[key]}")
    if bool(values.get("tls_cert")) != bool(values.get("tls_key")):
        raise _err(name, "tls_cert and tls_key must be set together")
    rules: list[TopicRule] = []
    for n, line in enumerate(values.get("topics", []), 1):
        if not isinstance(line, str):
            raise _err(name, f"topics[{n}]: expected a string, got {line!r}")
        try:
            rules.append(parse_topic_line(line))
        except ValueError as exc:
            raise _err(name, f"topics[{n}]: {exc}") from None
    if not rules:
        raise _err(name, "topics: at least one topic rule, e.g. `sensors/# out 1`")
    lo = values.get("reconnect_min_ms", 500)
    hi = values.get("reconnect_max_ms", 30_000)
    if lo > hi:
        raise _err(name, f"reconnect_min_ms = {lo} is above reconnect_max_ms = {hi}")
    return BridgeSettings(
        name=name,
        host=host,
        port=port,
        protocol=PROTOCOLS[values.get("protocol", "3.1.1")],
        client_id=values.get("client_id", ""),
        username=values.get("username") or None,
        password=password,
        keepalive_s=values.get("keepalive", 60),
        clean_session=values.get("clean_session", False),
        tls_ca=values.get("tls_ca", ""),
        tls_cert=values.get("tls_cert", ""),
        tls_key=values.get("tls_key", ""),
        tls_server_name=values.get("tls_server_name", ""),
        tls_insecure=values.get("tls_insecure", False),
        local_username=values.get("local_username", ""),
        local_client_id=values.get("local_client_id", ""),
        backoff_min_s=lo / 1000,
        backoff_max_s=hi / 1000,
        max_inflight=values.get("max_inflight", 1000),
        rules=tuple(rules),
    )


def bridges_from_toml(value: Any, base: Path | None = None) -> list[BridgeSettings]:
    """The `bridge` array of tables; names must be unique."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise ConfigError(f"bridge: expected [[bridge]] tables, got {value!r}")
    out = [bridge_settings(t, i, base) for i, t in enumerate(value)]
    seen: set[str] = set()
    for b in out:
        if b.name in seen:
            raise _err(b.name, "name: two bridges have this name")
        seen.add(b.name)
    return out


def markdown_table() -> str:
    """docs/bridges.md's key table."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for name, k in BRIDGE_KEYS.items():
        default = "—" if k.default in ("", []) else f"`{str(k.default).lower()}`" \
            if isinstance(k.default, bool) else f"`{k.default}`"  # fmt: skip
        extra = ""
        if k.lo is not None:
            extra = f" ({k.lo}..{k.hi})"
        if k.choices:
            extra = " (" + ", ".join(f"`{c}`" for c in k.choices) + ")"
        lines.append(f"| `{name}` | {k.type.__name__} | {default} | {k.doc}{extra} |")
    return "\n".join(lines)
