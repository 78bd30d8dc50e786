"""New-data events from the dispatcher to the MQTT proxies, routed by interest, coalesced.

A `QueueEvent(queue, last_seq)` says "queue has entries up to last_seq". Proxies always pull from
their own stored position, so events are hints: a lost or late one delays, never loses, a message
(and a periodic resync re-announces every registered queue). Two transports behind one interface:
`InProcessNotifier` (asyncio, the embedded default) and `TcpNotifyServer` / `TcpNotifyClient`.
Imports nothing else of Lightgate.
"""

from notify.inprocess import InProcessNotifier
from notify.router import Mailbox, Notifier, QueueEvent, RouteTable
from notify.tcp import TcpNotifyClient, TcpNotifyServer

__all__ = [
    "InProcessNotifier",
    "Mailbox",
    "Notifier",
    "QueueEvent",
    "RouteTable",
    "TcpNotifyClient",
    "TcpNotifyServer",
]
