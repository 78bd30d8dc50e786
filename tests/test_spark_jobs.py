"""Analytics jobs checked against values computed by hand, plus the CLI's error handling."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from spark_analytics import charts, cli, jobs
from tests.spark_helpers import LogWriter, Rec, mqtt_rec

T0 = 1_767_225_600_000  # 2026-01-01T00:00:00Z
MIN = 60_000


def ts(ms: int) -> pd.Timestamp:
    return pd.Timestamp(T0 + ms, unit="ms", tz="UTC")


def _traffic(data: Path) -> LogWriter:
    """d1: 5 msgs in minute 0 and 3 in minute 1; d2: 2 in minute 0; d3 via Kafka: 1 in minute 1."""
    w = LogWriter(data, {"sensors": 2})
    d1 = [0, 5, 10, 20, 40, 61, 70, 119]
    for i, t in enumerate(d1):
        body = json.dumps({"temp": 20 + i, "ts": T0 + t * 1000}).encode()
        w.append("sensors", 0, [mqtt_rec("sensors/d1/t", body, "d1", 1, T0 + t * 1000)])
    for t in (3, 30):
        w.append("sensors", 1, [mqtt_rec("sensors/d2/t", b"x" * 100, "d2", 0, T0 + t * 1000)])
    w.append("sensors", 1, [Rec(b"sensors/d3/t", b"12345", T0 + 90_000)])
    return w


def test_rates_and_top_talkers(spark, tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    _traffic(data)
    quiet = lambda _m: None  # noqa: E731
    r = jobs.message_rates(spark, data, out, window="1 minute", progress=quiet)
    got = {(x.device, x.window_start): (x.messages, x.bytes) for x in r.table.itertuples()}
    d1_sizes = [len(json.dumps({"temp": 20 + i, "ts": 0})) + 12 for i in range(8)]  # 13-digit ts
    assert got == {
        ("d1", ts(0)): (5, sum(d1_sizes[:5])),
        ("d1", ts(MIN)): (3, sum(d1_sizes[5:])),
        ("d2", ts(0)): (2, 200),
        ("sensors/d3/t", ts(MIN)): (1, 5),
    }
    assert r.table.loc[r.table.device == "d1", "msgs_per_s"].tolist() == [5 / 60, 3 / 60]
    assert r.chart.stat().st_size > 1000 and r.chart.read_bytes()[:4] == b"\x89PNG"
    assert len(pd.read_parquet(r.parquet)) == 4

    late = jobs.message_rates(spark, data, out, since_ms=T0 + 60_000, progress=quiet)
    assert sorted(late.table.messages) == [1, 3]

    top = jobs.top_talkers(spark, data, out, n=2, by="bytes", progress=quiet)
    assert top.table.device.tolist() == ["d1", "d2"]
    assert top.table.bytes.tolist() == [sum(d1_sizes), 200]
    top = jobs.top_talkers(spark, data, out, n=5, progress=quiet)
    assert top.table.messages.tolist() == [8, 2, 1]
    assert top.table.iloc[0].first_seen == ts(0) and top.table.iloc[0].last_seen == ts(119_000)
    assert (out / "top_talkers.png").exists()


def test_rates_chart_plots_the_parquet_numbers(spark, tmp_path: Path) -> None:
    """Ten devices d0..d9 send i+1 msg/s from 00:45 to 01:00 and again 03:00 to 03:05 (broker
    time), 1-minute windows. The Parquet scales both partial windows to the seconds they cover
    (d9: ~10 msg/s, not 150/60 = 2.5), and the chart draws exactly those numbers.

    rates.png, looked at: "Message rate per device (1 minute windows)"; x axis 00:00..00:03 of
    2026-01-01 labelled in minutes (not years); nine lines, d9 on top at ~10 down to d2 at ~3 and
    "other (2 devices, average)" (d0, d1) at 1.5, each with hollow markers at 00:00 and 00:03 (both windows
    partial, noted under the axis) and no line across the silent 00:01-00:02 gap; legend outside
    the plot on the right.
    """
    data, out = tmp_path / "data", tmp_path / "out"
    w = LogWriter(data, {"sensors": 1})
    for i in range(10):
        recs = []
        for start_s, secs in ((45, 15), (180, 5)):
            for k in range(secs * (i + 1)):
                at = T0 + int((start_s + k / (i + 1)) * 1000)
                recs.append(mqtt_rec(f"sensors/d{i}/t", b"{}", f"d{i}", 0, at))
        w.append("sensors", 0, sorted(recs, key=lambda r: r.timestamp))
    r = jobs.message_rates(spark, data, out, progress=lambda _m: None)
    pq_rates = pd.read_parquet(r.parquet)
    d9 = pq_rates[pq_rates.device == "d9"].set_index("window_start")
    assert d9.messages.tolist() == [150, 50] and d9.partial.all()
    assert (d9.loc[ts(0), "covered_s"], d9.loc[ts(0), "msgs_per_s"]) == (15.0, 10.0)
    assert 5 < d9.loc[ts(3 * MIN), "covered_s"] < 5.2
    plotted = charts.rates_series(pq_rates)
    assert list(plotted) == [f"d{i}" for i in range(9, 1, -1)] + ["other (2 devices, average)"]
    for dev in [f"d{i}" for i in range(2, 10)]:
        s = plotted[dev]["msgs_per_s"]
        assert s.index.tolist() == [ts(m * MIN) for m in range(4)]
        assert s.isna().tolist() == [False, True, True, False]  # the gap breaks the line
        want = pq_rates[pq_rates.device == dev].set_index("window_start").msgs_per_s
        assert s.dropna().tolist() == pytest.approx(want.tolist())
    other = plotted["other (2 devices, average)"]["msgs_per_s"]
    low = pq_rates[(pq_rates.device.isin(["d0", "d1"])) & (pq_rates.window_start == ts(0))]
    assert other.iloc[0] == pytest.approx(low.msgs_per_s.mean())
    assert other.iloc[0] == pytest.approx(1.5)  # d0, d1: 15 and 30 messages in 15 s, per device
    assert r.chart.stat().st_size > 10_000


def test_device_from_topic_level_with_short_topics(spark, tmp_path: Path) -> None:
    """`--device-from topic:1` on records whose topic has no level 1: no crash
    (it was SparkArrayIndexOutOfBoundsException); such a record is its own device, by topic."""
    data, out = tmp_path / "data", tmp_path / "out"
    w = LogWriter(data, {"sensors": 1})
    w.append("sensors", 0, [mqtt_rec("sensors/d1/t", b"{}", "c1", 0, T0)])
    w.append("sensors", 0, [mqtt_rec("sensors/d1/h", b"{}", "c2", 0, T0 + 1)])
    w.append("sensors", 0, [Rec(b"sensors", b"{}", T0 + 2)])  # Kafka record keyed by the topic
    w.append("sensors", 0, [Rec(b"sensors/", b"{}", T0 + 3)])  # empty level 1
    top = jobs.top_talkers(spark, data, out, device_from="topic:1", progress=lambda _m: None)
    assert dict(zip(top.table.device, top.table.messages, strict=True)) == {
        "d1": 2,
        "sensors": 1,
        "sensors/": 1,
    }


def test_telemetry_watermark_drops_late_data(spark, tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    w = LogWriter(data, {"sensors": 1})

    def send(t_s: int, temp: float, hum: int | None = None) -> None:
        body = {"temp": temp, "ts": T0 + t_s * 1000, "label": "x", "ok": True}
        if hum is not None:
            body["hum"] = hum
        # Broker time is "now"; event time comes from the payload.
        w.append(
            "sensors", 0, [mqtt_rec("sensors/d1/t", json.dumps(body).encode(), "d1", 1, T0 + 10**6)]
        )

    for t_s, temp, hum in (
        (0, 10.0, 40),
        (10, 20.0, 50),
        (20, 30.0, None),
        (70, 5.0, None),
        (110, 7.0, None),
    ):
        send(t_s, temp, hum)
    kw = dict(window="1 minute", watermark="30 seconds", progress=lambda _m: None)
    r1 = jobs.telemetry(spark, data, out, **kw)
    t = r1.table.set_index(["field", "window_start"])
    assert t.loc[("temp", ts(0)), ["count", "avg", "min", "max"]].tolist() == [3, 20.0, 10.0, 30.0]
    assert t.loc[("temp", ts(MIN)), ["count", "avg", "min", "max"]].tolist() == [2, 6.0, 5.0, 7.0]
    assert t.loc[("hum", ts(0)), ["count", "avg"]].tolist() == [2, 45.0]
    assert set(r1.table.field) == {"temp", "hum"}  # strings, booleans and the time field are not
    # Watermark after run 1: max event time 110 s - 30 s = 80 s: the first window is final.
    assert t.loc[("temp", ts(0)), "closed"] and not t.loc[("temp", ts(MIN)), "closed"]

    send(5, 1000.0)  # 75 s behind the watermark: dropped
    send(100, 9.0)  # on time: joins the open window
    said: list[str] = []
    r2 = jobs.telemetry(spark, data, out, **{**kw, "progress": said.append})
    assert "streaming 2 new records (checkpoint" in said[0], said  # not all 7
    assert "read 2 new records" in said[-1] and r2.info["new_records"] == 2, said
    t = r2.table.set_index(["field", "window_start"])
    assert t.loc[("temp", ts(0)), ["count", "max"]].tolist() == [3, 30.0]
    assert t.loc[("temp", ts(MIN)), ["count", "avg", "min", "max"]].tolist() == [3, 7.0, 5.0, 9.0]
    assert r2.info["late_dropped"] == 1
    assert len(pd.read_parquet(r2.parquet)) == len(r2.table) == 3
    # The same log, fresh (docs/spark.md "Results depend on run history"): one micro-batch with no
    # watermark yet, so the late reading is kept in its window.
    r3 = jobs.telemetry(spark, data, out, **kw, fresh=True)
    t = r3.table.set_index(["field", "window_start"])
    assert r3.info["late_dropped"] == 0
    assert t.loc[("temp", ts(0)), ["count", "max"]].tolist() == [4, 1000.0]


def test_device_sessions(spark, tmp_path: Path) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    w = LogWriter(data, {"__lightgate_device_events": 1, "sensors": 1})
    events = [
        ("c1", "connect", 0, None, "10.0.0.1:5000"),
        ("c2", "connect", 10, None, "10.0.0.2:6000"),
        ("c2", "connect", 50, None, "10.0.0.2:6001"),  # no disconnect before: gateway restart
        ("c1", "disconnect", 60, "normal", "10.0.0.1:5000"),
        ("c2", "disconnect", 100, "keepalive timeout", "10.0.0.2:6001"),
        ("c1", "connect", 120, None, "10.0.0.1:5001"),
    ]
    for cid, ev, t, reason, remote in events:
        body = {
            "event": ev,
            "client_id": cid,
            "ts": T0 + t * 1000,
            "reason": reason,
            "remote": remote,
        }
        w.append("__lightgate_device_events", 0, [Rec(cid.encode(), json.dumps(body).encode(), T0)])
    r = jobs.device_sessions(spark, data, out, progress=lambda _m: None)

    def val(v: object) -> object:
        return None if pd.isna(v) else v

    got = [
        (x.client_id, x.state, x.start, val(x.end), val(x.reason), val(x.duration_s))
        for x in r.table.itertuples()
    ]
    nan = None
    assert got == [
        ("c1", "online", ts(0), ts(60_000), "normal", 60.0),
        ("c1", "offline", ts(60_000), ts(120_000), nan, 60.0),
        ("c1", "online", ts(120_000), None, nan, None),
        ("c2", "online", ts(10_000), ts(50_000), "unknown", 40.0),
        ("c2", "online", ts(50_000), ts(100_000), "keepalive timeout", 50.0),
        ("c2", "offline", ts(100_000), None, nan, None),
    ]
    assert r.table.remote.tolist()[0] == "10.0.0.1:5000"
    assert r.info == {"clients": 2, "online_now": 1}
    assert (out / "sessions.png").exists()


def test_cli_runs_a_job(spark, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, out = tmp_path / "data", tmp_path / "out"
    _traffic(data)
    argv = ["top-talkers", "--data-dir", str(data), "--out", str(out), "-n", "1"]
    assert cli.main(argv) == 0
    assert "top-talkers: 1 rows" in capsys.readouterr().out
    assert spark.range(1).count() == 1  # the shared session is still alive
    assert cli.main(["sessions", "--data-dir", str(data), "--out", str(out)]) == 3
    assert "__lightgate_device_events" in capsys.readouterr().err
    # A filter matched while reading finds nothing: the same exit code 3, and why.
    argv = ["rates", "--data-dir", str(data), "--out", str(out), "--filter", "+/nobody/#"]
    assert cli.main(argv) == 3
    assert "filter '+/nobody/#' matched none of the up to 11 records" in capsys.readouterr().err


def test_cli_all_one_session_one_bar_per_job(
    spark,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`all` runs every job in the one session and draws a bar per job (stderr as a terminal)."""
    data, out = tmp_path / "data", tmp_path / "out"
    _traffic(data)
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    monkeypatch.setenv("TTY_INTERACTIVE", "1")
    argv = ["all", "--data-dir", str(data), "--out", str(out), "-n", "2", "--window", "30 seconds"]
    assert cli.main(argv) == 0
    got = capsys.readouterr()
    err = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", got.err)  # rich's colours and cursor moves
    assert err.count("using the active Spark session") == 1
    assert "sessions skipped" in err
    for job, steps in (("rates", 3), ("telemetry", 3), ("top-talkers", 2)):
        assert re.search(rf"{job}\s+━+\s+{steps}/{steps}", err), (job, err)
    lines = [ln.split(":")[0] for ln in got.out.splitlines() if " rows -> " in ln]
    assert lines == ["rates", "telemetry", "top-talkers"]
    assert len(pd.read_parquet(out / "top_talkers")) == 2


def test_cli_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["rates", "--data-dir", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli.main(["rates", "--data-dir", str(tmp_path)]) == 2
    assert "no log/" in capsys.readouterr().err
    LogWriter(tmp_path, {"sensors": 2})
    assert cli.main(["rates", "--data-dir", str(tmp_path)]) == 3  # no records match: 3
    assert "no records" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # option errors: tests/test_spark_cli.py
        cli.main(["nope"])


def test_parse_since() -> None:
    assert jobs.parse_since("1700000000000") == 1_700_000_000_000
    assert jobs.parse_since("2026-01-01T00:00:00Z") == T0
    assert jobs.parse_since("-15m", now_ms=T0) == T0 - 15 * MIN
    assert jobs.parse_since("-2h", now_ms=T0) == T0 - 120 * MIN
    assert jobs.parse_since("-7d", now_ms=T0) == T0 - 7 * 24 * 60 * MIN
    with pytest.raises(jobs.AnalyticsError):
        jobs.parse_since("2026-01-01T00:00:00")
