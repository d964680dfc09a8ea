"""Plotly figures of the console: telemetry time series and the memory budget of a revision."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from console.fmt import GIB
from engine.schemas import (
    Band,
    BenchmarkLevel,
    CompareLevel,
    EventOut,
    GpuHistoryOut,
    Prediction,
    Series,
    SeriesOut,
    UsageOut,
)

METRIC_LABELS: dict[str, tuple[str, str, float]] = {  # metric → (title, unit, scale)
    "mem_used": ("Memory used", "GiB", 1 / GIB),
    "vllm_mem": ("vLLM memory", "GiB", 1 / GIB),
    "util_gpu": ("Utilization", "%", 1.0),
    "power_w": ("Power", "W", 1.0),
    "temp_c": ("Temperature", "°C", 1.0),
    "sm_clock_mhz": ("SM clock", "MHz", 1.0),
}


def bands(series: Series) -> dict[str, Band]:
    """A series' bands by metric name (they are its fields beyond ``t``)."""
    return dict(series.__pydantic_extra__ or {})


def _layout(fig: go.Figure, title: str, unit: str, height: int = 260) -> go.Figure:
    fig.update_layout(title={"text": title, "font": {"size": 14}}, height=height,
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, yaxis_title=unit, hovermode="x unified",
                      legend={"orientation": "h", "y": -0.32})
    return fig


PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880")


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def timeseries(history: GpuHistoryOut, metric: str, names: dict[str, str] | None = None,
               marks: list[tuple[datetime, str, str]] | None = None) -> go.Figure:
    """One line per device (the average per bucket) in a band from its min to its max (when a bucket holds more
    than one sample), with event markers; "no data yet" when the window holds nothing."""
    title, unit, scale = METRIC_LABELS.get(metric, (metric, "", 1.0))
    fig = go.Figure()
    for i, (device, series) in enumerate(sorted(history.devices.items(), key=lambda kv: int(kv[0]))):
        band = bands(series).get(metric)
        if band is None:
            continue
        t = [datetime.fromtimestamp(x, UTC) for x in series.t]
        label = (names or {}).get(device, "host" if device == "-1" else f"GPU {device}")
        avg = [None if y is None else y * scale for y in band.avg]
        if not any(y is not None for y in avg):
            continue
        color = PALETTE[i % len(PALETTE)]
        if history.step_s > 1:
            hi = [None if y is None else y * scale for y in band.max]
            lo = [None if y is None else y * scale for y in band.min]
            fig.add_trace(go.Scatter(x=t, y=hi, mode="lines", line={"width": 0, "color": color}, showlegend=False,
                                     name=f"{label} max", hoverinfo="skip"))
            fig.add_trace(go.Scatter(x=t, y=lo, mode="lines", line={"width": 0, "color": color}, fill="tonexty",
                                     fillcolor=_rgba(color, 0.22), name=f"{label} min-max", hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=t, y=avg, mode="lines", name=f"{label} avg" if history.step_s > 1
                                 else label, line={"color": color}))
    fig = empty_note(_layout(fig, title, unit))
    return with_markers(fig, marks or []) if fig.data else fig


MARKER_KINDS = {"settings_changed": ("settings", "#1f77b4"), "ready": ("restart", "#2ca02c"),
                "rollback": ("rollback", "#d62728"), "crash_loop": ("crash loop", "#d62728"),
                "failed": ("failure", "#ff7f0e"), "alert_raised": ("alert", "#9467bd")}


def markers(events: list[EventOut], since: float) -> list[tuple[datetime, str, str]]:
    """Events worth a line on a time chart (settings changes, restarts, rollbacks, failures, alerts) since
    ``since`` (Unix seconds): (when, label, colour)."""
    out = []
    for e in events:
        if e.kind in MARKER_KINDS and e.ts.timestamp() >= since:
            name, color = MARKER_KINDS[e.kind]
            out.append((e.ts, name + (f" {e.revision}" if e.revision and e.kind != "alert_raised" else ""), color))
    return out


