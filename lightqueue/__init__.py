"""Light queues: per-topic and per-filter index queues over the commitlog, in LevelDB.

Derived data: every queue entry points at a record in the commitlog (the source of truth) and
`rebuild_queues` can recreate them all from it. Sessions and retained messages share the DB under
their own prefixes and are state, not derived. See docs/light-queues.md.
"""

from lightqueue.model import Position, ReadResult, StoredMessage
from lightqueue.queues import Acquired, LightQueueConfig, LightQueues, replay_queue_name
from lightqueue.rebuild import RebuildProgress, RebuildStats, rebuild_queues
from lightqueue.retained import RetainedStore
from lightqueue.session_store import SessionStore
from lightqueue.topic_trie import (
    FilterError,
    FilterTrie,
    is_wildcard,
    topic_matches,
    validate_filter,
)

__all__ = [
    "Acquired",
    "FilterError",
    "FilterTrie",
    "LightQueueConfig",
    "LightQueues",
    "Position",
    "ReadResult",
    "RebuildProgress",
    "RebuildStats",
    "RetainedStore",
    "SessionStore",
    "StoredMessage",
    "is_wildcard",
    "rebuild_queues",
    "replay_queue_name",
    "topic_matches",
    "validate_filter",
]
