"""`lightgate analytics` option parsing: every option error exits 2 before Spark starts.

No Spark here: each test proves the error came first by the absence of the "starting Spark" line
(and returns in well under a second).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from spark_analytics import cli
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
