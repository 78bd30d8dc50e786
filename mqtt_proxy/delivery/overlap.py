"""Overlapping subscriptions of one session: which of them delivers a message, and how.

MQTT 3.1.1 §3.3.5 and MQTT 5 §3.3.4 allow one copy per message for a client whose filters
overlap; Lightgate sends one, from the matching subscription with the highest QoS, at that QoS,
carrying every matching subscription identifier.
"""

from __future__ import annotations

from mqtt_proxy.delivery.queue_cache import CachedMsg
from mqtt_proxy.sessions.state import Session, Subscription
from mqtt_proxy.sessions.topic_filters import topic_matches


def overlap_owner(
    session: Session, sub: Subscription, m: CachedMsg
) -> tuple[int, tuple[int, ...]] | None:
    """Overlapping subscriptions: one copy per message, delivered by the matching subscription
    with the highest QoS (ties: the smallest filter), at the maximum QoS, carrying every matching
    subscription identifier (MQTT 3.1.1 §3.3.5, MQTT 5 §3.3.4). None: another sub delivers it."""
    best: Subscription | None = None
    ids: list[int] = []
    topic = m.topic
    own = m.client_id == session.client_id
    for s in session.subs.values():
        if s.local or s.spec.share_group is not None or (s.no_local and own):
            continue
        if s is not sub and not topic_matches(s.spec.filter, topic):
            continue
        if s.sub_id:
            ids.append(s.sub_id)
        if best is None or s.qos > best.qos or (s.qos == best.qos and s.spec.raw < best.spec.raw):
            best = s
    if best is not sub:
        return None
    return best.qos, tuple(sorted(ids))
