"""Config precedence (TOML < env < flags), validation, and docs/configuration.md in step with the code."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from gateway_process import GatewayProcess
from mqtt_helpers import V5, Client

from lightgate.cli import _config_from, build_parser
from lightgate.config import ConfigError
from lightgate.config_docs import EXAMPLE, docs_text, example_toml
from lightgate.config_load import KEYS, config_keys, load_config

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
        ({"mqtt_port": 70000}, r"mqtt_port = 70000 is out of range: allowed -1\.\.65535"),
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


def test_removed_key_says_what_replaced_it(tmp_path: Path) -> None:
    path = tmp_path / "lg.toml"
    path.write_text('notify_transport = "tcp"\n')
    with pytest.raises(ConfigError, match="notify_transport.*was removed.*core link"):
        load_config(path, env={})


def test_docs_table_is_the_key_table() -> None:
    """docs/configuration.md's table is written from the key table: regenerate it with
    `python -m lightgate.config_docs` after adding or changing a key."""
    text = DOCS.read_text()
    assert text == docs_text(text)
    rows = dict(re.findall(r"^\| `(\w+)` \| \w+ \| `([^`]*)` \|", text, re.M))
    assert set(rows) == set(config_keys())
    for name, default in config_keys().items():
        shown = str(default).lower() if isinstance(default, bool) else str(default)
        assert rows[name].strip('"') == shown, name


def test_every_key_has_a_description_and_a_range() -> None:
    for name, k in KEYS.items():
        assert k.spec.doc, name
        if k.type is int:
            assert k.spec.lo is not None, f"{name}: an int key needs lo (and hi where one exists)"
        elif k.type is str:
            assert k.spec.choices or k.spec.allowed, f"{name}: choices or allowed= wording"
        k.check(k.default)  # the default is allowed


def test_example_config_is_the_key_table() -> None:
    """lightgate.example.toml has every key at its default, written from the key table."""
    assert EXAMPLE.read_text() == example_toml()
    with EXAMPLE.open("rb") as fh:
        assert tomllib.load(fh) == config_keys()
    assert load_config(EXAMPLE, env={}) == load_config(env={})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"receive_maximum": 0}, r"receive_maximum = 0 is out of range: allowed 1\.\.65535"),
        ({"receive_maximum": "-5"}, r"receive_maximum = -5 is out of range: allowed 1\.\.65535"),
        ({"receive_maximum": 65536}, r"receive_maximum = 65536 .* 1\.\.65535"),
        ({"max_packet_size": 5}, r"max_packet_size = 5 .* allowed 0 or 20\.\.268435460"),
        ({"log_level": "verbose"}, r"log_level: 'verbose' is not one of debug, info, warning"),
        ({"segment_bytes": 10}, r"segment_bytes = 10 .* allowed 65536\.\.2147483647"),
        ({"gc_gen0": -1}, r"gc_gen0 = -1 .* allowed 0\.\."),
        ({"fsync_interval_ms": 0}, r"fsync_interval_ms = 0 .* allowed 1\.\."),
        ({"default_partitions": 0}, r"default_partitions = 0 .* allowed 1\.\.1024"),
        ({"mqtt_processes": 257}, r"mqtt_processes = 257 .* allowed `auto` or 0\.\.256"),
        ({"mqtt_processes": "many"}, r"mqtt_processes: expected int, got 'many'"),
        ({"max_keepalive": 0}, r"max_keepalive = 0 .* allowed 1\.\.65535"),
        ({"retention_bytes": -2}, r"retention_bytes = -2 .* allowed >= -1"),
    ],
)
def test_out_of_range_names_key_and_range(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides=overrides)


def test_edge_values_are_accepted() -> None:
    cfg = load_config(
        env={"LIGHTGATE_LOG_LEVEL": "DEBUG"},
        overrides={"max_packet_size": "0", "receive_maximum": 65535, "segment_bytes": 65536},
    )
    assert (cfg.max_packet_size, cfg.receive_maximum, cfg.log_level) == (0, 65535, "debug")


@pytest.mark.parametrize("shape", [[], ["--set", "mqtt_processes=1"]], ids=["serve", "split"])
def test_max_packet_size_0_means_no_limit(
    gateway_factory: Callable[..., GatewayProcess], tmp_path: Path, shape: list[str]
) -> None:
    """As in Mosquitto, `max_packet_size = 0` lifts the gateway's own limit: a v5 CONNACK carries
    no Maximum Packet Size, and a PUBLISH larger than the 1 MiB default passes end to end."""
    gw = gateway_factory(tmp_path / "data", "--set", "max_packet_size=0", *shape)
    port = gw.port("mqtt")
    sub = Client(port, "big-sub").connect()
    sub.subscribe("big/#", 1)
    pub = Client(port, "big-pub", V5).connect()
    assert not hasattr(pub.connack_props, "MaximumPacketSize")
    payload = bytes(range(256)) * (12 * 1024)  # 3 MiB
    pub.publish("big/one", payload, qos=1, timeout=60)
    (m,) = sub.expect(1, timeout=60)
    assert m.payload == payload
    pub.disconnect()
    sub.disconnect()


def test_mqtt_processes_auto() -> None:
    """`mqtt_processes = "auto"`: one proxy per core, minus one for the core above 2 cores."""
    from lightgate.config_load import proxy_count

    cfg = load_config(env={}, overrides={"mqtt_processes": "AUTO"})
    assert cfg.mqtt_processes == "auto"
    cores = len(os.sched_getaffinity(0))
    assert proxy_count(cfg) == (cores - 1 if cores > 2 else cores)
    assert proxy_count(load_config(env={"LIGHTGATE_MQTT_PROCESSES": "3"})) == 3
