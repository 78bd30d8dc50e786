"""Outbound helpers on top of the codec's encode-once `PublishTemplate`.

Stored messages carry `store.mapping.MqttProperties`; subscribers get codec `Properties` built
here, with the remaining message expiry (MQTT 5 §3.3.2.3.3) and the subscription identifiers
that differ per receiver. 3.1.1 acks are four fixed bytes, built without an event object because
they are on the QoS 1/2 hot path.
"""

from __future__ import annotations

from struct import pack

from mqtt_proxy.codec import EMPTY_PROPERTIES, Properties
from store.mapping import MqttProperties
from store.twins import twin


def delivery_properties(
    mp: MqttProperties | None, expiry: int | None, sub_ids: tuple[int, ...]
) -> Properties:
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


def acks_py(ptype: int, pids: list[int]) -> bytes:
    """Success PUBACKs (4) or PUBRECs (5) for 3.1.1, four fixed bytes each, joined: one pack for
    a connection's acks of one fsync (96 ns per ack against 270 for building each and a join,
    timed alone). `pids` are 1..65535 (the parser's). The pure twin of
    `mqtt_proxy.delivery._coutbound.acks`."""
    head = (ptype << 28) | 0x20000
    return pack(f">{len(pids)}I", *[head | pid for pid in pids])


acks = twin(
    acks_py,
    "mqtt_proxy.delivery._coutbound",
    "acks",
    what="a connection's PUBACKs/PUBRECs of one fsync in one buffer",
)
