"""PNG charts for the analytics jobs (matplotlib, Agg backend: no display needed).

Inputs are the small pandas results the jobs already computed, so charts never touch Spark.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

MAX_SERIES = 8  # lines/bars beyond this make a chart unreadable; the Parquet has everything


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _empty(ax: plt.Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes)


def rates_chart(rates: pd.DataFrame, path: Path) -> Path:
    """Messages/s per device over time, the busiest devices only."""
    fig, ax = plt.subplots(figsize=(10, 4.5))
    if rates.empty:
        _empty(ax, "messages")
    else:
        top = rates.groupby("device")["messages"].sum().nlargest(MAX_SERIES).index
        for dev in top:
            d = rates[rates["device"] == dev].sort_values("window_start")
            ax.plot(d["window_start"], d["msgs_per_s"], marker=".", label=str(dev))
        ax.legend(fontsize="small", loc="upper left")
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
        fig.autofmt_xdate()
    ax.set(title="Message rate per device", ylabel="messages/s")
    return _save(fig, path)


def telemetry_chart(agg: pd.DataFrame, path: Path) -> Path:
    """Average of each numeric field over time, one panel per field (first few fields)."""
    fields = sorted(agg["field"].unique())[:4] if not agg.empty else []
    fig, axes = plt.subplots(max(1, len(fields)), 1, figsize=(10, 2.8 * max(1, len(fields))))
    axes = list(axes) if len(fields) > 1 else [axes]
    if not fields:
        _empty(axes[0], "numeric telemetry")
    for ax, field in zip(axes, fields, strict=False):
        d = agg[agg["field"] == field]
        devices = d.groupby("device")["count"].sum().nlargest(MAX_SERIES).index
        bands = len(devices) <= 3  # overlapping min..max bands of many devices are unreadable
        for dev in devices:
            s = d[d["device"] == dev].sort_values("window_start")
            ax.plot(s["window_start"], s["avg"], marker=".", label=str(dev))
            if bands:
                ax.fill_between(s["window_start"], s["min"], s["max"], alpha=0.12)
        title = f"{field}: avg (band = min..max)" if bands else f"{field}: avg"
        ax.set(title=f"{title} per window", ylabel=field)
        ax.legend(fontsize="x-small", loc="upper left")
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
    return _save(fig, path)


def sessions_chart(sessions: pd.DataFrame, path: Path) -> Path:
    """Online intervals per device as a timeline (green online, grey offline)."""
    devices = sorted(sessions["client_id"].unique())[:40] if not sessions.empty else []
    fig, ax = plt.subplots(figsize=(10, 1 + 0.35 * max(1, len(devices))))
    if not devices:
        _empty(ax, "device events")
    now = pd.Timestamp.now(tz="UTC")
    for i, dev in enumerate(devices):
        d = sessions[sessions["client_id"] == dev]
        for state, color in (("online", "tab:green"), ("offline", "lightgrey")):
            s = d[d["state"] == state]
            if s.empty:
                continue
            start = mdates.date2num(pd.to_datetime(s["start"], utc=True))
            end = mdates.date2num(pd.to_datetime(s["end"], utc=True).fillna(now))
            ax.broken_barh(list(zip(start, end - start, strict=True)), (i - 0.4, 0.8), color=color)
    ax.set_yticks(range(len(devices)), [str(d) for d in devices], fontsize="small")
    ax.xaxis_date()
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
    ax.set(title="Device sessions (green = online)")
    return _save(fig, path)


def top_talkers_chart(top: pd.DataFrame, path: Path, by: str) -> Path:
    """Horizontal bars, busiest device on top."""
    fig, ax = plt.subplots(figsize=(8, 1 + 0.35 * max(1, len(top))))
    if top.empty:
        _empty(ax, "messages")
    else:
        d = top.iloc[::-1]
        ax.barh([str(x) for x in d["device"]], d[by], color="tab:blue")
    ax.set(title=f"Top talkers by {by}", xlabel=by)
    return _save(fig, path)
