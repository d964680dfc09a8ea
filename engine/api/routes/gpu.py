"""GPU health: the latest sample, its history, alerts and the balance of a tensor-parallel engine."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field

from engine.api.deps import AlertsDep, SamplerDep, TelemetryDep, access
from engine.api.params import step_of, window_of
from engine.gpu import gpu_now
from engine.schemas import GpuHistoryOut, GpuOut

router = APIRouter(tags=["gpu"])
GpuIndex = Annotated[int, Field(ge=-1, le=1023)]  # -1 is the host; bounded so SQLite never sees an overflow


@router.get("/api/gpu", response_model=GpuOut, dependencies=access("viewer"))
def gpu(sampler: SamplerDep, alerts: AlertsDep) -> GpuOut:
    """Latest GPU sample, or ``available: false`` with NVML's reason and the host where vLLM runs."""
    return gpu_now(sampler, alerts)


@router.get("/api/gpu/history", response_model=GpuHistoryOut, dependencies=access("viewer"))
def gpu_history(history: TelemetryDep, window: str = Query("1h", max_length=20, description="e.g. 300, 5m, 1h, 7d"),
                step: str | None = Query(None, max_length=20, description="bucket size; at most ~1,000 points"),
                device: list[GpuIndex] | None = Query(None, max_length=64, description="GPU index; -1 is the host"),
                metric: list[str] | None = Query(None, max_length=64)) -> GpuHistoryOut:
    window_s = window_of(window, history.minute_retention_s)
    return GpuHistoryOut.model_validate(history.history(window_s, step_of(step, window_s), device, metric))
