"""What one bridge is configured to do: the remote, the session, and the topic rules.

Topic rules follow Mosquitto's bridge syntax, `topic <pattern> [out|in|both] [qos] [local-prefix]
[remote-prefix]`, so a Mosquitto bridge section moves over unchanged: a local topic is
`local_prefix + X` and the remote one `remote_prefix + X`, for every `X` matching `pattern`.
`""` stands for an empty prefix (as in Mosquitto, to give a remote prefix alone).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from mqtt_proxy.codec import topic_filter_error

DIRECTIONS = ("out", "in", "both")


class BridgeSettingError(ValueError):
    """A bridge setting cannot be used; `key` names it (the loader adds the bridge's name)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class TopicRule:
    """One `topic` line: which topics go which way, at which QoS, under which prefixes."""

    pattern: str
    direction: str = "out"
    qos: int = 0
    local_prefix: str = ""
    remote_prefix: str = ""

    @property
    def local_filter(self) -> str:
        return self.local_prefix + self.pattern

    @property
    def remote_filter(self) -> str:
        return self.remote_prefix + self.pattern

    @property
    def sends(self) -> bool:
        return self.direction in ("out", "both")

    @property
    def receives(self) -> bool:
        return self.direction in ("in", "both")

    def to_remote(self, local_topic: str) -> str:
        """The remote topic of a local one this rule matched (it starts with local_prefix)."""
        return self.remote_prefix + local_topic[len(self.local_prefix) :]

    def to_local(self, remote_topic: str) -> str | None:
        """The local topic of a remote one, None when it is not under remote_prefix."""
        if not remote_topic.startswith(self.remote_prefix):
            return None
        return self.local_prefix + remote_topic[len(self.remote_prefix) :]


def _prefix(text: str) -> str:
    return "" if text == '""' else text


def parse_topic_line(text: str) -> TopicRule:
    """`<pattern> [out|in|both] [qos] [local-prefix] [remote-prefix]` (the words after Mosquitto's
    `topic`; a leading `topic` is accepted too). Raises ValueError saying what is wrong."""
    words = shlex.split(text, posix=False)
    if words and words[0] == "topic":
        words = words[1:]
    if not words or len(words) > 5:
        raise ValueError(
            f"{text!r}: expected <pattern> [out|in|both] [qos] [local-prefix] [remote-prefix]"
        )
    pattern = _prefix(words[0])
    direction = words[1] if len(words) > 1 else "out"
    if direction not in DIRECTIONS:
        raise ValueError(f"{text!r}: direction {direction!r} is not out, in or both")
    qos_text = words[2] if len(words) > 2 else "0"
    if qos_text not in ("0", "1", "2"):
        raise ValueError(f"{text!r}: QoS {qos_text!r} is not 0, 1 or 2")
    local = _prefix(words[3]) if len(words) > 3 else ""
    remote = _prefix(words[4]) if len(words) > 4 else ""
    return make_rule(pattern, direction, int(qos_text), local, remote, text)


def make_rule(
    pattern: str, direction: str, qos: int, local: str, remote: str, what: str = ""
) -> TopicRule:
    """A checked TopicRule (as Mosquitto: an empty pattern with a prefix bridges that topic)."""
    what = what or pattern
    if direction not in DIRECTIONS:
        raise ValueError(f"{what!r}: direction {direction!r} is not out, in or both")
    if qos not in (0, 1, 2):
        raise ValueError(f"{what!r}: QoS {qos!r} is not 0, 1 or 2")
    for name, prefix in (("local prefix", local), ("remote prefix", remote)):
        if any(c in prefix for c in "+#"):
            raise ValueError(f"{what!r}: the {name} {prefix!r} may not hold + or #")
    rule = TopicRule(pattern, direction, qos, local, remote)
    for side, filt in (("local", rule.local_filter), ("remote", rule.remote_filter)):
        err = topic_filter_error(filt) if filt else "empty topic"
        if err:
            raise ValueError(f"{what!r}: {side} filter {filt!r}: {err}")
    return rule


@dataclass(frozen=True, slots=True)
class BridgeSettings:
    """One `[[bridge]]` table, checked and with the password read."""

    name: str
    host: str
    port: int = 1883
    protocol: int = 4  # MQTT protocol level: 4 = 3.1.1, 5 = 5.0
    client_id: str = ""
    username: str | None = None
    password: bytes | None = None
    keepalive_s: int = 60
    clean_session: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    tls_insecure: bool = False
    local_username: str = ""  # the identity the bridge's inbound messages carry for ACLs
    local_client_id: str = ""
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    batch: int = 1000  # entries read from a light queue at a time
    max_inflight: int = 1000  # QoS 1 messages sent and not acknowledged (also: the remote's limit)
    rules: tuple[TopicRule, ...] = field(default_factory=tuple)

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert or self.tls_insecure)

    @property
    def out_rules(self) -> tuple[TopicRule, ...]:
        return tuple(r for r in self.rules if r.sends)

    @property
    def in_rules(self) -> tuple[TopicRule, ...]:
        return tuple(r for r in self.rules if r.receives)

    @property
    def identity(self) -> str:
        """Client id of what the bridge appends locally; messages carrying it never go out."""
        return self.local_client_id or f"bridge-{self.name}"
