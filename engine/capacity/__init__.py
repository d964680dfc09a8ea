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
from engine.capacity.kv import KvGroup, KvLayout
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
    kv_layout,
    load_shape,
    model_card,
    predict,
    utilization_for,
    weight_bytes,
)
from engine.capacity.planner import Planner
from engine.capacity.plans import MARGIN_BYTES, cpu_need_bytes
from engine.capacity.preflight import (
    NEIGHBOUR_MARGIN_BYTES,
    SAFE_UTILIZATION,
    Cluster,
    Finding,
    Neighbour,
    PreflightResult,
    check,
    find_model_config,
)
from engine.capacity.shape import MODELLED, MlaDims, MoeDims, Unmodelled, parameter_breakdown, shape_from_config

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_BATCHED_TOKENS",
    "DTYPE_BYTES",
    "GIB",
    "MARGIN_BYTES",
    "MODELLED",
    "NEIGHBOUR_MARGIN_BYTES",
    "SAFE_UTILIZATION",
    "Calibration",
    "CalibrationStore",
    "Cluster",
    "Device",
    "Finding",
    "KvGroup",
    "KvLayout",
    "MlaDims",
    "ModelShape",
    "MoeDims",
    "Neighbour",
    "Planner",
    "Prediction",
    "PreflightResult",
    "StartReport",
    "Unmodelled",
    "batched_tokens",
    "check",
    "cpu_need_bytes",
    "dtype_bytes",
    "estimate_activation",
    "find_model_config",
    "kv_bytes_per_token",
    "kv_layout",
    "load_shape",
    "logged_batched_tokens",
    "model_card",
    "parameter_breakdown",
    "parse_start",
    "predict",
    "shape_from_config",
    "to_calibration",
    "utilization_for",
    "weight_bytes",
]
