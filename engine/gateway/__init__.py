"""The /v1 gateway: admission (the open upstreams, the queue), the raw ASGI data path to vLLM, the routes it
forwards, usage metering and the request ledger; the worker processes that serve the data path across cores."""

from __future__ import annotations

from engine.gateway.admission import Admission, Upstream
from engine.gateway.coordinator import Coordinator
from engine.gateway.datapath import BodyLimits, DataPath
from engine.gateway.ledger import Ledger, Record, percentile
from engine.gateway.proxy import (
    USAGE_PATHS,
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
    "ROUTES",
    "USAGE_PATHS",
    "Admission",
    "BodyLimits",
    "Coordinator",
    "DataPath",
    "Emit",
    "Gateway",
    "GenerateRequest",
    "Ledger",
    "Record",
    "StreamMeter",
    "Upstream",
    "WorkerPool",
    "WorkerSpec",
    "WorkerState",
    "WorkersCollector",
    "check_path",
    "forward_query",
    "model_not_found",
    "percentile",
    "usage_of",
    "with_usage",
]
