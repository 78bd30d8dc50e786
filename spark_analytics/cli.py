"""`lightgate analytics ...`: the jobs of `spark_analytics.jobs` from the command line.

Mounted by `lightgate/cli.py` as `lightgate analytics <argv>`; also `python -m spark_analytics.cli`.
Input problems (missing or empty data dir, bad --since) are reported before Spark starts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence

from spark_analytics.inputs import (
    AnalyticsError,
    check_device_from,
    parse_since,
    window_seconds,
)
from spark_analytics.logdir import LogDirError
from spark_analytics.mqtt import FilterError, validate_filter
from spark_analytics.options import OptionError

JOBS = ("rates", "telemetry", "sessions", "top-talkers")
DASH_VALUES = ("--since", "--until")  # their values may start with '-' (-15m)


def _check(fn: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse `type` that validates with `fn` and keeps the text: errors exit 2 before Spark."""

    def check(text: str) -> str:
        try:
            fn(text)
        except (AnalyticsError, FilterError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    check.__name__ = getattr(fn, "__name__", "value")
    return check


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {n}")
    return n


def _add_window(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--window",
        default="1 minute",
        type=_check(window_seconds),
        help="window length (default '1 minute')",
    )


def _add_telemetry(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--watermark",
        default="10 minutes",
        type=_check(window_seconds),
        help="lateness allowed (default 10 minutes)",
    )
    p.add_argument(
        "--time-field",
        default="ts",
        help="payload field with the event time (ms or ISO-8601); '' = broker receive time",
    )
    p.add_argument("--fresh", action="store_true", help="forget the checkpoint; recompute all")


def _add_top(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=_positive_int, default=10, help="how many (default 10)")
    p.add_argument("--by", choices=("messages", "bytes"), default="messages")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir",
        default=os.environ.get("LIGHTGATE_DATA_DIR", "./data"),
        help="gateway data dir (default $LIGHTGATE_DATA_DIR or ./data)",
    )
    common.add_argument(
        "--out",
        default=os.environ.get("LIGHTGATE_ANALYTICS_OUT", "./analytics"),
        help="output dir (default $LIGHTGATE_ANALYTICS_OUT or ./analytics)",
    )
    common.add_argument(
        "--since",
        type=_check(parse_since),
        help="start time: Unix ms, ISO-8601 (…Z) or -15m / -2h / -7d",
    )
    common.add_argument(
        "--until", type=_check(parse_since), help="end time (exclusive), same forms as --since"
    )
    common.add_argument("--topics", help="comma-separated log topics (default: all device topics)")
    common.add_argument(
        "--filter",
        dest="mqtt_filter",
        type=_check(validate_filter),
        help="MQTT topic filter, e.g. sensors/+/temp",
    )
    common.add_argument(
        "--device-from",
        default="client_id",
        type=_check(check_device_from),
        help="device identity: client_id (default; MQTT topic when absent) or topic:N "
        "(MQTT topic level N, 0 = first; the whole topic when it has no level N)",
    )
    common.add_argument("--master", default="local[*]", help="Spark master (default local[*])")

    p = argparse.ArgumentParser(
        prog="lightgate analytics",
        description="Device analytics on the gateway's log with Spark. Each job writes Parquet "
        "(OUT/<job>/) and a PNG chart (OUT/<job>.png).",
    )
    sub = p.add_subparsers(dest="job", required=True)
    r = sub.add_parser(
        "rates", parents=[common], help="messages and messages/s per device per window"
    )
    _add_window(r)
    t = sub.add_parser(
        "telemetry",
        parents=[common],
        help="count/avg/min/max of numeric JSON fields per device per event-time window",
    )
    _add_window(t)
    _add_telemetry(t)
    sub.add_parser(
        "sessions",
        parents=[common],
        help="online/offline intervals per device from __lightgate_device_events",
    )
    k = sub.add_parser("top-talkers", parents=[common], help="the busiest devices")
    _add_top(k)
    a = sub.add_parser(
        "all",
        parents=[common],
        help="run every job in one Spark session (sessions only if events exist)",
    )
    _add_window(a)
    _add_telemetry(a)
    _add_top(a)
    return p


