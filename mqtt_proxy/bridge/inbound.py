"""In: messages the remote sends on the bridge's `in` subscriptions go into the local log.

They are appended under the bridge's own identity (client id and ACL user), so the ACL decides
what a bridge may write and the out half knows them (it never forwards its own messages back).
A QoS 1 message is PUBACKed to the remote only once its append is durable. A v5 message that
carries this bridge's own loop marker (it went out through this bridge and came back) is
acknowledged and dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lightqueue import LightQueues, topic_matches
from mqtt_proxy.bridge.outbound import MARKER
from mqtt_proxy.bridge.settings import BridgeSettings, TopicRule
from mqtt_proxy.codec import Publish, TopicSubscription
from mqtt_proxy.ports import LogPort
from store.mapping import MqttMessage, MqttProperties

log = logging.getLogger("lightgate.bridge")

# can_write(topic): whether the bridge's identity may publish to a local topic.
CanWrite = Callable[[str], bool]


def subscriptions(settings: BridgeSettings) -> list[TopicSubscription]:
    """The remote subscriptions of the `in` rules; v5: no-local, so our own messages stay there."""
    v5 = settings.protocol == 5
    return [
        TopicSubscription(r.remote_filter, min(r.qos, 1), no_local=v5, retain_as_published=v5)
        for r in settings.in_rules
    ]


def _properties(p: Publish) -> MqttProperties | None:
    pr = p.properties
    if pr is None or pr == pr.__class__():
        return None
    users = tuple(pr.user_properties or ())
    if not (users or pr.content_type or pr.response_topic or pr.correlation_data
            or pr.payload_format_indicator is not None or pr.message_expiry_interval is not None):  # fmt: skip
        return None
    return MqttProperties(
        pr.payload_format_indicator,
        pr.message_expiry_interval,
        pr.content_type,
        pr.response_topic,
        pr.correlation_data,
        users,
    )


class Receiver:
    """The in half of one bridge: remote PUBLISH → local append → PUBACK when durable."""

    def __init__(
        self,
        settings: BridgeSettings,
        log_port: LogPort,
        queues: LightQueues,
        can_write: CanWrite,
    ) -> None:
        self.settings = settings
        self.log = log_port
        self.queues = queues
        self.can_write = can_write
        self.received = 0
        self.denied = 0
        self.failed = 0
        self._rules: tuple[TopicRule, ...] = settings.in_rules

    def local_topic(self, remote_topic: str) -> str | None:
        for r in self._rules:
            if topic_matches(r.remote_filter, remote_topic):
                return r.to_local(remote_topic)
        return None

    def handle(self, p: Publish, puback: Callable[[int], None]) -> None:
        s = self.settings
        topic = self.local_topic(p.topic)
        props = _properties(p)
        own = props is not None and (MARKER, s.name) in props.user_properties
        if topic is None or own or not self.can_write(topic):
            if topic is not None and not own:
                self.denied += 1
                if self.denied == 1:  # once: a misconfigured ACL must not flood the log
                    log.warning("bridge %s: the ACL denies writing %s; dropped", s.name, topic,
                                extra={"bridge": s.name})  # fmt: skip
            if p.qos:
                puback(p.packet_id)
            return
        qos = min(p.qos, 1)
        msg = MqttMessage(topic, p.payload, qos, s.identity, p.retain, props)
        try:
            res = self.log.append_mqtt([msg])
        except Exception as exc:  # e.g. a topic the log cannot take: one line, then drop
            self.failed += 1
            if self.failed == 1:
                log.error("bridge %s: cannot append %s: %s; dropped", s.name, topic, exc,
                          extra={"bridge": s.name})  # fmt: skip
            if p.qos:
                puback(p.packet_id)
            return
        self.received += 1
        if p.retain and not self.queues.remote_reads:

            def retain() -> None:
                offsets = res.offsets
                if offsets:
                    self._retain(msg, offsets[0])

            res.when_staged(retain)
        if p.qos:
            pid = p.packet_id

            def durable(fut: asyncio.Future[None]) -> None:
                if not fut.cancelled() and fut.exception() is None:
                    puback(pid)  # else no PUBACK: the remote sends it again

            res.durable.add_done_callback(durable)

    def _retain(self, msg: MqttMessage, offset: tuple[str, int, int]) -> None:
        self.queues.retained.set(msg.topic, msg.payload, msg.qos, msg.client_id, msg.properties,
                                 msg.timestamp_ms, offset)  # fmt: skip