def with_markers(fig: go.Figure, marks: list[tuple[datetime, str, str]]) -> go.Figure:
    """Dotted vertical lines at each marker, labelled at the top of the chart, named on hover."""
    for when, label, color in marks:
        fig.add_vline(x=when, line_dash="dot", line_width=1, line_color=color, opacity=0.7)
        fig.add_trace(go.Scatter(x=[when], y=[1], yaxis="y2", mode="markers", marker={"size": 7, "color": color,
                                 "symbol": "triangle-down"}, name=label, showlegend=False,
                                 hovertemplate=f"{label}<br>%{{x}}<extra></extra>"))
    if marks:
        fig.update_layout(yaxis2={"overlaying": "y", "range": [0, 1.05], "visible": False, "fixedrange": True})
    return fig


def empty_note(fig: go.Figure, text: str = "no data yet") -> go.Figure:
    """A chart without data says so, instead of drawing empty axes."""
    if not any(len(getattr(t, "x", None) or []) for t in fig.data if getattr(t, "yaxis", "y") != "y2"):
        fig.add_annotation(text=text, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5,
                           font={"size": 15, "color": "gray"})
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
    return fig


def by_revision(history: SeriesOut, metric: str, title: str, unit: str, scale: float = 1.0) -> go.Figure:
    """One line per settings revision (average per bucket) of a serving metric's history."""
    return _lines(history, metric, title, unit, scale, "revision",
                  lambda key: int(key) if key != "None" else -1)


def _lines(history: SeriesOut, metric: str, title: str, unit: str, scale: float, label: str,
           order: Callable[[str], Any] = str) -> go.Figure:
    """One line per key of ``history`` (average per bucket), named "``label`` key", in ``order``."""
    fig = go.Figure()
    for key, series in sorted(history.series.items(), key=lambda kv: order(kv[0])):
        band = bands(series).get(metric)
        y = [None if v is None else v * scale for v in band.avg] if band else []
        if any(v is not None for v in y):
            t = [datetime.fromtimestamp(x, UTC) for x in series.t]
            fig.add_trace(go.Scatter(x=t, y=y, mode="lines+markers", marker={"size": 4}, name=f"{label} {key}"))
    return empty_note(_layout(fig, title, unit, height=240))


def by_instance(history: SeriesOut, metric: str, title: str, unit: str, scale: float = 1.0) -> go.Figure:
    """One line per instance (average per bucket) of an instance's history."""
    return _lines(history, metric, title, unit, scale, "instance")


def scaling(history: SeriesOut) -> go.Figure:
    """A deployment's replicas (serving, and wanted by autoscaling: 0 when scaled to zero) against its load."""
    fig = go.Figure()
    for series in history.series.values():
        b = bands(series)
        t = [datetime.fromtimestamp(x, UTC) for x in series.t]
        for metric, name, line in (("load", "load (in flight and waiting)", {"width": 1}),
                                   ("replicas_wanted", "replicas wanted", {"shape": "hv", "dash": "dot"}),
                                   ("replicas_serving", "replicas serving", {"shape": "hv", "width": 3})):
            if metric in b:
                fig.add_trace(go.Scatter(x=t, y=b[metric].avg if metric == "load" else b[metric].max, name=name,
                                         mode="lines", line=line))
    return empty_note(_layout(fig, "Replicas against load", "", height=260))


def compare_bars(levels: list[CompareLevel], key: str, title: str, names: tuple[str, str]) -> go.Figure:
    """Two benchmark runs side by side at each concurrency level they share."""
    fig = go.Figure()
    x = [str(lv.concurrency) for lv in levels]
    for side, name in zip(("a", "b"), names, strict=True):
        fig.add_trace(go.Bar(x=x, y=[getattr(getattr(lv, key), side) for lv in levels], name=name))
    fig.update_layout(barmode="group", xaxis_title="concurrency")
    return _layout(fig, title, "")


