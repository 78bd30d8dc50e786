"""PNG charts for the analytics jobs (matplotlib, Agg backend: no display needed).

Inputs are the small pandas results the jobs already computed, so charts never touch Spark. Each
chart is split in two: `*_series` computes exactly the numbers that are drawn (tests compare them
with the Parquet output) and `*_chart` draws them. Readable defaults, because a chart is read
before the table: the `TOP_N` busiest devices plus one "other" series, date axes that zoom to the
data (ConciseDateFormatter shows seconds when the windows are seconds), lines broken where a window
has no data, and partial windows drawn hollow.
"""

from __future__ import annotations

import re
from itertools import cycle
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

TOP_N = 8  # series beyond this are summed into "other"; the Parquet has every device
SESSION_ROWS = 25  # named clients on the sessions chart
AUTO_ID = re.compile(r"^lg-[0-9a-f]{16}$")  # ids the gateway assigns to clients that send none
STYLES = [(ls, mk) for mk in ("o", "s", "^", "D") for ls in ("-", "--", "-.", ":")]


def _save(fig: plt.Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _empty(ax: plt.Axes, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what}", ha="center", va="center", transform=ax.transAxes)


def _date_axis(ax: plt.Axes, lo: pd.Timestamp, hi: pd.Timestamp, pad: pd.Timedelta) -> None:
    """Zoom to the data (one point would otherwise autoscale to years) with concise labels."""
    locator = mdates.AutoDateLocator(minticks=3, maxticks=9)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set_xlim(lo - pad, hi + pad)
    ax.set_xlabel("window start (UTC)")


def _top(totals: pd.Series, n: int = TOP_N) -> tuple[list[str], list[str]]:
    """(top n devices by total, descending then by name; the rest)."""
    order = sorted(totals.items(), key=lambda kv: (-kv[1], str(kv[0])))
    names = [str(k) for k, _ in order]
    return names[:n], names[n:]


def _merge_equal(series: dict[str, pd.DataFrame], col: str) -> dict[str, pd.DataFrame]:
    """Series with identical values become one, labelled "a = b = c" (or "a = … = z, 8 equal"):
    drawn separately, the last would hide the others and the legend would list invisible lines."""
    groups: list[tuple[list[str], pd.DataFrame]] = []
    for label, s in series.items():
        for labels, k in groups:
            if np.allclose(k[col].to_numpy(float), s[col].to_numpy(float), equal_nan=True):
                labels.append(label)
                break
        else:
            groups.append(([label], s))
    out: dict[str, pd.DataFrame] = {}
    for labels, s in groups:
        name = " = ".join(labels) if len(labels) <= 3 else f"{labels[0]} = … = {labels[-1]}"
        out[name if len(labels) <= 3 else f"{name}, {len(labels)} equal"] = s
    return out


def rates_series(rates: pd.DataFrame, n: int = TOP_N) -> dict[str, pd.DataFrame]:
    """Per plotted series: window_start -> msgs_per_s and partial, on the full window grid.

    The top `n` devices by messages, then "other (K devices, average)": the others' messages per
    window over the same covered time, divided by K, so it reads on the same per-device scale. A
    window in which no device sent anything is NaN (the line breaks); a device silent in a window
    others used is 0.
    """
    if rates.empty:
        return {}
    r = rates.copy()
    r["device"] = r["device"].astype(str)
    top, rest = _top(r.groupby("device")["messages"].sum(), n)
    per_window = r.groupby("window_start").agg(
        covered_s=("covered_s", "first"), partial=("partial", "first")
    )
    step = (r["window_end"] - r["window_start"]).iloc[0]
    grid = pd.date_range(per_window.index.min(), per_window.index.max(), freq=step)
    grid_info = per_window.reindex(grid)
    out: dict[str, pd.DataFrame] = {}
    groups = [(d, [d]) for d in top]
    if rest:
        groups.append((f"other ({len(rest)} devices, average)", rest))
    for label, members in groups:
        msgs = r[r["device"].isin(members)].groupby("window_start")["messages"].sum()
        msgs = msgs.reindex(grid).fillna(0).where(grid_info["covered_s"].notna())
        out[label] = pd.DataFrame(
            {
                "msgs_per_s": msgs / grid_info["covered_s"] / len(members),
                "partial": grid_info["partial"].eq(True),
            },
            index=grid,
        )
    return _merge_equal(out, "msgs_per_s")


def rates_chart(rates: pd.DataFrame, path: Path) -> Path:
    """Messages/s per device over time: top devices plus "other", partial windows hollow."""
    fig, ax = plt.subplots(figsize=(10, 4.8))
    series = rates_series(rates)
    if not series:
        _empty(ax, "messages")
    else:
        for (label, s), (ls, mk) in zip(series.items(), cycle(STYLES), strict=False):
            (line,) = ax.plot(s.index, s["msgs_per_s"], linestyle=ls, label=label, alpha=0.85)
            full, part = s[~s["partial"]], s[s["partial"]]
            ax.plot(full.index, full["msgs_per_s"], mk, color=line.get_color(), ms=5)
            ax.plot(part.index, part["msgs_per_s"], mk, mfc="white", color=line.get_color(), ms=7)
        step = rates["window_end"].iloc[0] - rates["window_start"].iloc[0]
        _date_axis(ax, rates["window_start"].min(), rates["window_start"].max(), step / 2)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        if bool(rates["partial"].any()):
            ax.text(
                0, -0.22, "hollow marker = partial window: rate over the part the data covers",
                transform=ax.transAxes, fontsize="small", color="dimgray",
            )  # fmt: skip
    window = ""
    if not rates.empty:
        window = f" ({_span(rates['window_end'].iloc[0] - rates['window_start'].iloc[0])} windows)"
    ax.set(title=f"Message rate per device{window}", ylabel="messages/s")
    return _save(fig, path)


def _span(td: pd.Timedelta) -> str:
    s = int(td.total_seconds())
    for unit, n in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if s % n == 0:
            return f"{s // n} {unit}{'s' if s // n != 1 else ''}"
    return f"{s} s"


def telemetry_series(agg: pd.DataFrame, field: str, n: int = TOP_N) -> dict[str, pd.DataFrame]:
    """Per plotted series for one field: window_start -> avg, min, max, closed, on the grid.

    Top `n` devices by readings, then "other (K devices)": the count-weighted average of the
    others (min of mins, max of maxes). Windows without readings are NaN: the line breaks.
    """
    d = agg[agg["field"] == field].copy()
    if d.empty:
        return {}
    d["device"] = d["device"].astype(str)
    top, rest = _top(d.groupby("device")["count"].sum(), n)
    step = (d["window_end"] - d["window_start"]).iloc[0]
    grid = pd.date_range(d["window_start"].min(), d["window_start"].max(), freq=step)
    groups = [(x, [x]) for x in top]
    if rest:
        groups.append((f"other ({len(rest)} devices)", rest))
    out: dict[str, pd.DataFrame] = {}
    for label, members in groups:
        m = d[d["device"].isin(members)].assign(total=lambda x: x["avg"] * x["count"])
        g = m.groupby("window_start").agg(
            total=("total", "sum"),
            count=("count", "sum"),
            min=("min", "min"),
            max=("max", "max"),
            closed=("closed", "all"),
        )
        g["avg"] = g["total"] / g["count"]
        out[label] = g[["avg", "min", "max", "closed"]].reindex(grid)
    return _merge_equal(out, "avg")


def telemetry_chart(agg: pd.DataFrame, path: Path) -> Path:
    """Average of each numeric field over time, one panel per field (first few fields)."""
    fields = sorted(agg["field"].unique())[:4] if not agg.empty else []
    fig, axes = plt.subplots(
        max(1, len(fields)), 1, figsize=(10, 2.9 * max(1, len(fields))), squeeze=False
    )
    panels = list(axes[:, 0])
    if not fields:
        _empty(panels[0], "numeric telemetry")
    for ax, field in zip(panels, fields, strict=False):
        series = telemetry_series(agg, field)
        bands = len(series) <= 3  # overlapping min..max bands of many devices are unreadable
        for (label, s), (ls, mk) in zip(series.items(), cycle(STYLES), strict=False):
            (line,) = ax.plot(s.index, s["avg"], linestyle=ls, marker=mk, ms=3, label=label)
            if bands:
                ax.fill_between(s.index, s["min"], s["max"], alpha=0.12, color=line.get_color())
        title = f"{field}: avg (band = min..max)" if bands else f"{field}: avg"
        ax.set(title=f"{title} per window", ylabel=field)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1), borderaxespad=0)
        d = agg[agg["field"] == field]
        step = d["window_end"].iloc[0] - d["window_start"].iloc[0]
        _date_axis(ax, d["window_start"].min(), d["window_start"].max(), step / 2)
    return _save(fig, path)


