"""Spark scan of the `lightgate` source: the same records in local segments vs. on a Kafka cluster.

    .venv/bin/python bench/spark_cluster_bench.py --records 1000000

Writes N MQTT-like records as segments (bench/spark_bench.py's `make_data`: 2 partitions, 500
records per batch), produces the very same batches to a fresh Tansu broker (KafkaLog.append_batch),
then times a full scan of every column (`noop` sink), best of --repeat, from the data dir and from
the cluster (`kafka.bootstrap.servers`). Prints `uptime` (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from spark_bench import make_data, timed  # noqa: E402
from tansu import start_tansu  # noqa: E402


async def to_cluster(data: Path, bootstrap: str, partitions: int) -> None:
    from store.cluster.kafka_log import KafkaLog, KafkaLogConfig
    from store.record_batch import iter_batches

    kl = await KafkaLog.open(data.parent / "cluster-node", KafkaLogConfig(
        bootstrap, topic_partitions=partitions, client={"enable_idempotence": False}))  # fmt: skip
    try:
        kl.ensure_topic("sensors", partitions)
        pending = []
        for p in range(partitions):
            buf = (data / "log" / f"sensors-{p}" / f"{0:020d}.log").read_bytes()
            for pos, size in iter_batches(buf):
                pending.append(kl.append_batch("sensors", p, buf[pos : pos + size]).durable)
                if len(pending) >= 200:
                    await asyncio.gather(*pending)
                    pending = []
        await asyncio.gather(*pending)
    finally:
        await kl.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()
    print("uptime:", os.popen("uptime").read().strip(), flush=True)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import spark_analytics

    tmp = Path(tempfile.mkdtemp(prefix="lg-spark-cluster-bench-"))
    t = start_tansu(tmp)
    try:
        data = tmp / "data"
        make_data(data, args.records, args.partitions, 500)
        t0 = time.perf_counter()
        asyncio.run(to_cluster(data, t.bootstrap, args.partitions))
        print(
            f"produced {args.records:,} records to the cluster in {time.perf_counter() - t0:.1f} s"
        )
        spark = (
            SparkSession.builder.master(f"local[{args.cores}]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark_analytics.register(spark)

        def local() -> None:
            spark.read.format("lightgate").load(str(data)).write.format("noop").mode(
                "overwrite"
            ).save()

        def cluster() -> None:
            spark.read.format("lightgate").option("kafka.bootstrap.servers", t.bootstrap).option(
                "topics", "sensors"
            ).load().write.format("noop").mode("overwrite").save()

        n = (
            spark.read.format("lightgate")
            .option("kafka.bootstrap.servers", t.bootstrap)
            .option("topics", "sensors")
            .load()
            .count()
        )
        assert n == args.records, n
        local()
        t_local = timed(local, args.repeat)
        t_cluster = timed(cluster, args.repeat)
        for name, s in (("local segments", t_local), ("cluster", t_cluster)):
            print(f"{name}: {s:.2f} s, {args.records / s:,.0f} records/s")
        spark.stop()
    finally:
        t.stop()
    print("uptime:", os.popen("uptime").read().strip(), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