def sweep_throughput(levels: list[BenchmarkLevel]) -> go.Figure:
    """A sweep's output tokens/s against the number of concurrent clients."""
    rows = sorted((lv for lv in levels if lv.output_throughput), key=lambda lv: lv.concurrency or 0)
    fig = go.Figure(go.Scatter(x=[lv.concurrency for lv in rows], y=[lv.output_throughput for lv in rows],
                               mode="lines+markers", name="output tokens/s"))
    fig.update_layout(xaxis_title="concurrent clients", xaxis_type="log")
    return _layout(fig, "Throughput against concurrency", "output tokens/s")


def sweep_latency(levels: list[BenchmarkLevel]) -> go.Figure:
    """A sweep's latency percentiles (end-to-end P50/P95/P99, TTFT P95) against concurrency, in seconds."""
    rows = sorted((lv for lv in levels if lv.p50_e2el_ms), key=lambda lv: lv.concurrency or 0)
    fig = go.Figure()
    for key, name in (("p50_e2el_ms", "P50"), ("p95_e2el_ms", "P95"), ("p99_e2el_ms", "P99"),
                      ("p95_ttft_ms", "TTFT P95")):
        fig.add_trace(go.Scatter(x=[lv.concurrency for lv in rows],
                                 y=[(getattr(lv, key) or 0) / 1000 for lv in rows], mode="lines+markers", name=name,
                                 line={"dash": "dot"} if key.endswith("ttft_ms") else {}))
    fig.update_layout(xaxis_title="concurrent clients", xaxis_type="log")
    return _layout(fig, "Latency percentiles against concurrency", "s")


def memory_budget(prediction: Prediction, device_total: float | None) -> go.Figure:
    """A stacked bar of the memory budget: weights, activation, runtime (non-torch), KV cache, headroom."""
    parts: list[tuple[str, float]] = [
        ("Weights", prediction.weight_bytes), ("Activation", prediction.activation_bytes),
        ("Runtime", prediction.non_torch_bytes), ("KV cache", max(0, prediction.kv_bytes))]
    if prediction.device == "cuda" and device_total:
        parts.append(("Outside the budget", max(0.0, device_total - prediction.budget_bytes)))
    fig = go.Figure()
    for name, value in parts:
        if value <= 0:
            continue
        fig.add_trace(go.Bar(y=["memory"], x=[value / GIB], name=name, orientation="h",
                             text=f"{name} {value / GIB:.2f} GiB", textposition="inside",
                             hovertemplate=f"{name}: %{{x:.2f}} GiB<extra></extra>"))
    fig.update_layout(barmode="stack", height=150, margin={"l": 10, "r": 10, "t": 10, "b": 10},
                      xaxis_title="GiB", yaxis={"visible": False}, legend={"orientation": "h", "y": -0.6})
    return fig


def usage_by_day(usage: UsageOut) -> go.Figure:
    """Prompt and completion tokens per day, stacked (``usage`` grouped by day)."""
    days = [r.group for r in usage.rows]
    fig = go.Figure([go.Bar(x=days, y=[r.input_tokens for r in usage.rows], name="prompt tokens"),
                     go.Bar(x=days, y=[r.output_tokens for r in usage.rows], name="completion tokens")])
    fig.update_layout(barmode="stack", xaxis_type="category")
    if not days:
        empty_note(fig, "no requests in this window")
    return _layout(fig, "Tokens per day (UTC)", "tokens")


def usage_shares(usage: UsageOut, top: int = 12) -> go.Figure:
    """Each group's tokens, largest first (the rest as one bar)."""
    rows = usage.rows[:top]
    rest = usage.rows[top:]
    names = [r.group for r in rows] + ([f"{len(rest)} others"] if rest else [])
    values = [r.input_tokens + r.output_tokens for r in rows] + (
        [sum(r.input_tokens + r.output_tokens for r in rest)] if rest else [])
    fig = go.Figure(go.Bar(x=values, y=names, orientation="h", name="tokens"))
    fig.update_layout(yaxis={"autorange": "reversed", "type": "category"})
    if not names:
        empty_note(fig, "no requests in this window")
    return _layout(fig, f"Tokens by {usage.group_by}", "", height=max(220, 40 + 26 * len(names)))
