"""GPU health: NVML read through one wrapper, sampled on a thread, alerts with hysteresis, and history."""

from __future__ import annotations

from engine.gpu.alerts import ActiveAlert, AlertEngine, AlertThresholds
from engine.gpu.history import HOST, METRICS, TelemetryStore, rows_of
from engine.gpu.nvml import SLOWDOWN_REASONS, THROTTLE_REASONS, GpuLostError, GpuReader, GpuReading
from engine.gpu.sampler import Emit, Sampler, Snapshot, host_reading
from engine.gpu.views import balance, gpu_now, gpu_view

__all__ = [
    "HOST",
    "METRICS",
    "SLOWDOWN_REASONS",
    "THROTTLE_REASONS",
    "ActiveAlert",
    "AlertEngine",
    "AlertThresholds",
    "Emit",
    "GpuLostError",
    "GpuReader",
    "GpuReading",
    "Sampler",
    "Snapshot",
    "TelemetryStore",
    "balance",
    "gpu_now",
    "gpu_view",
    "host_reading",
    "rows_of",
]
