"""Scan rate of the `lightgate` Spark source vs the same records as Parquet, in one run.

    .venv/bin/python bench/spark_bench.py --records 4000000

Writes N MQTT-like records (JSON telemetry, MQTT headers, 2 partitions, 500 records per batch,
as group commit produces them) as Kafka RecordBatch v2 segments, copies them to Parquet through
the source, then times a full scan of every column (`noop` sink) of both, best of --repeat; then
the streaming source (AvailableNow, noop sink) and the decoder alone (no Spark, one core).
"Spark ceiling" is a Python data source with the same schema that re-yields one already decoded
batch: what Spark's Python-source path costs for this schema with zero decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aiokafka.record.default_records import DefaultRecordBatchBuilder  # noqa: E402


def make_data(data_dir: Path, records: int, partitions: int, per_batch: int) -> None:
    log = data_dir / "log"
    log.mkdir(parents=True)
    (log / "topics.json").write_text(
        json.dumps({"sensors": {"partitions": partitions, "config": {}}})
    )
    files = []
    for p in range(partitions):
        (log / f"sensors-{p}").mkdir()
        files.append(open(log / f"sensors-{p}" / f"{0:020d}.log", "wb"))  # noqa: SIM115
    next_off = [0] * partitions
    t0 = 1_700_000_000_000
    i = 0
    while i < records:
        p = (i // per_batch) % partitions
        b = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1 << 30)
        for j in range(min(per_batch, records - i)):
            dev = (i + j) % 1000
            b.append(
                j,
                timestamp=t0 + i + j,
                key=b"sensors/dev%d/telemetry" % dev,
                value=b'{"temp": %d.%d, "hum": %d, "seq": %d}'
                % (20 + dev % 10, j % 10, 40 + j % 20, i + j),
                headers=[("mqtt.qos", b"1"), ("mqtt.client_id", b"dev%d" % dev)],
            )
        buf = bytearray(b.build())
        n = min(per_batch, records - i)
        struct.pack_into(">q", buf, 0, next_off[p])
        next_off[p] += n
        files[p].write(buf)
        i += n
    for f in files:
        f.close()


class _Ceiling:
    """A Python data source with the lightgate schema that re-yields one pre-decoded Arrow batch:
    what Spark itself costs for this schema, with zero decoding (the source's upper bound)."""

    @staticmethod
    def register(spark, data_dir: str, records: int, partitions: int) -> None:
        from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

        class Reader(DataSourceReader):
            def partitions(self):
                return [InputPartition(i) for i in range(partitions)]

            def read(self, part):
                from spark_analytics.options import parse_options
                from spark_analytics.source import LightgateBatchReader, read_range

                opts = parse_options({"path": data_dir}, streaming=False)
                first = LightgateBatchReader(opts).partitions()[0]
                rb = next(read_range(opts, first))
                left = records // partitions
                while left > 0:
                    out = rb if left >= rb.num_rows else rb.slice(0, left)
                    left -= out.num_rows
                    yield out

        class Ceiling(DataSource):
            @classmethod
            def name(cls):
                return "lightgate_ceiling"

            def schema(self):
                from spark_analytics import SCHEMA

                return SCHEMA

            def reader(self, schema):
                return Reader()

        spark.dataSource.register(Ceiling)


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=4_000_000)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--per-batch", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    import spark_analytics
    from spark_analytics.options import parse_options
    from spark_analytics.source import LightgateBatchReader, read_range

    tmp = Path(tempfile.mkdtemp(prefix="lg-spark-bench-"))
    try:
        data = tmp / "data"
        t = time.perf_counter()
        make_data(data, args.records, args.partitions, args.per_batch)
        size = sum(f.stat().st_size for f in (data / "log").rglob("*.log"))
        print(
            f"wrote {args.records:,} records, {size / 1e6:.0f} MB log in {time.perf_counter() - t:.1f}s"
        )

        opts = parse_options({"path": str(data)}, streaming=False)

        def decode_only() -> None:
            n = 0
            for part in LightgateBatchReader(opts).partitions():
                for rb in read_range(opts, part):
                    n += rb.num_rows
            assert n == args.records, n

        t_dec = timed(decode_only, args.repeat)

        spark = (
            SparkSession.builder.master(f"local[{args.cores}]")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(args.cores))
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        spark_analytics.register(spark)
        src = spark.read.format("lightgate").load(str(data))
        pq = tmp / "parquet"
        src.write.parquet(str(pq))
        assert spark.read.parquet(str(pq)).count() == args.records

        def scan_lightgate() -> None:
            spark.read.format("lightgate").load(str(data)).write.format("noop").mode(
                "overwrite"
            ).save()

        def scan_parquet() -> None:
            spark.read.parquet(str(pq)).write.format("noop").mode("overwrite").save()

        _Ceiling.register(spark, str(data), args.records, args.cores * 2)

        def scan_ceiling() -> None:
            spark.read.format("lightgate_ceiling").load().write.format("noop").mode(
                "overwrite"
            ).save()

        scan_lightgate()  # warm the Python workers
        scan_ceiling()
        t_lg = timed(scan_lightgate, args.repeat)
        t_pq = timed(scan_parquet, args.repeat)
        t_ceil = timed(scan_ceiling, args.repeat)

        def stream() -> float:
            """Wall time of one AvailableNow query; returns the summed trigger time too."""
            ck = tmp / f"ckpt-{time.monotonic_ns()}"
            q = (
                spark.readStream.format("lightgate")
                .option("startingOffsets", "earliest")
                .option("maxRecordsPerTrigger", str(args.records // 4))
                .load(str(data))
                .writeStream.format("noop")
                .option("checkpointLocation", str(ck))
                .trigger(availableNow=True)
                .start()
            )
            q.awaitTermination()
            rows = sum(p["numInputRows"] for p in q.recentProgress)
            assert rows == args.records, rows
            return sum(p["durationMs"]["triggerExecution"] for p in q.recentProgress) / 1000

        stream()  # warm up the streaming planner worker
        runs = []
        for _ in range(max(1, args.repeat - 1)):
            t = time.perf_counter()
            trig = stream()
            runs.append((time.perf_counter() - t, trig))
        t_st, t_trig = min(runs)
        spark.stop()

        n = args.records
        print(f"decoder alone (1 core, no Spark): {n / t_dec:,.0f} records/s ({t_dec:.2f}s)")
        print(
            f"lightgate source scan, local[{args.cores}]: {n / t_lg:,.0f} records/s ({t_lg:.2f}s)"
        )
        print(
            f"Spark ceiling, Python source re-yielding one decoded batch, local[{args.cores}]: "
            f"{n / t_ceil:,.0f} records/s ({t_ceil:.2f}s)"
        )
        print(
            f"parquet scan (same records), local[{args.cores}]: {n / t_pq:,.0f} records/s ({t_pq:.2f}s)"
        )
        print(
            f"streaming source, AvailableNow, 4 micro-batches, local[{args.cores}]: "
            f"{n / t_st:,.0f} records/s end to end incl. query start ({t_st:.2f}s); "
            f"{n / t_trig:,.0f} records/s within triggers ({t_trig:.2f}s)"
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