def sessions_rows(sessions: pd.DataFrame, n: int = SESSION_ROWS) -> list[tuple[str, list[str]]]:
    """(row label, client ids) per chart row: named clients by first connect, then one row for
    all gateway-assigned `lg-...` ids and one for named clients beyond `n`."""
    if sessions.empty:
        return []
    ids = sessions.groupby("client_id")["start"].min().sort_values()
    named = [str(c) for c in ids.index if not AUTO_ID.match(str(c))]
    auto = [str(c) for c in ids.index if AUTO_ID.match(str(c))]
    rows = [(c, [c]) for c in named[:n]]
    if named[n:]:
        rows.append((f"{len(named) - n} more clients", named[n:]))
    if auto:
        rows.append((f"{len(auto)} auto-assigned ids (lg-…)", auto))
    return rows


def sessions_chart(sessions: pd.DataFrame, path: Path) -> Path:
    """Online intervals per client as a timeline (green online; grouped rows lighter)."""
    rows = sessions_rows(sessions)
    fig, ax = plt.subplots(figsize=(10, 1.4 + 0.32 * max(1, len(rows))))
    if not rows:
        _empty(ax, "device events")
    else:
        now = pd.Timestamp.now(tz="UTC")
        starts = pd.to_datetime(sessions["start"], utc=True)
        ends = pd.to_datetime(sessions["end"], utc=True)
        last = max(starts.max(), ends.max() if ends.notna().any() else starts.max())
        open_end = min(now, last + (last - starts.min()) * 0.05 + pd.Timedelta(seconds=1))
        for i, (_label, members) in enumerate(rows):
            d = sessions[sessions["client_id"].astype(str).isin(members)]
            online = d[d["state"] == "online"]
            s = mdates.date2num(pd.to_datetime(online["start"], utc=True))
            e = mdates.date2num(pd.to_datetime(online["end"], utc=True).fillna(open_end))
            color = "tab:green" if len(members) == 1 else "yellowgreen"
            ax.broken_barh(
                list(zip(s, np.maximum(e - s, 0), strict=True)), (i - 0.4, 0.8), color=color
            )
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize="small")
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.xaxis_date()
        _date_axis(ax, starts.min(), open_end, (open_end - starts.min()) * 0.02)
        ax.set_xlabel("time (UTC); bars still open run to the last event")
    ax.set(title="Device sessions (green = online)")
    return _save(fig, path)


