"""Device analytics jobs on the log: each writes Parquet plus a PNG chart and returns a `JobResult`.

    spark = make_session()
    r = message_rates(spark, "./data", "./analytics", window="1 minute")
    r.table.head()      # pandas; r.parquet, r.chart are the files

Jobs read through the `lightgate` source, so they see exactly what MQTT and Kafka clients see.
`telemetry` runs as a checkpointed Structured Streaming query (AvailableNow) because a watermark
only means something there: re-running it reads only new records, and records later than the
watermark are dropped (and counted) instead of silently reopening closed windows.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.window import Window

from spark_analytics import charts
from spark_analytics.inputs import (
    DEVICE_EVENTS_TOPIC,
    AnalyticsError,
    NoRecords,
    Selection,
    check_device_from,
    checkpoint_offsets,
    select,
    window_seconds,
)
from spark_analytics.inputs import parse_since as parse_since  # re-exported for callers
from spark_analytics.inputs import topics_option as topics_option

Progress = Callable[[str], None]
_NUMERIC = r"^(TINYINT|SMALLINT|INT|BIGINT|FLOAT|DOUBLE|DECIMAL)"


@dataclass(frozen=True)
class JobResult:
    name: str
    parquet: Path
    chart: Path
    rows: int
    table: pd.DataFrame
    info: dict[str, object]


@dataclass
class _Merged:
    """The telemetry job's table across its micro-batches (`merge` replaces it)."""

    table: pd.DataFrame | None
    batches: int = 0


def stderr_progress(msg: str) -> None:
    print(f"lightgate analytics: {msg}", file=sys.stderr, flush=True)


def make_session(master: str = "local[*]", app: str = "lightgate-analytics") -> SparkSession:
    """A local session with the `lightgate` source registered and the UI off (or the active one)."""
    import os

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import spark_analytics

    active = SparkSession.getActiveSession()
    if active is not None:
        spark_analytics.register(active)
        return active
    spark = (
        SparkSession.builder.master(master)
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # our bars, not "[Stage 3:>  (0 + 2)]"
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        # A Python worker (our data source's reader) must answer Spark's handshake within this;
        # the default 15 s failed once on a loaded 2-core machine ("Python worker failed to
        # connect back": SocketTimeoutException in SocketAuthHelper, a streaming read's start).
        .config("spark.python.authenticate.socketTimeout", "60s")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark_analytics.register(spark)
    return spark


def check_data(data_dir: str | Path, topics: list[str] | None = None) -> dict[str, int]:
    """Records per topic (from batch headers); NoRecords saying why when there are none."""
    return selected(data_dir, {"topics": ",".join(topics)} if topics else None).counts


def selected(
    data_dir: str | Path,
    options: dict[str, str] | None = None,
    since_ms: int | None = None,
    until_ms: int | None = None,
) -> Selection:
    """`inputs.select`, raising NoRecords (with the reason) when nothing can match."""
    sel = select(data_dir, options, since_ms, until_ms)
    if sel.reason:
        raise NoRecords(sel.reason)
    return sel


def _read(
    spark: SparkSession,
    data_dir: str | Path,
    since_ms: int | None,
    until_ms: int | None,
    options: dict[str, str] | None = None,
) -> DataFrame:
    r = spark.read.format("lightgate")
    if since_ms is not None:
        r = r.option("startingTimestamp", str(since_ms))
    for k, v in (options or {}).items():
        r = r.option(k, v)
    df = r.load(str(data_dir))
    if until_ms is not None:
        df = df.where(F.col("timestamp") < F.timestamp_millis(F.lit(until_ms)))
    return df


def device_col(device_from: str = "client_id") -> Column:
    """`client_id` (falling back to the MQTT topic for Kafka-produced records) or `topic:N`.

    `topic:N` is level N of the MQTT topic (0 = first). A topic with fewer levels (a Kafka record
    keyed `sensors`) is its own device, the same fallback as `client_id` mode: every record still
    counts and shows under a name the analyst can find, instead of failing the job (ANSI
    out-of-bounds) or hiding behind a null.
    """
    level = check_device_from(device_from)
    if level is None:
        return F.coalesce(F.col("client_id"), F.col("mqtt_topic"))
    part = F.get(F.split(F.col("mqtt_topic"), "/"), level)  # null past the end, even under ANSI
    return F.coalesce(F.when(part != "", part), F.col("mqtt_topic"))


def _to_pandas(df: DataFrame) -> pd.DataFrame:
    """toPandas with timestamps marked UTC (Spark hands them over naive, in session time)."""
    tz = df.sparkSession.conf.get("spark.sql.session.timeZone") or "UTC"
    out: pd.DataFrame = df.toPandas()
    for c in out.columns:
        if pd.api.types.is_datetime64_dtype(out[c]) and getattr(out[c].dt, "tz", None) is None:
            out[c] = out[c].dt.tz_localize(tz).dt.tz_convert("UTC")
    return out


def _write(df: pd.DataFrame, path: Path) -> None:
    """Small results: one Parquet file through pyarrow (no Spark job, no _SUCCESS clutter)."""
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*.parquet"):
        old.unlink()
    tmp = path / ".part-0.parquet.tmp"
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), tmp)
    tmp.replace(path / "part-0.parquet")


