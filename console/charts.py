"""Plotly figures of the console: telemetry time series and the memory budget of a revision."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import plotly.graph_objects as go

from console.fmt import GIB

METRIC_LABELS: dict[str, tuple[str, str, float]] = {  # metric → (title, unit, scale)
    "mem_used": ("Memory used", "GiB", 1 / GIB),
    "vllm_mem": ("vLLM memory", "GiB", 1 / GIB),
    "util_gpu": ("Utilization", "%", 1.0),
    "power_w": ("Power", "W", 1.0),
    "temp_c": ("Temperature", "°C", 1.0),
    "sm_clock_mhz": ("SM clock", "MHz", 1.0),
}


def _layout(fig: go.Figure, title: str, unit: str, height: int = 260) -> go.Figure:
    fig.update_layout(title={"text": title, "font": {"size": 14}}, height=height,
                      margin={"l": 10, "r": 10, "t": 40, "b": 10}, yaxis_title=unit, hovermode="x unified",
                      legend={"orientation": "h", "y": -0.2})
    return fig


def timeseries(history: dict[str, Any], metric: str, names: dict[str, str] | None = None) -> go.Figure:
    """One line per device (average per bucket) with a band from its min to its max."""
    title, unit, scale = METRIC_LABELS.get(metric, (metric, "", 1.0))
    fig = go.Figure()
    for device, series in sorted(history.get("devices", {}).items(), key=lambda kv: int(kv[0])):
        if metric not in series:
            continue
        t = [datetime.fromtimestamp(x, UTC) for x in series["t"]]
        label = (names or {}).get(device, "host" if device == "-1" else f"GPU {device}")
        avg = [None if y is None else y * scale for y in series[metric]["avg"]]
        if not any(y is not None for y in avg):
            continue
        if history.get("step_s", 1) > 1:
            hi = [None if y is None else y * scale for y in series[metric]["max"]]
            lo = [None if y is None else y * scale for y in series[metric]["min"]]
            fig.add_trace(go.Scatter(x=t, y=hi, mode="lines", line={"width": 0}, showlegend=False,
                                     hoverinfo="skip"))
            fig.add_trace(go.Scatter(x=t, y=lo, mode="lines", line={"width": 0}, fill="tonexty", opacity=0.2,
                                     showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=t, y=avg, mode="lines", name=label))
    return _layout(fig, title, unit)


def by_revision(history: dict[str, Any], metric: str, title: str, unit: str, scale: float = 1.0) -> go.Figure:
    """One line per settings revision (average per bucket) of a serving metric's history."""
    fig = go.Figure()
    for rev, series in sorted(history["series"].items(), key=lambda kv: int(kv[0]) if kv[0] != "None" else -1):
        y = [None if v is None else v * scale for v in series[metric]["avg"]]
        if any(v is not None for v in y):
            t = [datetime.fromtimestamp(x, UTC) for x in series["t"]]
            fig.add_trace(go.Scatter(x=t, y=y, mode="lines+markers", marker={"size": 4}, name=f"revision {rev}"))
    return _layout(fig, title, unit, height=240)


def compare_bars(levels: list[dict[str, Any]], key: str, title: str, names: tuple[str, str]) -> go.Figure:
    """Two benchmark runs side by side at each concurrency level they share."""
    fig = go.Figure()
    x = [str(lv["concurrency"]) for lv in levels]
    for side, name in zip(("a", "b"), names, strict=True):
        fig.add_trace(go.Bar(x=x, y=[lv[key][side] for lv in levels], name=name))
    fig.update_layout(barmode="group", xaxis_title="concurrency")
    return _layout(fig, title, "")


def memory_budget(prediction: dict[str, Any], device_total: float | None) -> go.Figure:
    """A stacked bar of the memory budget: weights, activation, runtime (non-torch), KV cache, headroom."""
    parts = [("Weights", prediction["weight_bytes"]), ("Activation", prediction["activation_bytes"]),
             ("Runtime", prediction["non_torch_bytes"]), ("KV cache", max(0, prediction["kv_bytes"]))]
    if prediction["device"] == "cuda" and device_total:
        parts.append(("Outside the budget", max(0.0, device_total - prediction["budget_bytes"])))
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
