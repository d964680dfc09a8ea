"""The /v1 gateway: admission (the open upstreams, the queue), the raw ASGI data path to vLLM, the routes it
forwards, usage metering and the request ledger; the worker processes that serve the data path across cores."""

from __future__ import annotations

from engine.gateway.admission import Admission, Upstream
from engine.gateway.coordinator import Coordinator
from engine.gateway.datapath import BodyLimits, DataPath
from engine.gateway.ledger import Ledger, Record, day_of, percentile
from engine.gateway.limits import (
    PERIODS,
    Grant,
    KeyLimits,
    LimitExceededError,
    LimitsUnavailableError,
    Policy,
    period_bounds,
)
from engine.gateway.proxy import (
    USAGE_PATHS,
    Claim,
    Gateway,
    GenerateRequest,
    StreamMeter,
    forward_query,
    model_not_found,
    usage_of,
    with_usage,
)
from engine.gateway.routes import ROUTES, check_path
from engine.gateway.wire import WorkerSpec
from engine.gateway.workers import Emit, WorkerPool, WorkersCollector, WorkerState

__all__ = [
    "PERIODS",
    "ROUTES",
    "USAGE_PATHS",
    "Admission",
    "BodyLimits",
    "Claim",
    "Coordinator",
    "DataPath",
    "Emit",
    "Gateway",
    "GenerateRequest",
    "Grant",
    "KeyLimits",
    "Ledger",
    "LimitExceededError",
    "LimitsUnavailableError",
    "Policy",
    "Record",
    "StreamMeter",
    "Upstream",
    "WorkerPool",
    "WorkerSpec",
    "WorkerState",
    "WorkersCollector",
    "check_path",
    "day_of",
    "forward_query",
    "model_not_found",
    "percentile",
    "period_bounds",
    "usage_of",
    "with_usage",
]