def message_rates(
    spark: SparkSession,
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    window: str = "1 minute",
    since_ms: int | None = None,
    until_ms: int | None = None,
    device_from: str = "client_id",
    options: dict[str, str] | None = None,
    progress: Progress = stderr_progress,
) -> JobResult:
    """Messages, bytes and messages/s per device per time window (broker receive time)."""
    out = Path(out_dir)
    sel = selected(data_dir, options, since_ms, until_ms)
    progress(f"rates 1/3: reading {sel.describe()}")
    df = _read(spark, data_dir, since_ms, until_ms, options)
    secs = window_seconds(window)
    agg = (
        df.groupBy(device_col(device_from).alias("device"), F.window("timestamp", window))
        .agg(
            F.count("*").alias("messages"),
            F.sum(F.length("value")).alias("bytes"),
            F.min("timestamp").alias("first"),
            F.max("timestamp").alias("last"),
        )
        .select(
            "device",
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "messages",
            F.coalesce("bytes", F.lit(0)).alias("bytes"),
            "first",
            "last",
        )
        .orderBy("window_start", "device")
    )
    progress("rates 2/3: aggregating per device and window")
    table = _to_pandas(agg)
    if table.empty:
        raise NoRecords(sel.empty_after_read())
    table = _scale_partial(table, secs)
    progress(f"rates 3/3: writing {len(table):,} rows and a chart to {out}")
    _write(table, out / "rates")
    chart = charts.rates_chart(table, out / "rates.png")
    return JobResult("rates", out / "rates", chart, len(table), table, {"window_s": secs})


def _scale_partial(table: pd.DataFrame, window_s: int) -> pd.DataFrame:
    """msgs_per_s over the part of each window the data covers; `partial` marks the short ones.

    The data covers [first record, last record + one typical gap between a device's records] of
    the whole selection: 15 s of traffic at 4 msg/s in a 1-minute window is 4 msg/s over 15 s,
    not 1 msg/s over 60 s. Windows inside the span divide by the full window (silence inside the
    span is real silence). The typical gap is the median over device-windows of
    (last - first) / (messages - 1). At least 1 s (one record).
    """
    t = table.copy()
    lo, hi = t["first"].min(), t["last"].max()
    many = t[t["messages"] > 1]
    if not many.empty:
        hi = hi + ((many["last"] - many["first"]) / (many["messages"] - 1)).median()
    start = t["window_start"].where(t["window_start"] > lo, lo)
    end = t["window_end"].where(t["window_end"] < hi, hi)
    covered = (end - start).dt.total_seconds().clip(lower=min(1.0, window_s), upper=window_s)
    t["covered_s"] = covered
    t["partial"] = covered < window_s
    t["msgs_per_s"] = t["messages"] / covered
    cols = ["device", "window_start", "window_end", "messages", "bytes", "msgs_per_s"]
    return t[[*cols, "covered_s", "partial"]]


def top_talkers(
    spark: SparkSession,
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    n: int = 10,
    by: str = "messages",
    since_ms: int | None = None,
    until_ms: int | None = None,
    device_from: str = "client_id",
    options: dict[str, str] | None = None,
    progress: Progress = stderr_progress,
) -> JobResult:
    """The n devices sending the most messages (or bytes), with topics and first/last seen."""
    if by not in ("messages", "bytes"):
        raise AnalyticsError(f"top-talkers --by {by!r}: use messages or bytes")
    out = Path(out_dir)
    sel = selected(data_dir, options, since_ms, until_ms)
    progress(f"top-talkers 1/2: scanning {sel.describe()}")
    df = _read(spark, data_dir, since_ms, until_ms, options)
    top_df = (
        df.groupBy(device_col(device_from).alias("device"))
        .agg(
            F.count("*").alias("messages"),
            F.coalesce(F.sum(F.length("value")), F.lit(0)).alias("bytes"),
            F.countDistinct("mqtt_topic").alias("topics"),
            F.min("timestamp").alias("first_seen"),
            F.max("timestamp").alias("last_seen"),
        )
        .orderBy(F.desc(by), "device")
    )
    every = _to_pandas(top_df)  # one row per device: small next to the records
    if every.empty:
        raise NoRecords(sel.empty_after_read())
    top = every.head(n).reset_index(drop=True)
    other = (len(every) - len(top), int(every[by].iloc[n:].sum()))
    progress(f"top-talkers 2/2: writing {len(top)} rows and a chart to {out}")
    _write(top, out / "top_talkers")
    chart = charts.top_talkers_chart(top, out / "top_talkers.png", by, other)
    info = {"by": by, "other_devices": other[0], f"other_{by}": other[1]}
    return JobResult("top-talkers", out / "top_talkers", chart, len(top), top, info)


