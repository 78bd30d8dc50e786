"""`lightgate analytics` option parsing: every option error exits 2 before Spark starts.

No Spark here: each test proves the error came first by the absence of the "starting Spark" line
(and returns in well under a second).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spark_analytics import cli
from spark_analytics.inputs import select
from tests.spark_helpers import LogWriter, mqtt_rec

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def test_since_and_until_take_negative_durations() -> None:
    ns = cli.parse_args(["top-talkers", "--since", "-5m", "--until", "-1m", "-n", "3"])
    assert (ns.since, ns.until, ns.n) == ("-5m", "-1m", 3)
    ns = cli.parse_args(["rates", "--since=-2h", "--filter", "sensors/#"])
    assert (ns.since, ns.mqtt_filter) == ("-2h", "sensors/#")
    assert cli.parse_args(["rates", "--since", "1700000000000"]).since == "1700000000000"


def test_all_takes_every_job_option() -> None:
    ns = cli.parse_args(
        ["all", "--window", "5 seconds", "-n", "3", "--watermark", "1 minute", "--by", "bytes"]
    )
    assert (ns.window, ns.n, ns.watermark, ns.by) == ("5 seconds", 3, "1 minute", "bytes")
    assert cli.parse_args(["all", "--time-field", "", "--fresh"]).fresh


@pytest.mark.parametrize(
    "args, says",
    [
        (["--device-from", "foo"], "argument --device-from: device_from 'foo'"),
        (["--device-from", "topic:x"], "argument --device-from"),
        (["--since", "yesterday"], "argument --since: time 'yesterday'"),
        (["--until", "2026-01-01T00:00:00"], "argument --until: time"),
        (["--filter", "a/#/b"], "argument --filter"),
        (["--window", "1 fortnight"], "argument --window: window '1 fortnight'"),
        (["--watermark", "soon"], "argument --watermark"),
        (["-n", "0"], "argument -n: must be > 0"),
    ],
)
def test_option_errors_before_spark(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    w = LogWriter(tmp_path, {"sensors": 1})
    w.append("sensors", 0, [mqtt_rec("sensors/d1/t", b"{}", "d1", 0, T0)])
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        cli.main(["all", "--data-dir", str(tmp_path), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "starting Spark" not in err, err
    assert time.monotonic() - t0 < 5


def _two_topics(data: Path) -> None:
    w = LogWriter(data, {"sensors": 2, "plant": 1})
    for i in range(6):
        w.append("sensors", i % 2, [mqtt_rec(f"sensors/d{i}/t", b"{}", f"d{i}", 0, T0 + i * 1000)])
    for i in range(4):
        w.append("plant", 0, [mqtt_rec("plant/l1/temp", b"1", "p1", 0, T0 + i * 1000)])


def test_progress_counts_follow_filter_and_since(tmp_path: Path) -> None:
    """What the jobs' first progress line says (it once said 10 records for every filter)."""
    _two_topics(tmp_path)
    assert select(tmp_path).describe() == "10 records from 2 topic(s)"
    flt = select(tmp_path, {"mqttTopicFilter": "sensors/#"})
    assert flt.describe() == "6 records from 1 topic(s), filter 'sensors/#'"
    plus = select(tmp_path, {"mqttTopicFilter": "+/l1/temp"})  # matched while reading
    assert plus.describe().startswith("up to 10 records from 2 topic(s)")
    late = select(tmp_path, since_ms=T0 + 3000)
    assert late.total == 3 + 1 and late.describe().endswith("since 2026-01-01T00:00:03.000Z")
    assert select(tmp_path, until_ms=T0 + 2000).total == 2 + 2
    assert select(tmp_path, {"topics": "plant"}, since_ms=T0 + 1000).total == 3


@pytest.mark.parametrize(
    "args, says",
    [
        (["--since", "-1m"], "no records at or after --since"),  # the data is from 2026-01-01
        (["--since", "2030-01-01T00:00:00Z"], "the newest of the 10 records"),
        (["--topics", "nosuch"], "topic(s) ['nosuch'] not found"),
        (["--filter", "nosuch/#"], "filter 'nosuch/#': its first level maps to no topic"),
        (["--until", "1000"], "none of the 10 records"),
    ],
)
def test_no_records_match_exits_3_with_the_reason(
    args: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _two_topics(tmp_path)
    assert cli.main(["top-talkers", "--data-dir", str(tmp_path), *args]) == cli.EXIT_NO_RECORDS
    err = capsys.readouterr().err
    assert says in err and "starting Spark" not in err, err


def test_empty_data_dir_exits_3_but_a_missing_one_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["rates", "--data-dir", str(tmp_path / "missing")]) == cli.EXIT_BAD_INPUT
    assert "does not exist" in capsys.readouterr().err
    LogWriter(tmp_path, {"sensors": 2})
    assert cli.main(["all", "--data-dir", str(tmp_path)]) == cli.EXIT_NO_RECORDS
    err = capsys.readouterr().err
    assert "rates: no records in" in err and "sessions skipped" in err, err
