"""Helpers for the light-queue tests: a real Store + LightQueues on a temp data dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightqueue.keys import (
    ENTRY_SIZE,
    P_CHECKPOINT,
    P_ENTRY,
    P_META,
    decode_block_py,
    entry_key_seq,
)
from lightqueue.queues import LightQueueConfig, LightQueues
from store import MqttMessage, Store, StoreConfig


async def open_all(
    data_dir: Path, partitions: int = 1, sink: Any = None, **cfg: Any
) -> tuple[Store, LightQueues]:
    store = await Store.open(data_dir, StoreConfig(default_partitions=partitions, fsync="never"))
    lq = LightQueues.open(data_dir, store, LightQueueConfig(**cfg), sink)
    return store, lq


def msg(topic: str, payload: bytes | None = None, qos: int = 1, cid: str = "c") -> MqttMessage:
    return MqttMessage(topic, payload if payload is not None else topic.encode(), qos, cid)


async def flushed(store: Store) -> None:
    """Let the store's end-of-tick write (and the append listeners) run."""
    import asyncio

    for _ in range(3):
        await asyncio.sleep(0)


def queue_dump(lq: LightQueues) -> dict[str, tuple[int, int, int, list[Any]]]:
    """name → (kind, start, next, entries from start): everything a subscriber can observe."""
    out = {}
    for name in sorted(lq.queue_names()):
        kind, start, nxt = lq.info(name)  # type: ignore[misc]
        res = lq.read(name, start, nxt - start + 1)
        out[name] = (kind, res.start_seq, res.next_seq, list(res.entries))
    return out


def raw_dump(db: Any) -> dict[bytes, bytes]:
    """Every derived record (entries, metadata, checkpoints) byte for byte; a block of entries
    as one key per entry, so how rounds cut entries into blocks does not count."""
    out = {}
    for k, v in db.iterator():
        if k[:1] == P_ENTRY:
            seq = entry_key_seq(k)
            raw = decode_block_py(v)
            for i in range(0, len(raw), ENTRY_SIZE):
                out[k[:5] + (seq + i // ENTRY_SIZE).to_bytes(8, "big")] = raw[i : i + ENTRY_SIZE]
        elif k[:1] in (P_META, P_CHECKPOINT):
            out[k] = v
    return out