def device_sessions(
    spark: SparkSession,
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    since_ms: int | None = None,
    until_ms: int | None = None,
    progress: Progress = stderr_progress,
) -> JobResult:
    """Online/offline intervals per client from connect/disconnect events.

    Each event opens an interval that the client's next event closes: `connect` -> online,
    `disconnect` -> offline; the closing disconnect's reason is the online interval's reason.
    A connect after a connect (the gateway died) closes the first one with reason `unknown`.
    The last interval of a client is open (`end` null).
    """
    out = Path(out_dir)
    try:
        sel = selected(data_dir, {"topics": DEVICE_EVENTS_TOPIC}, since_ms, until_ms)
    except NoRecords as exc:
        raise NoRecords(
            f"{exc}. Device events are written to {DEVICE_EVENTS_TOPIC} by the MQTT proxy."
        ) from None
    progress(f"sessions 1/3: reading {sel.describe()} ({DEVICE_EVENTS_TOPIC})")
    ev = _read(spark, data_dir, since_ms, until_ms, {"topics": DEVICE_EVENTS_TOPIC})
    j = F.try_parse_json(F.col("value").cast("string"))
    events = ev.select(
        F.coalesce(
            F.try_variant_get(j, "$.client_id", "string"), F.col("key").cast("string")
        ).alias("client_id"),
        F.lower(F.try_variant_get(j, "$.event", "string")).alias("event"),
        F.coalesce(
            F.timestamp_millis(F.try_variant_get(j, "$.ts", "bigint")),
            F.try_variant_get(j, "$.ts", "timestamp"),
            F.col("timestamp"),
        ).alias("ts"),
        F.try_variant_get(j, "$.reason", "string").alias("reason"),
        F.try_variant_get(j, "$.remote", "string").alias("remote"),
        F.col("offset"),
    ).where(F.col("event").isin("connect", "disconnect"))
    w = Window.partitionBy("client_id").orderBy("ts", "offset")
    nxt_event = F.lead("event").over(w)
    iv = events.select(
        "client_id",
        F.when(F.col("event") == "connect", "online").otherwise("offline").alias("state"),
        F.col("ts").alias("start"),
        F.lead("ts").over(w).alias("end"),
        F.when(
            F.col("event") == "connect",
            F.when(nxt_event == "disconnect", F.lead("reason").over(w)).when(
                nxt_event == "connect", F.lit("unknown")
            ),
        ).alias("reason"),
        F.when(F.col("event") == "connect", F.col("remote")).alias("remote"),
    ).withColumn(
        "duration_s",
        F.col("end").cast("double") - F.col("start").cast("double"),
    )
    progress("sessions 2/3: pairing connect/disconnect events per client")
    table = _to_pandas(iv.orderBy("client_id", "start"))
    if table.empty:
        raise NoRecords(f"none of the {sel.describe()} is a connect or disconnect event")
    progress(f"sessions 3/3: writing {len(table):,} intervals and a chart to {out}")
    _write(table, out / "sessions")
    chart = charts.sessions_chart(table, out / "sessions.png")
    online = table[table["state"] == "online"]
    info: dict[str, object] = {
        "clients": int(table["client_id"].nunique()),
        "online_now": int(online["end"].isna().sum()),
    }
    return JobResult("sessions", out / "sessions", chart, len(table), table, info)


