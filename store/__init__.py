"""The commitlog: log topics of Kafka RecordBatch v2 segments shared by MQTT, Kafka and Spark.

Public API (docs/architecture.md): `Store`, `StoreConfig`, `AppendResult`, `MqttMessage`,
`MqttProperties`, and the errors. Lock-free readers for other processes: `store.segment_reader`.
"""

from store.append_result import AppendResult
from store.config import (
    StoreConfig,
    StoreError,
    StoreLockedError,
    UnknownTopicOrPartitionError,
)
from store.log import OffsetOutOfRangeError
from store.mapping import MqttMessage, MqttProperties, TopicMappingError
from store.record_batch import InvalidRecordError
from store.store import Store

__all__ = [
    "AppendResult",
    "InvalidRecordError",
    "MqttMessage",
    "MqttProperties",
    "OffsetOutOfRangeError",
    "Store",
    "StoreConfig",
    "StoreError",
    "StoreLockedError",
    "TopicMappingError",
    "UnknownTopicOrPartitionError",
]
