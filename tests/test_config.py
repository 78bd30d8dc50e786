"""Config precedence (TOML < env < flags), validation, and docs/configuration.md in step with the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightgate.cli import _config_from, build_parser
from lightgate.config import ConfigError, config_keys, load_config

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_defaults_match_interfaces() -> None:
    cfg = load_config(env={})
    assert (cfg.data_dir, cfg.host) == ("./data", "127.0.0.1")
    assert (cfg.mqtt_port, cfg.mqtts_port, cfg.ws_port, cfg.kafka_port, cfg.http_port) == (
        1883,
        8883,
        8083,
        9092,
        8080,
    )
    assert cfg.fsync == "always"


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    path = tmp_path / "lg.toml"
    path.write_text(
        'mqtt_port = 1000\nkafka_port = 1001\nhttp_port = 1002\n[store]\nfsync = "never"\n'
    )
    env = {"LIGHTGATE_KAFKA_PORT": "2001", "LIGHTGATE_HTTP_PORT": "2002"}
    cfg = load_config(path, env=env, overrides={"http_port": 3002})
    assert (cfg.mqtt_port, cfg.kafka_port, cfg.http_port, cfg.fsync) == (1000, 2001, 3002, "never")


def test_cli_flags_and_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTGATE_MQTT_PORT", "5")
    ns = build_parser().parse_args(
        ["serve", "--mqtt-port", "0", "--ws-port", "-1", "--set", "fsync=interval_ms"]
    )
    cfg = _config_from(ns)
    assert (cfg.mqtt_port, cfg.ws_port, cfg.fsync) == (0, -1, "interval_ms")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"mqtt_port": 70000}, "not a port"),
        ({"fsync": "sometimes"}, "fsync"),
        ({"tls_cert": "x.pem"}, "together"),
        ({"mqtt_port": "abc"}, "expected int"),
    ],
)
def test_invalid_values_are_rejected(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=overrides)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = tmp_path / "lg.toml"
    path.write_text("mqtt_prot = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(path, env={})


def test_every_key_documented_with_its_default() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", DOCS.read_text(), re.M))
    keys = config_keys()
    assert set(rows) == set(keys)
    for key, default in keys.items():
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert rows[key].strip('"') == shown, key