def telemetry(
    spark: SparkSession,
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    window: str = "1 minute",
    watermark: str = "10 minutes",
    time_field: str | None = "ts",
    since_ms: int | None = None,
    device_from: str = "client_id",
    options: dict[str, str] | None = None,
    fresh: bool = False,
    progress: Progress = stderr_progress,
) -> JobResult:
    """count/avg/min/max of every numeric JSON field per device per event-time window.

    Event time is the payload's `time_field` (epoch ms or ISO-8601) when present, else the broker
    receive time. Output columns: device, field, window_start, window_end, count, avg, min, max,
    closed (the watermark has passed the window: it will not change any more).
    """
    out = Path(out_dir)
    sel = selected(data_dir, options, since_ms)
    window_seconds(window)
    window_seconds(watermark)
    key = json.dumps([str(data_dir), window, watermark, time_field, since_ms, device_from, options])
    ckpt = out / "_checkpoints" / ("telemetry-" + hashlib.sha1(key.encode()).hexdigest()[:12])
    target = out / "telemetry"
    if fresh:
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(target, ignore_errors=True)
    old = pd.read_parquet(target) if (target / "part-0.parquet").exists() else None
    committed = checkpoint_offsets(ckpt)
    state = _Merged(old)
    if committed is None:
        what = f"streaming {sel.describe()} (new checkpoint {ckpt.name}"
    else:
        new = sel.new_since(committed)
        more = "" if sel.exact else "up to "
        what = f"streaming {more}{new:,} new records (checkpoint {ckpt.name} has the rest"
    progress(f"telemetry 1/3: {what}, window {window}, watermark {watermark})")

    r = spark.readStream.format("lightgate").option("startingOffsets", "earliest")
    if since_ms is not None:
        r = r.option("startingTimestamp", str(since_ms))
    for k, v in (options or {}).items():
        r = r.option(k, v)
    src = r.load(str(data_dir))
    j = F.try_parse_json(F.col("value").cast("string"))
    event_time = F.col("timestamp")
    if time_field:
        path = f"$.{time_field}"
        event_time = F.coalesce(
            F.timestamp_millis(F.try_variant_get(j, path, "bigint")),
            F.try_variant_get(j, path, "timestamp"),
            F.col("timestamp"),
        )
    fields = src.select(
        device_col(device_from).alias("device"),
        event_time.alias("event_time"),
        F.explode(F.try_variant_get(j, "$", "map<string,variant>")).alias("field", "v"),
    )
    numeric = fields.where(F.schema_of_variant("v").rlike(_NUMERIC))
    if time_field:
        numeric = numeric.where(F.col("field") != time_field)
    agg = (
        numeric.select(
            "device", "event_time", "field", F.try_variant_get("v", "$", "double").alias("x")
        )
        .withWatermark("event_time", watermark)
        .groupBy("device", "field", F.window("event_time", window))
        .agg(
            F.count("x").alias("count"),
            F.avg("x").alias("avg"),
            F.min("x").alias("min"),
            F.max("x").alias("max"),
        )
        .select(
            "device",
            "field",
            F.col("window.start").alias("window_start"),
            F.col("window.end").alias("window_end"),
            "count",
            "avg",
            "min",
            "max",
        )
    )

    def merge(batch: DataFrame, batch_id: int) -> None:
        upd = _to_pandas(batch)
        state.batches += 1
        if upd.empty:
            return
        cur = state.table
        if cur is not None and not cur.empty:
            keys = ["device", "field", "window_start"]
            cur = cur.drop(columns=["closed"], errors="ignore")
            both = pd.concat([cur, upd], ignore_index=True)
            upd = both.drop_duplicates(subset=keys, keep="last")
        state.table = upd
        _write(_closed(upd, None), target)
        progress(f"telemetry 2/3: micro-batch {batch_id} done, {len(upd):,} windows so far")

    q = (
        agg.writeStream.outputMode("update")
        .foreachBatch(merge)
        .option("checkpointLocation", str(ckpt))
        .trigger(availableNow=True)
        .start()
    )
    q.awaitTermination()
    if q.exception() is not None:
        raise AnalyticsError(f"telemetry query failed: {q.exception()}")
    dropped = 0
    wm = None
    read = sum(int(p.get("numInputRows", 0)) for p in q.recentProgress)
    for p in q.recentProgress:
        for op in p.get("stateOperators", []):
            dropped += int(op.get("numRowsDroppedByWatermark", 0))
        wm = p.get("eventTime", {}).get("watermark", wm)
    if state.table is None or state.table.empty:
        why = sel.empty_after_read() if not read else f"no numeric JSON fields in {read:,} records"
        raise NoRecords(why)
    table = _closed(state.table.sort_values(["device", "field", "window_start"]), wm)
    _write(table, target)
    progress(
        f"telemetry 3/3: read {read:,} new records; {len(table):,} windows, "
        f"{dropped} late reading field(s) dropped this run"
    )
    chart = charts.telemetry_chart(table, out / "telemetry.png")
    info = {
        "late_dropped": dropped,
        "watermark": wm,
        "checkpoint": str(ckpt),
        "new_records": read,
        "resumed": committed is not None,
    }
    return JobResult("telemetry", target, chart, len(table), table.reset_index(drop=True), info)


def _closed(table: pd.DataFrame, watermark: str | None) -> pd.DataFrame:
    t = table.copy()
    if watermark is None:
        t["closed"] = False
    else:
        wm = pd.Timestamp(watermark)
        ends = pd.to_datetime(t["window_end"], utc=True)
        t["closed"] = ends <= (wm if wm.tzinfo else wm.tz_localize("UTC"))
    return t
