"""GPU health routes: the latest sample, its history, alerts and the balance of a tensor-parallel engine."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query
from pydantic import Field

from engine.gpu import AlertEngine, GpuReading, Sampler, TelemetryStore

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
GpuIndex = Annotated[int, Field(ge=-1, le=1023)]  # -1 is the host; bounded so SQLite never sees an overflow


def parse_duration(text: str, field: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise HTTPException(422, detail=[{"loc": ["query", field], "type": "value_error",
                                          "msg": f"{text!r} is not a duration such as 300, 5m, 1h or 7d"}])
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def window_of(text: str, limit_s: float) -> float:
    """The window asked for, in seconds, which must lie within (0, limit_s] (the history kept)."""
    seconds = parse_duration(text, "window")
    if seconds <= 0 or seconds > limit_s:
        raise HTTPException(422, detail=[{"loc": ["query", "window"], "type": "value_error",
                                          "msg": f"window must be within (0, {limit_s:.0f}] s"}])
    return seconds


def step_of(text: str | None, window_s: float) -> float | None:
    """The bucket size asked for, which must lie within (0, window]; None lets the store pick one."""
    if not text:
        return None
    step_s = parse_duration(text, "step")
    if step_s <= 0 or step_s > window_s:
        raise HTTPException(422, detail=[{"loc": ["query", "step"], "type": "value_error",
                                          "msg": f"step must be within (0, {window_s:.0f}] s, the window"}])
    return step_s


def gpu_view(g: GpuReading) -> dict[str, Any]:
    out = g.as_dict()
    used, total, vllm = g.values.get("mem_used"), g.values.get("mem_total"), g.values.get("vllm_mem")
    out["mem_pct"] = None if used is None or not total else round(100 * used / total, 2)
    out["vllm_mem_pct_of_used"] = None if vllm is None or not used else round(100 * vllm / used, 2)
    return out


def balance(gpus: list[GpuReading]) -> dict[str, Any] | None:
    """Spread of memory and utilisation across the GPUs of our engine (else all GPUs), when there are several."""
    live = [g for g in gpus if not g.lost and g.values.get("mem_used") is not None]
    ours = [g for g in live if any(p["ours"] for p in g.processes)]
    group, scope = (ours, "engine") if len(ours) >= 2 else (live, "all")
    if len(group) < 2:
        return None
    mem = [float(g.values["mem_used"] or 0) for g in group]
    util = [float(g.values.get("util_gpu") or 0) for g in group]
    mean_mem = sum(mem) / len(mem)
    return {
        "scope": scope, "gpus": [g.index for g in group],
        "mem_used_min": min(mem), "mem_used_max": max(mem), "mem_spread_bytes": max(mem) - min(mem),
        "mem_spread_pct": round(100 * (max(mem) - min(mem)) / mean_mem, 2) if mean_mem else 0.0,
        "util_min": min(util), "util_max": max(util), "util_spread_pct": max(util) - min(util),
    }


def build_router(sampler: Sampler, history: TelemetryStore, alerts: AlertEngine) -> APIRouter:
    router = APIRouter(tags=["gpu"])

    @router.get("/api/gpu")
    def gpu() -> dict[str, Any]:
        """Latest GPU sample, or ``available: false`` with NVML's reason and the host where vLLM runs."""
        snap = sampler.latest
        return {
            "available": snap.available, "reason": snap.reason, "driver": snap.driver, "ts": snap.ts,
            "gpus": [gpu_view(g) for g in snap.gpus], "host": snap.host, "alerts": alerts.snapshot(),
            "balance": balance(snap.gpus), "sampler": sampler.stats(),
        }

    @router.get("/api/gpu/history")
    def gpu_history(window: str = Query("1h", description="e.g. 300, 5m, 1h, 7d"),
                    step: str | None = Query(None, description="bucket size; at most ~1,000 points per series"),
                    device: list[GpuIndex] | None = Query(None, description="GPU index; -1 is the host"),
                    metric: list[str] | None = Query(None)) -> dict[str, Any]:
        window_s = window_of(window, history.minute_retention_s)
        return history.history(window_s, step_of(step, window_s), device, metric)

    return router
