"""GPU health as the API shows it: the latest sample per GPU (or the host, where there is no GPU), alerts, the
balance of an engine's GPUs, and the sampler's own cost."""

from __future__ import annotations

from pydantic import BaseModel, Field


class GpuProcess(BaseModel):
    pid: int
    used_memory: int | None
    ours: bool
    deployment: str | None = None  # the deployment whose vLLM it is (ours only)


class GpuView(BaseModel):
    index: int
    uuid: str
    name: str
    ts: float
    lost: bool
    error: str | None
    values: dict[str, float | None]
    unavailable: dict[str, str]
    throttle_reasons: list[str]
    ecc: dict[str, int | None]
    pages: dict[str, int | None]
    processes: list[GpuProcess]
    mem_pct: float | None
    vllm_mem_pct_of_used: float | None


class HostReading(BaseModel):
    cpu_pct: float
    cpu_count: int
    load_1m: float
    mem_total: float
    mem_used: float
    mem_available: float
    vllm_rss: float
    vllm_cpu_pct: float
    vllm_rss_by_deployment: dict[str, float] = Field(default_factory=dict, description="resident memory of each "
                                                     "deployment's vLLM processes (bytes)")


class AlertOut(BaseModel):
    alert: str
    gpu: int
    severity: str
    since: float
    message: str


class BalanceOut(BaseModel):
    scope: str
    gpus: list[int]
    mem_used_min: float
    mem_used_max: float
    mem_spread_bytes: float
    mem_spread_pct: float
    util_min: float
    util_max: float
    util_spread_pct: float


class SamplerStats(BaseModel):
    interval_s: float
    samples_per_s: float | None
    tick_cpu_ms: float | None
    cpu_pct_of_core: float | None


class GpuOut(BaseModel):
    available: bool
    reason: str | None
    driver: str | None
    ts: float
    gpus: list[GpuView]
    host: HostReading | None
    alerts: list[AlertOut]
    balance: BalanceOut | None
    sampler: SamplerStats
