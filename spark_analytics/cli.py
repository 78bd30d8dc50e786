"""`lightgate analytics ...`: the jobs of `spark_analytics.jobs` from the command line.

Mounted by `lightgate/cli.py` as `lightgate analytics <argv>`; also `python -m spark_analytics.cli`.
Input problems (missing or empty data dir, bad --since) are reported before Spark starts.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from spark_analytics.inputs import (
    DEVICE_EVENTS_TOPIC,
    AnalyticsError,
    check_device_from,
    parse_since,
    select,
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


EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NO_RECORDS = 0, 1, 2, 3
_STEP = re.compile(r"^(\S+) (\d+)/(\d+): (.*)$", re.S)


def say(msg: str) -> None:
    print(f"lightgate analytics: {msg}", file=sys.stderr, flush=True)


class JobBar:
    """One rich progress bar per job on stderr, fed the jobs' "name i/n: what" progress lines.

    Each bar is stopped before the job's result is printed on stdout, so they never share a line.
    When stderr is not a terminal (logs, CI) the lines are printed as they are instead.
    """

    def __init__(self, job: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
        from rich.table import Column

        self.console = Console(stderr=True)
        self.live = self.console.is_terminal
        self.bar = Progress(
            TextColumn(job, table_column=Column(min_width=11, no_wrap=True)),
            BarColumn(bar_width=20),
            MofNCompleteColumn(table_column=Column(min_width=3, no_wrap=True)),
            # the step text is cut to the terminal width, never the job name or the bar
            TextColumn(
                "{task.description}",
                table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis"),
            ),
            console=self.console,
            redirect_stdout=False,
            redirect_stderr=False,
            transient=False,
            expand=True,
        )
        self.task = self.bar.add_task("starting", total=None)
        if self.live:
            self.bar.start()

    def __call__(self, msg: str) -> None:
        m = _STEP.match(msg)
        if m and self.live:
            step, total = int(m.group(2)), int(m.group(3))
            self.bar.update(self.task, total=total, completed=step - 1, description=m.group(4))
        else:
            say(msg)

    def stop(self, done: bool) -> None:
        if self.live:
            total = self.bar.tasks[0].total
            if done and total:
                self.bar.update(self.task, completed=total)
            self.bar.stop()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code: 0 ok, 1 a job failed, 2 bad input, 3 no records match.

    Order matters for the user: options (argparse, exit 2), then the data dir and what the
    selection holds (from batch headers), all before the JVM starts; then one Spark session for
    every requested job.
    """
    import warnings

    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas")
    ns = parse_args(list(sys.argv[1:] if argv is None else argv))
    since = parse_since(ns.since) if ns.since else None
    until = parse_since(ns.until) if ns.until else None
    options: dict[str, str] = {}
    if ns.topics:
        options["topics"] = ns.topics
    if ns.mqtt_filter:
        options["mqttTopicFilter"] = ns.mqtt_filter
    wanted = JOBS if ns.job == "all" else (ns.job,)
    try:
        data = select(ns.data_dir, options, since, until) if wanted != ("sessions",) else None
        events = (
            select(ns.data_dir, {"topics": DEVICE_EVENTS_TOPIC}, since, until)
            if "sessions" in wanted
            else None
        )
    except (AnalyticsError, FilterError, OptionError, LogDirError) as exc:
        say(f"error: {exc}")
        return EXIT_BAD_INPUT
    empty: list[str] = []
    runnable: list[str] = []
    for job in wanted:
        sel = events if job == "sessions" else data
        assert sel is not None
        if sel.reason and job == "sessions" and ns.job == "all":
            say(f"sessions skipped: {sel.reason} (the MQTT proxy writes {DEVICE_EVENTS_TOPIC})")
        elif sel.reason:
            say(f"{job}: {sel.reason}")
            empty.append(job)
        else:
            runnable.append(job)
    if not runnable:
        return EXIT_NO_RECORDS
    if shutil.which("java") is None:
        say("error: Java 17 is required (e.g. apt-get install openjdk-17-jre-headless)")
        return EXIT_BAD_INPUT

    from pyspark.sql import SparkSession

    from spark_analytics import jobs

    own = SparkSession.getActiveSession() is None  # inside a notebook/test: reuse, don't stop
    t0 = time.monotonic()
    say(f"starting Spark ({ns.master})" if own else "using the active Spark session")
    spark = jobs.make_session(ns.master)
    if own:
        say(f"Spark started in {time.monotonic() - t0:.1f}s; running {', '.join(runnable)}")
    failed: list[str] = []
    try:
        for job in runnable:
            bar = JobBar(job)
            try:
                res = _run(jobs, spark, job, ns, options, since, until, bar)
            except jobs.NoRecords as exc:
                bar.stop(done=False)
                if job == "sessions" and ns.job == "all":
                    say(f"sessions skipped: {exc}")
                else:
                    say(f"{job}: {exc}")
                    empty.append(job)
                continue
            except (AnalyticsError, FilterError, OptionError, LogDirError) as exc:
                bar.stop(done=False)
                say(f"error: {exc}")
                return EXIT_BAD_INPUT
            except Exception as exc:  # Spark errors: one line, not a JVM stack trace
                bar.stop(done=False)
                first = str(exc).splitlines()[0] if str(exc) else ""
                say(f"{job} failed: {type(exc).__name__}: {first}")
                failed.append(job)  # `all` goes on: the other jobs' results still count
                continue
            except BaseException:
                bar.stop(done=False)
                raise
            bar.stop(done=True)
            print(f"{res.name}: {res.rows} rows -> {res.parquet}  chart: {res.chart}", flush=True)
            if res.name in ("top-talkers", "sessions"):
                print(res.table.head(20).to_string(index=False), flush=True)
    finally:
        if own:
            spark.stop()
    if failed:
        return EXIT_FAILED
    return EXIT_NO_RECORDS if empty else EXIT_OK


def _run(
    jobs: Any,
    spark: Any,
    job: str,
    ns: argparse.Namespace,
    options: dict[str, str],
    since: int | None,
    until: int | None,
    progress: Callable[[str], None],
) -> Any:
    common: dict[str, Any] = {"since_ms": since, "progress": progress}
    if job == "rates":
        return jobs.message_rates(
            spark, ns.data_dir, ns.out, window=ns.window, until_ms=until,
            device_from=ns.device_from, options=options, **common,
        )  # fmt: skip
    if job == "telemetry":
        return jobs.telemetry(
            spark, ns.data_dir, ns.out, window=ns.window, watermark=ns.watermark,
            time_field=ns.time_field or None, device_from=ns.device_from, options=options,
            fresh=ns.fresh, **common,
        )  # fmt: skip
    if job == "sessions":
        return jobs.device_sessions(spark, ns.data_dir, ns.out, until_ms=until, **common)
    return jobs.top_talkers(
        spark, ns.data_dir, ns.out, n=ns.n, by=ns.by, until_ms=until,
        device_from=ns.device_from, options=options, **common,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
