"""vLLM's serving figures (live and over time) and the request ledger's KPIs."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ServingOut(BaseModel):
    """Live figures from vLLM's /metrics (rates and quantiles since the previous scrape); ``available`` is false
    while vLLM is not ready."""

    model_config = ConfigDict(extra="allow")  # every series the history keeps, by name (engine/db/tables.py)

    available: bool
    error: str | None
    interval_s: float
    ts: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    kv_cache_usage: float | None = None
    generation_tokens_per_s: float | None = None
    prompt_tokens_per_s: float | None = None
    preemptions_per_s: float | None = None
    ttft_seconds_p95: float | None = None
    itl_seconds_p95: float | None = None
    e2e_seconds_p95: float | None = None
    finished: dict[str, float] = Field(default_factory=dict)
    __pydantic_extra__: dict[str, float | None] = Field(init=False)


class Band(BaseModel):
    """A metric over the buckets of a window: each bucket's min, average and max."""

    min: list[float | None]
    avg: list[float | None]
    max: list[float | None]


class Series(BaseModel):
    """One key's series (a GPU, or a revision): bucket times, then a band per metric, by metric name."""

    model_config = ConfigDict(extra="allow")

    t: list[float]
    __pydantic_extra__: dict[str, Band] = Field(init=False)


class SeriesOut(BaseModel):
    window_s: float
    step_s: float
    source: str
    metrics: list[str]
    series: dict[str, Series]


class GpuHistoryOut(BaseModel):
    window_s: float
    step_s: float
    source: str
    metrics: list[str]
    devices: dict[str, Series] = Field(description="by GPU index; -1 is the host")


class KpiRow(BaseModel):
    revision: int | None
    window_s: float
    requests: int
    succeeded: int
    avg_input_tokens: float | None
    avg_output_tokens: float | None
    latency_p50_s: float | None
    latency_p95_s: float | None
    latency_p99_s: float | None
    ttft_p95_s: float | None
    output_tokens_per_s: float | None
    error_rate: float | None
    oom_failures: int
    oom_per_hour: float


class KpisOut(BaseModel):
    window_s: float
    revisions: list[KpiRow]
