"""Serving metrics: vLLM's /metrics scraped into time series, and the engine's own Prometheus export."""

from __future__ import annotations

from engine.metrics.exporter import (
    GPU_GAUGES,
    LATENCY_BUCKETS,
    SERVING_GAUGES,
    BudgetCollector,
    EngineCollector,
    LoopLag,
    RequestMetrics,
    render,
)
from engine.metrics.series import MAX_POINTS, SeriesStore
from engine.metrics.vllm import (
    HISTORY_METRICS,
    NAMES,
    CacheUse,
    Histogram,
    Scrape,
    ServingMonitor,
    cache_use,
    derive,
    parse,
)

__all__ = [
    "GPU_GAUGES",
    "HISTORY_METRICS",
    "LATENCY_BUCKETS",
    "MAX_POINTS",
    "NAMES",
    "SERVING_GAUGES",
    "BudgetCollector",
    "CacheUse",
    "EngineCollector",
    "Histogram",
    "LoopLag",
    "RequestMetrics",
    "Scrape",
    "SeriesStore",
    "ServingMonitor",
    "cache_use",
    "derive",
    "parse",
    "render",
]
