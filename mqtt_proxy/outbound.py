"""Outbound helpers on top of the codec's encode-once `PublishTemplate`.

Stored messages carry `store.mapping.MqttProperties`; subscribers get codec `Properties` built
here, with the remaining message expiry (MQTT 5 §3.3.2.3.3) and the subscription identifiers
that differ per receiver. Acks are four fixed bytes, built inline rather than through an event
object because they are on the QoS 1/2 hot path.
"""

from __future__ import annotations

from typing import Any

from mqtt_proxy.codec import EMPTY_PROPERTIES, Properties


def delivery_properties(mp: Any, expiry: int | None, sub_ids: tuple[int, ...]) -> Properties:
    """Codec properties for a PUBLISH to a v5 subscriber."""
    if mp is None:
        if not sub_ids:
            return EMPTY_PROPERTIES
        return Properties(subscription_identifiers=sub_ids)
    return Properties(
        payload_format_indicator=mp.payload_format,
        message_expiry_interval=expiry,
        content_type=mp.content_type,
        response_topic=mp.response_topic,
        correlation_data=mp.correlation_data,
        subscription_identifiers=sub_ids,
        user_properties=tuple(mp.user_properties),
    )


def ack(ptype: int, pid: int, reason: int = 0, v5: bool = False) -> bytes:
    """PUBACK(4)/PUBREC(5)/PUBREL(6)/PUBCOMP(7); the v5 reason byte only when it is not 0."""
    first = (ptype << 4) | (0x02 if ptype == 6 else 0)
    if v5 and reason:
        return bytes((first, 3, pid >> 8, pid & 0xFF, reason))
    return bytes((first, 2, pid >> 8, pid & 0xFF))
