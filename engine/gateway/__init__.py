"""The /v1 gateway: admission (the gate and its queue), the data path to vLLM, usage metering and the request
ledger."""

from __future__ import annotations

from engine.gateway.ledger import Ledger, Record, percentile
from engine.gateway.proxy import Admission, Gateway, GenerateRequest, Upstream
from engine.gateway.usage import USAGE_PATHS, RequestInfo, StreamMeter, usage_of

__all__ = [
    "USAGE_PATHS",
    "Admission",
    "Gateway",
    "GenerateRequest",
    "Ledger",
    "Record",
    "RequestInfo",
    "StreamMeter",
    "Upstream",
    "percentile",
    "usage_of",
]