def top_talkers_chart(
    top: pd.DataFrame, path: Path, by: str, other: tuple[int, int] | None = None
) -> Path:
    """Horizontal bars, busiest device on top; `other` = (devices, total) of the rest."""
    labels, values = top_talkers_series(top, by, other)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.35 * max(1, len(labels))))
    if not labels:
        _empty(ax, "messages")
    else:
        colors = ["tab:blue"] * len(top) + ["lightgray"] * (len(labels) - len(top))
        ax.barh(labels[::-1], values[::-1], color=colors[::-1])
        for y, v in enumerate(values[::-1]):
            ax.text(v, y, f" {v:,}", va="center", fontsize="small")
        ax.set_xlim(0, max(values) * 1.15)
    ax.set(title=f"Top talkers by {by}", xlabel=by)
    return _save(fig, path)


def top_talkers_series(
    top: pd.DataFrame, by: str, other: tuple[int, int] | None = None
) -> tuple[list[str], list[int]]:
    """Bar labels and values, busiest first; "other (K devices, total)" last when there are more."""
    labels = [str(x) for x in top["device"]] if not top.empty else []
    values = [int(v) for v in top[by]] if not top.empty else []
    if other and other[0] > 0:
        labels.append(f"other ({other[0]} devices, total)")
        values.append(int(other[1]))
    return labels, values
