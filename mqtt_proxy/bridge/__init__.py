"""MQTT bridges: forward local topics to another broker from the log, and bring topics back.

`settings` (the `[[bridge]]` tables, Mosquitto's `topic` lines), `client` (our codec in the
client role over asyncio), `outbound` (the log to the remote, a committed position per light
queue), `inbound` (the remote to the log, PUBACK once durable), `bridge` (reconnects, figures).
docs/bridges.md.
"""

from mqtt_proxy.bridge.bridge import Bridge, BridgeFigures, Bridges, Wakeups
from mqtt_proxy.bridge.settings import (
    BridgeSettingError,
    BridgeSettings,
    TopicRule,
    make_rule,
    parse_topic_line,
)

__all__ = [
    "Bridge",
    "BridgeFigures",
    "BridgeSettingError",
    "BridgeSettings",
    "Bridges",
    "TopicRule",
    "Wakeups",
    "make_rule",
    "parse_topic_line",
]
