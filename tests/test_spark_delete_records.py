"""Spark readers after Kafka's DeleteRecords: the data source starts at the new log start (the
`log-start-offset` floor), batch and `earliest`, even inside a segment that stays on disk."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from store import Store, StoreConfig
from store.record_batch import build_batch

pytestmark = [pytest.mark.spark, pytest.mark.slow]


async def _fill_and_delete(data_dir: Path) -> None:
    store = await Store.open(data_dir, StoreConfig(default_partitions=1))
    store.create_topic("dr", 1)
    for i in range(0, 100, 10):
        recs = [(1000 + j, b"k", b"v%d" % j, []) for j in range(i, i + 10)]
        await store.append_batch("dr", 0, bytes(build_batch(recs))).durable
    assert await store.delete_records("dr", 0, 42) == 42
    await store.close()


def test_spark_reads_from_the_moved_log_start(spark, tmp_path: Path) -> None:
    asyncio.run(_fill_and_delete(tmp_path))
    df = spark.read.format("lightgate").option("topics", "dr").load(str(tmp_path))
    offsets = sorted(r.offset for r in df.select("offset").collect())
    assert offsets == list(range(42, 100))  # one segment: the floor hides 0..41 inside it
    early = (
        spark.read.format("lightgate")
        .option("topics", "dr")
        .option("startingOffsets", "earliest")
        .load(str(tmp_path))
    )
    assert early.count() == 58
