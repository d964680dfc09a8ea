"""Capacity: the model of vLLM's memory, pre-flight, calibration from vLLM's start-up log, and the planner
that joins them to the live device."""

from __future__ import annotations

from engine.capacity.calibration import (
    CalibrationStore,
    StartReport,
    logged_batched_tokens,
    parse_start,
    to_calibration,
)
from engine.capacity.model import (
    BLOCK_SIZE,
    DEFAULT_BATCHED_TOKENS,
    DTYPE_BYTES,
    GIB,
    Calibration,
    Device,
    ModelShape,
    Prediction,
    batched_tokens,
    dtype_bytes,
    estimate_activation,
    kv_bytes_per_token,
    load_shape,
    model_card,
    predict,
    utilization_for,
    weight_bytes,
)
from engine.capacity.planner import Planner
from engine.capacity.preflight import (
    SAFE_UTILIZATION,
    TRAFFIC_WINDOW_S,
    Finding,
    PreflightResult,
    TrafficNeed,
    check,
    find_model_config,
    shortest_safe_len,
)

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_BATCHED_TOKENS",
    "DTYPE_BYTES",
    "GIB",
    "SAFE_UTILIZATION",
    "TRAFFIC_WINDOW_S",
    "Calibration",
    "CalibrationStore",
    "Device",
    "Finding",
    "ModelShape",
    "Planner",
    "Prediction",
    "PreflightResult",
    "StartReport",
    "TrafficNeed",
    "batched_tokens",
    "check",
    "dtype_bytes",
    "estimate_activation",
    "find_model_config",
    "kv_bytes_per_token",
    "load_shape",
    "logged_batched_tokens",
    "model_card",
    "parse_start",
    "predict",
    "shortest_safe_len",
    "to_calibration",
    "utilization_for",
    "weight_bytes",
]
