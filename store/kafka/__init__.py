"""Kafka wire-protocol listener on the shared store (docs/kafka.md).

`KafkaServer(store, host, port, config, security=...)` serves stock Kafka clients from the same log
MQTT writes to; `security` (a `store.auth.Security`) turns on SASL and per-topic ACLs. Layers:
`protocol` (sans-IO codec on kio), `sasl` (SASL state machines and the pre-auth gate, sans-IO),
`groups` (coordinator state machine), `offsets` and `producers` (state under DATA/kafka/),
`handlers_*` (the APIs), `broker` + `server` (asyncio).
"""

from .config import KafkaConfig
from .protocol import SUPPORTED_VERSIONS
from .server import KafkaServer

__all__ = ["SUPPORTED_VERSIONS", "KafkaConfig", "KafkaServer"]
