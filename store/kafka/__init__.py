"""Kafka wire-protocol listener on the shared store (issue 5).

`KafkaServer(store, host, port, config)` serves stock Kafka clients from the same log MQTT writes
to. Layers: `protocol` (sans-IO codec on kio), `groups` (coordinator state machine), `offsets` and
`producers` (state under DATA/kafka/), `handlers_*` (the APIs), `broker` + `server` (asyncio).
"""

from .config import KafkaConfig
from .protocol import SUPPORTED_VERSIONS
from .server import KafkaServer

__all__ = ["SUPPORTED_VERSIONS", "KafkaConfig", "KafkaServer"]
