"""Kafka transactions seen from MQTT and Spark: only committed records of transactional producers
reach a device (live subscription and `$replay`) or a Spark read; records of an open transaction
(and everything after it, the last stable offset) wait for its commit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import confluent_kafka as ck
import pytest
from gateway_process import GatewayProcess
from kafka_helpers import running_gateway
from mqtt_helpers import V5, Client

pytestmark = pytest.mark.timeout(150)


def _txn_producer(bootstrap: str) -> ck.Producer:
    p = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": "t-dev"})
    p.init_transactions(10)
    return p


def _send(p: ck.Producer, value: str) -> None:
    p.produce("cmds", value.encode(), key=b"cmds/dev1", partition=0)


def _commit_abort_open(bootstrap: str) -> tuple[ck.Producer, ck.Producer]:
    """ok1 committed, bad1 aborted, held open (and `plain` behind it): the producers to go on."""
    p = _txn_producer(bootstrap)
    p.begin_transaction()
    _send(p, "ok1")
    p.commit_transaction(10)
    p.begin_transaction()
    _send(p, "bad1")
    p.flush()
    p.abort_transaction(10)
    p.begin_transaction()
    _send(p, "held")
    p.flush()
    plain = ck.Producer({"bootstrap.servers": bootstrap})
    _send(plain, "plain")
    plain.flush()
    return p, plain


def test_mqtt_subscribers_get_committed_records_only(
    gateway_factory: Callable[..., GatewayProcess],
) -> None:
    gw = gateway_factory()
    bootstrap = f"127.0.0.1:{gw.port('kafka')}"
    sub = Client(gw.port("mqtt"), "dev1", V5).connect()
    try:
        sub.subscribe("cmds/#", qos=1)
        since = int(time.time() * 1000) - 60_000
        p, _plain = _commit_abort_open(bootstrap)
        got = [m.payload for m in sub.expect(1, timeout=20)]
        assert got == [b"ok1"]
        sub.expect_none(1.5)  # bad1 aborted; held open, and plain behind it (the LSO)
        p.commit_transaction(10)
        got = [m.payload for m in sub.expect(2, timeout=20)]
        assert got == [b"held", b"plain"]
        sub.expect_none(0.5)
        # history through a replay queue (the backfill path) follows the same rule
        replay = Client(gw.port("mqtt"), "dev2", V5).connect()
        try:
            replay.subscribe(f"$replay/{since}/cmds/#", qos=1)
            got = [m.payload for m in replay.expect(3, timeout=20)]
            assert got == [b"ok1", b"held", b"plain"]
            replay.expect_none(0.5)
        finally:
            replay.disconnect()
    finally:
        sub.disconnect()


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(400)  # one Spark read; slow only on a loaded machine
def test_spark_reads_committed_records_only(spark, tmp_path: Path) -> None:
    data = tmp_path / "data"

    async def fill() -> None:
        async with running_gateway(data) as gw:
            p, plain = await asyncio.to_thread(_commit_abort_open, gw.bootstrap)
            assert gw.store.last_stable_offset("cmds", 0) == 4  # held is open
            await asyncio.to_thread(p.purge)
        # stopped with `held` open: it stays open in the log until the next start

    asyncio.run(fill())
    df = spark.read.format("lightgate").option("topics", "cmds").load(str(data))
    values = [r.value.decode() for r in df.orderBy("offset").collect()]
    assert values == ["ok1"]  # bad1 aborted; held open, and plain behind it (the LSO)


async def test_spark_reader_plans_up_to_the_lso_and_skips_aborted(tmp_path: Path) -> None:
    """The data source's planning and task code without a SparkSession (fast): batch and
    streaming readers stop at the LSO, tasks drop aborted records, and a later commit moves
    the streaming end on so the held records are read exactly once."""
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from spark_analytics.options import parse_options
    from spark_analytics.source import LightgateBatchReader, LightgateStreamReader, read_range

    data = tmp_path / "data"

    def rows(opts: object, parts: list) -> list[str]:
        out: list[str] = []
        for part in parts:
            for rb in read_range(opts, part):  # type: ignore[arg-type]
                out += [v.decode() for v in rb.column("value").to_pylist()]
        return out

    async with running_gateway(data) as gw:
        p, _ = await asyncio.to_thread(_commit_abort_open, gw.bootstrap)
        opts = parse_options({"path": str(data), "topics": "cmds"}, streaming=False)
        parts = LightgateBatchReader(opts).partitions()
        assert [(r.start, r.end) for r in parts] == [(0, 4)]  # offsets 0 ok1, 1 marker, 2 bad1,
        assert rows(opts, parts) == ["ok1"]  # 3 abort marker, 4 held (open), 5 plain
        sopts = parse_options({"path": str(data), "topics": "cmds",
                               "startingOffsets": "earliest"}, streaming=True)  # fmt: skip
        stream = LightgateStreamReader(sopts)
        start = stream.initialOffset()
        end = stream.latestOffset(start, ReadAllAvailable())
        assert end == {"cmds": {"0": 4}}
        first = rows(sopts, stream.partitions(start, end))
        await asyncio.to_thread(p.commit_transaction, 10)
        end2 = stream.latestOffset(end, ReadAllAvailable())
        assert end2 == {"cmds": {"0": 7}}
        second = rows(sopts, stream.partitions(end, end2))
        assert (first, second) == (["ok1"], ["held", "plain"])
