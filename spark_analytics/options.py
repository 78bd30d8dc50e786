"""Options of the `lightgate` source, parsed once on the driver (docs/spark.md, "Options").

Offsets follow Spark's Kafka source: `earliest`, `latest`, or JSON such as
`{"sensors": {"0": 23, "1": -2}}` where -2 means earliest and -1 latest; `endingOffsets` is
exclusive. Unlike Kafka's source, partitions left out of the JSON take the default (batch:
earliest..latest, streaming: latest) instead of failing -- topics here grow partitions at runtime.
`startingTimestamp` (ms) wins over `startingOffsets`, as in Kafka's source.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from spark_analytics.mqtt import validate_filter

EARLIEST = -2
LATEST = -1
OffsetSpec = int | dict[str, dict[str, int]]  # EARLIEST / LATEST / per topic, per partition

DEFAULT_MAX_RECORDS_PER_PARTITION = 1_000_000
KNOWN = {
    "path",
    "topics",
    "mqtttopicfilter",
    "startingoffsets",
    "endingoffsets",
    "startingtimestamp",
    "maxrecordspertrigger",
    "minpartitions",
    "maxrecordsperpartition",
    "kafka.bootstrap.servers",
}


class OptionError(ValueError):
    """A bad option value; the message names the option."""


@dataclass(frozen=True, slots=True)
class ReadOptions:
    data_dir: str
    topics: tuple[str, ...] | None
    mqtt_filter: str | None
    starting: OffsetSpec
    ending: OffsetSpec
    starting_timestamp: int | None
    max_records_per_trigger: int | None
    min_partitions: int | None
    max_records_per_partition: int
    bootstrap: str | None = None  # read a Kafka cluster (`log = "kafka"`), not a data dir


def _offsets(name: str, raw: str | None, default: int, allow_earliest: bool = True) -> OffsetSpec:
    if raw is None:
        return default
    text = raw.strip()
    if text.lower() == "earliest":
        if not allow_earliest:
            raise OptionError(f"{name}: 'earliest' is not allowed here")
        return EARLIEST
    if text.lower() == "latest":
        return LATEST
    try:
        spec = json.loads(text)
        if not isinstance(spec, dict):
            raise ValueError("expected an object")
        out = {str(t): {str(int(p)): int(o) for p, o in parts.items()} for t, parts in spec.items()}
    except (ValueError, AttributeError, TypeError) as exc:
        raise OptionError(
            f'{name}: expected earliest, latest or JSON like {{"topic": {{"0": 42}}}}, '
            f"got {raw!r} ({exc})"
        ) from None
    for parts in out.values():
        for o in parts.values():
            if o < EARLIEST or (o == EARLIEST and not allow_earliest):
                raise OptionError(f"{name}: offset {o} is not valid")
    return out


def _positive(name: str, raw: str | None) -> int | None:
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"{name}: expected an integer, got {raw!r}") from None
    if value <= 0:
        raise OptionError(f"{name}: must be > 0, got {value}")
    return value


def parse_options(options: Mapping[str, str], streaming: bool) -> ReadOptions:
    """Validate and normalise; errors surface at `load()` time, not inside a task."""
    opts = {k.lower(): v for k, v in options.items()}
    unknown = set(opts) - KNOWN
    if unknown:
        raise OptionError(f"unknown option(s) {sorted(unknown)}; known: {sorted(KNOWN)}")
    path = opts.get("path")
    bootstrap = opts.get("kafka.bootstrap.servers") or None
    if not path and not bootstrap:
        raise OptionError(
            "no data dir: use .load(DATA_DIR) or .option('path', DATA_DIR), or read a cluster"
            " with .option('kafka.bootstrap.servers', 'host:port')"
        )
    topics = None
    if opts.get("topics"):
        topics = tuple(t.strip() for t in opts["topics"].split(",") if t.strip())
    if bootstrap and not topics:
        raise OptionError("kafka.bootstrap.servers: name the topics (option 'topics'), as "
                          "with Spark's Kafka source")  # fmt: skip
    flt = opts.get("mqtttopicfilter") or None
    if flt is not None:
        validate_filter(flt)
    if streaming and "endingoffsets" in opts:
        raise OptionError("endingOffsets is for batch queries only")
    ts = opts.get("startingtimestamp")
    try:
        starting_ts = None if ts is None else int(ts)
    except ValueError:
        raise OptionError(f"startingTimestamp: expected milliseconds, got {ts!r}") from None
    if not streaming and "maxrecordspertrigger" in opts:
        raise OptionError("maxRecordsPerTrigger is for streaming queries only")
    return ReadOptions(
        data_dir=path or "",
        bootstrap=bootstrap,
        topics=topics,
        mqtt_filter=flt,
        starting=_offsets(
            "startingOffsets", opts.get("startingoffsets"), LATEST if streaming else EARLIEST
        ),
        ending=_offsets("endingOffsets", opts.get("endingoffsets"), LATEST, allow_earliest=False),
        starting_timestamp=starting_ts,
        max_records_per_trigger=_positive("maxRecordsPerTrigger", opts.get("maxrecordspertrigger")),
        min_partitions=_positive("minPartitions", opts.get("minpartitions")),
        max_records_per_partition=_positive(
            "maxRecordsPerPartition", opts.get("maxrecordsperpartition")
        )
        or DEFAULT_MAX_RECORDS_PER_PARTITION,
    )


def offset_for(spec: OffsetSpec, topic: str, partition: int, default: int) -> int:
    """EARLIEST, LATEST or a concrete offset for one partition."""
    if isinstance(spec, int):
        return spec
    return spec.get(topic, {}).get(str(partition), default)