def join_dash_values(argv: Sequence[str]) -> list[str]:
    """`--since -5m` -> `--since=-5m`: argparse takes a value starting with '-' for an option."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in DASH_VALUES:
            nxt = next(it, None)
            if nxt is None:
                out.append(arg)
            elif nxt.startswith("-") and not nxt.startswith("--") and len(nxt) > 1:
                out.append(f"{arg}={nxt}")
            else:
                out.extend((arg, nxt))
        else:
            out.append(arg)
    return out


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and validate every option; bad input exits 2 here, before Spark starts."""
    return build_parser().parse_args(join_dash_values(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (0 ok, 1 job failed, 2 bad input)."""
    import warnings

    from spark_analytics import jobs

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    say = jobs.stderr_progress
    try:
        since = jobs.parse_since(ns.since) if ns.since else None
        until = jobs.parse_since(ns.until) if ns.until else None
        options: dict[str, str] = {}
        if ns.topics:
            options["topics"] = ns.topics
        if ns.mqtt_filter:
            options["mqttTopicFilter"] = ns.mqtt_filter
        wanted = JOBS if ns.job == "all" else (ns.job,)
        if ns.job == "sessions":
            jobs.check_data(ns.data_dir, [jobs.DEVICE_EVENTS_TOPIC])
        else:
            jobs.check_data(ns.data_dir, jobs.topics_option(options))
    except (jobs.AnalyticsError, FilterError, OptionError, LogDirError) as exc:
        say(f"error: {exc}")
        return 2
    if shutil.which("java") is None:
        say("error: Java 17 is required (e.g. apt-get install openjdk-17-jre-headless)")
        return 2

    from pyspark.sql import SparkSession

    own = SparkSession.getActiveSession() is None  # inside a notebook/test: reuse, don't stop
    say(f"starting Spark ({ns.master})" if own else "using the active Spark session")
    spark = jobs.make_session(ns.master)
    common = {"since_ms": since}
    results = []
    try:
        for job in wanted:
            if job == "rates":
                res = jobs.message_rates(
                    spark, ns.data_dir, ns.out, window=getattr(ns, "window", "1 minute"),
                    until_ms=until, device_from=ns.device_from, options=options, **common,
                )  # fmt: skip
            elif job == "telemetry":
                res = jobs.telemetry(
                    spark, ns.data_dir, ns.out, window=getattr(ns, "window", "1 minute"),
                    watermark=getattr(ns, "watermark", "10 minutes"),
                    time_field=getattr(ns, "time_field", "ts") or None,
                    device_from=ns.device_from, options=options,
                    fresh=getattr(ns, "fresh", False), **common,
                )  # fmt: skip
            elif job == "sessions":
                try:
                    res = jobs.device_sessions(spark, ns.data_dir, ns.out, until_ms=until, **common)
                except jobs.AnalyticsError as exc:
                    if ns.job != "all":
                        raise
                    say(f"sessions skipped: {exc}")
                    continue
            else:
                res = jobs.top_talkers(
                    spark, ns.data_dir, ns.out, n=getattr(ns, "n", 10),
                    by=getattr(ns, "by", "messages"), until_ms=until,
                    device_from=ns.device_from, options=options, **common,
                )  # fmt: skip
            results.append(res)
            print(f"{res.name}: {res.rows} rows -> {res.parquet}  chart: {res.chart}")
            if res.name in ("top-talkers", "sessions") and res.rows:
                print(res.table.head(20).to_string(index=False))
    except (jobs.AnalyticsError, FilterError, OptionError, LogDirError) as exc:
        say(f"error: {exc}")
        return 2
    except Exception as exc:  # Spark errors: one line, not a JVM stack trace
        say(f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return 1
    finally:
        if own:
            spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
