"""New-data events from the dispatcher to the MQTT proxies, routed by interest, coalesced.

A `QueueEvent(queue, last_seq)` says "queue has entries up to last_seq". Proxies always pull from
their own stored position, so events are hints: a lost or late one delays, never loses, a message
(and a periodic resync re-announces every registered queue). `InProcessNotifier` serves the
proxy in the same process; proxies in other processes reach the same route table over the core
link (`notify.link`, the transport, bodies in `notify.wire`). Imports nothing else of Lightgate.
"""

from notify.inprocess import InProcessNotifier
from notify.router import Mailbox, Notifier, QueueEvent, RouteTable

__all__ = [
    "InProcessNotifier",
    "Mailbox",
    "Notifier",
    "QueueEvent",
    "RouteTable",
]
