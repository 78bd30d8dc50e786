"""A received PUBLISH (or will) as the `MqttMessage` the store appends: its v5 properties as
`mqtt.*` headers (docs/topic-mapping.md) and its receive time."""

from __future__ import annotations

from time import time as _time

from mqtt_proxy.codec import EMPTY_PROPERTIES, Properties
from store.mapping import MqttMessage, MqttProperties


def message_properties(p: Properties) -> MqttProperties | None:
    """The v5 properties a stored message carries, or None."""
    if p is EMPTY_PROPERTIES:
        return None
    if (
        p.payload_format_indicator is None
        and p.message_expiry_interval is None
        and p.content_type is None
        and p.response_topic is None
        and p.correlation_data is None
        and not p.user_properties
    ):
        return None
    return MqttProperties(
        p.payload_format_indicator,
        p.message_expiry_interval,
        p.content_type,
        p.response_topic,
        p.correlation_data,
        p.user_properties,
    )


def make_message(
    topic: str, payload: bytes, qos: int, retain: bool, props: Properties, client_id: str
) -> MqttMessage:
    mp = None if props is EMPTY_PROPERTIES else message_properties(props)
    # The receive time is set here (not left 0 for the store to fill) so the message kept
    # for delivery (Backend.remember) carries the same timestamp as the stored record.
    return MqttMessage(topic, payload, qos, client_id, retain, mp, int(_time() * 1000))


def broker_message(
    topic: str, payload: bytes, qos: int, retain: bool, props: MqttProperties | None
) -> MqttMessage:
    """A message the broker itself publishes (a will): no client id, received now."""
    return MqttMessage(topic, payload, qos, "", retain, props, int(_time() * 1000))
