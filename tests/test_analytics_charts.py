"""What the analytics charts draw, checked without Spark on small tables shaped like the jobs'
Parquet output (the Spark-side check against real Parquet is in tests/test_spark_jobs.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from spark_analytics import charts

T0 = pd.Timestamp("2026-01-01T00:00:00Z")
S = pd.Timedelta(seconds=1)


def rates_table(per_device: dict[str, list[tuple[int, int]]], window_s: int) -> pd.DataFrame:
    """(window index, messages) per device -> rows like OUT/rates/, every window full."""
    rows = []
    for dev, wins in per_device.items():
        for w, n in wins:
            start = T0 + w * window_s * S
            rows.append((dev, start, start + window_s * S, n, n, n / window_s, window_s, False))
    cols = ["device", "window_start", "window_end", "messages", "bytes", "msgs_per_s"]
    return pd.DataFrame(rows, columns=[*cols, "covered_s", "partial"])


def test_rates_top_n_other_gaps_and_equal_series(tmp_path: Path) -> None:
    """Ten devices: the 8 busiest drawn, the 2 quietest averaged into "other"; window 2 has no
    traffic at all (NaN: the line breaks) while a device silent in a busy window is 0. Devices
    with identical rates are drawn as one series labelled "a = b" instead of hiding each other.
    """
    per = {f"d{i}": [(0, 10 * (i + 1)), (1, 10 * (i + 1)), (3, 5)] for i in range(10)}
    per["d0"] = [(0, 10), (3, 5)]  # silent in window 1 while others send
    t = rates_table(per, 60)
    s = charts.rates_series(t)
    assert list(s)[:8] == [f"d{i}" for i in range(9, 1, -1)]
    other = s["other (2 devices, average)"]  # per device, on the same scale as the others
    assert other["msgs_per_s"].tolist()[:2] == [(10 + 20) / 60 / 2, 20 / 60 / 2]
    assert np.isnan(other["msgs_per_s"].iloc[2]) and np.isnan(s["d9"]["msgs_per_s"].iloc[2])
    assert s["d9"]["msgs_per_s"].tolist()[:2] == [100 / 60, 100 / 60]
    assert charts.rates_chart(t, tmp_path / "r.png").stat().st_size > 5000

    same = charts.rates_series(rates_table({"a": [(0, 6)], "b": [(0, 6)], "c": [(0, 3)]}, 60))
    assert list(same) == ["a = b", "c"]
    many = charts.rates_series(rates_table({f"e{i}": [(0, 6)] for i in range(12)}, 60))
    assert list(many) == ["e0 = … = other (4 devices, average), 9 equal"]


def test_sessions_rows_group_auto_ids() -> None:
    rows = [("dev-1", "online", T0, T0 + 10 * S), ("dev-2", "online", T0 + S, None)]
    rows += [(f"lg-{i:016x}", "online", T0 + i * S, T0 + (i + 1) * S) for i in range(40)]
    df = pd.DataFrame(rows, columns=["client_id", "state", "start", "end"])
    got = charts.sessions_rows(df)
    assert [label for label, _ in got] == ["dev-1", "dev-2", "40 auto-assigned ids (lg-…)"]
    assert len(got[-1][1]) == 40


def test_top_talkers_other_bar_and_telemetry_other_average() -> None:
    top = pd.DataFrame({"device": ["a", "b"], "messages": [50, 30]})
    assert charts.top_talkers_series(top, "messages", (3, 12)) == (
        ["a", "b", "other (3 devices, total)"],
        [50, 30, 12],
    )
    rows = [
        (f"d{i}", "temp", T0, T0 + 60 * S, i + 1, float(i), float(i), float(i), True)
        for i in range(10)
    ]
    cols = ["device", "field", "window_start", "window_end", "count", "avg", "min", "max", "closed"]
    s = charts.telemetry_series(pd.DataFrame(rows, columns=cols), "temp")
    other = s["other (2 devices)"].iloc[0]  # d0 (1 reading of 0.0) and d1 (2 readings of 1.0)
    assert (other["avg"], other["min"], other["max"]) == (2 / 3, 0.0, 1.0)
