"""`[[bridge]]` tables: parsing, Mosquitto `topic` lines and sections, errors that name the
bridge and the key, and docs/bridges.md's key table equal to the code's."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightgate.bridge_config import BRIDGE_KEYS, markdown_table
from lightgate.config import ConfigError
from lightgate.config_docs import BRIDGES_DOCS, bridges_docs_text
from lightgate.config_load import load_config
from mqtt_proxy.bridge import TopicRule, parse_topic_line


def _load(tmp_path: Path, text: str) -> list:  # type: ignore[type-arg]
    path = tmp_path / "lightgate.toml"
    path.write_text(text)
    return load_config(path, env={}).extra.get("bridges", [])


@pytest.mark.parametrize(
    ("line", "rule"),
    [
        ("sensors/#", TopicRule("sensors/#", "out", 0, "", "")),
        ("sensors/# out 1", TopicRule("sensors/#", "out", 1, "", "")),
        ("# both 1 local/ remote/", TopicRule("#", "both", 1, "local/", "remote/")),
        ('cmd/+ in 2 "" site1/', TopicRule("cmd/+", "in", 2, "", "site1/")),
        ("topic a/b out 0 x/ y/", TopicRule("a/b", "out", 0, "x/", "y/")),
        ('"" out 1 edge/temp central/temp', TopicRule("", "out", 1, "edge/temp", "central/temp")),
    ],
)
def test_mosquitto_topic_lines(line: str, rule: TopicRule) -> None:
    assert parse_topic_line(line) == rule


def test_prefix_mapping_both_ways() -> None:
    r = parse_topic_line("temp/# both 1 edge/ central/site1/")
    assert r.local_filter == "edge/temp/#" and r.remote_filter == "central/site1/temp/#"
    assert r.to_remote("edge/temp/a") == "central/site1/temp/a"
    assert r.to_local("central/site1/temp/a") == "edge/temp/a"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("a/# sideways", "direction 'sideways'"),
        ("a/# out 3", "QoS '3'"),
        ("a/#/b out 1", "filter"),
        ("a out 1 lo+/ x/", r"may not hold \+ or #"),
        ("a out 1 x y z", "expected <pattern>"),
    ],
)
def test_bad_topic_lines(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_topic_line(line)


def test_table_is_read(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    (b,) = _load(
        tmp_path,
        f"""
[[bridge]]
name = "centre"
address = "broker.example:8883"
protocol = "5.0"
username = "edge1"
password_file = "{pw}"
keepalive = 30
clean_session = true
topics = ["sensors/# out 1", "cmd/# in 1"]
""",
    )
    assert (b.name, b.host, b.port, b.protocol) == ("centre", "broker.example", 8883, 5)
    assert (b.username, b.password, b.keepalive_s, b.clean_session) == (
        "edge1",
        b"s3cret",
        30,
        True,
    )
    assert [r.direction for r in b.rules] == ["out", "in"]
    assert b.identity == "bridge-centre"


def test_mosquitto_section_moves_over(tmp_path: Path) -> None:
    (b,) = _load(
        tmp_path,
        '''
[[bridge]]
name = "central"
mosquitto = """
# as it stood in mosquitto.conf
connection central
address 10.0.0.5:1884
remote_clientid edge-17
remote_username edge
remote_password pw
keepalive_interval 20
cleansession false
try_private true
bridge_protocol_version mqttv50
topic sensors/# out 1 "" site17/
topic cmd/# in 1
"""
''',
    )
    assert (b.host, b.port, b.client_id, b.username, b.password) == (
        "10.0.0.5", 1884, "edge-17", "edge", b"pw")  # fmt: skip
    assert (b.keepalive_s, b.clean_session, b.protocol) == (20, False, 5)
    assert b.rules == (TopicRule("sensors/#", "out", 1, "", "site17/"),
                       TopicRule("cmd/#", "in", 1, "", ""))  # fmt: skip


def test_mosquitto_file_picks_its_connection(tmp_path: Path) -> None:
    conf = tmp_path / "mosquitto.conf"
    conf.write_text("listener 1883\nallow_anonymous true\n\nconnection a\naddress h1\n"
                    "topic x out\n\nconnection b\naddress h2:1999\ntopic y in 1\n")  # fmt: skip
    (b,) = _load(tmp_path, '[[bridge]]\nname = "b"\nmosquitto_file = "mosquitto.conf"\n')
    assert (b.host, b.port, b.rules) == ("h2", 1999, (TopicRule("y", "in", 1),))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ('name = "c"\ntopics = ["a out"]', "bridge 'c': address: required"),
        ('name = "c"\naddress = "h:1"', "bridge 'c': topics: at least one"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a out 7"]', r"bridge 'c': topics\[1\]"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a"]\nkeepalive = -1',
         "bridge 'c': keepalive = -1 is out of range"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a"]\nkeepalve = 5',
         "bridge 'c': unknown key 'keepalve' \\(did you mean 'keepalive'\\?\\)"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a"]\nprotocol = "3.1"',
         "bridge 'c': protocol: '3.1'"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a"]\ntls_ca = "/nonexistent/ca.crt"',
         "bridge 'c': tls_ca: no such file"),
        ('address = "h:1"\ntopics = ["a"]', "bridge #1: name: required"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a"]\npassword = "pw"',
         "bridge 'c': password needs a username"),
        ('name = "c"\naddress = "h:1"\ntopics = ["a"]\nmosquitto = "connection c\\nbogus 1"',
         "bridge 'c': mosquitto line 2: bogus"),
    ],
)  # fmt: skip
def test_errors_name_bridge_and_key(tmp_path: Path, table: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, f"[[bridge]]\n{table}\n")


def test_duplicate_names(tmp_path: Path) -> None:
    one = '[[bridge]]\nname = "c"\naddress = "h:1"\ntopics = ["a"]\n'
    with pytest.raises(ConfigError, match="bridge 'c': name: two bridges"):
        _load(tmp_path, one + one)


def test_docs_table_is_the_key_table() -> None:
    """docs/bridges.md lists every bridge key as the code has it: run
    `python -m lightgate.config_docs` after changing BRIDGE_KEYS."""
    text = BRIDGES_DOCS.read_text()
    assert bridges_docs_text(text) == text
    assert markdown_table() in text
    for name in BRIDGE_KEYS:
        assert f"| `{name}` |" in text
