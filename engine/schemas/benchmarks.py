"""Benchmark runs (sweeps and guided searches) as they cross the API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

Concurrency = Annotated[int, Field(ge=1, le=4096)]
SEED_DOC = ("the seed of vLLM's random prompts at every level, given on purpose to send the same prompts again (a "
            "test of the prefix cache); left out, each level draws fresh prompts from a new seed")
PresetName = Literal["short_chat", "rag", "summarize"]


class SweepRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    preset: PresetName = "short_chat"
    concurrency: list[Concurrency] = Field(default_factory=lambda: [1, 4, 16], min_length=1, max_length=12)
    num_prompts: int | None = Field(None, ge=1, le=100_000)
    seed: int | None = Field(None, ge=0, le=2**31 - 1, description=SEED_DOC)


class SearchRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    preset: PresetName = "short_chat"
    target_p95_s: float = Field(gt=0, le=3600, description="P95 end-to-end latency the result must meet")
    candidates: list[Concurrency] = Field(default_factory=lambda: [1, 4, 16, 64], min_length=1, max_length=10,
                                          description="max_num_seqs values to try")
    num_prompts: int | None = Field(None, ge=1, le=100_000)
    seed: int | None = Field(None, ge=0, le=2**31 - 1, description=SEED_DOC)


class Preset(BaseModel):
    title: str
    input_len: int
    output_len: int
    num_prompts: int


class BenchmarkLevel(BaseModel):
    """One level of a run: vLLM's benchmark figures (its names: ms for latencies) at one concurrency, or why the
    level did not run."""

    model_config = ConfigDict(extra="allow")

    concurrency: int | None = None
    max_num_seqs: int | None = None  # a guided search's candidate
    revision: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    completed: int | None = None
    failed: int | None = None
    duration: float | None = None
    request_throughput: float | None = None
    output_throughput: float | None = None
    total_token_throughput: float | None = None
    mean_ttft_ms: float | None = None
    p50_ttft_ms: float | None = None
    p95_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    p95_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    p50_itl_ms: float | None = None
    p95_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_e2el_ms: float | None = None
    p50_e2el_ms: float | None = None
    p95_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None
    total_input_tokens: int | None = None
    total_output_tokens: int | None = None
    energy_j: float | None = None
    tokens_per_joule: float | None = None
    seed: int | None = Field(None, description="the seed of vLLM's random prompts at this level (fresh per level)")
    prefix_cache_hit_pct: float | None = Field(
        None, description="share of the level's prompt tokens vLLM found in its prefix cache (its /metrics "
        "counters over the level; None: not exported, or prefix caching off)")
    prefix_cache_queries: int | None = Field(None, description="prompt tokens looked up in the prefix cache")
    warnings: list[str] = Field(default_factory=list, description="what makes the level's figures doubtful, "
                                "such as prompts served from the prefix cache")
    error: str | None = None


class BenchmarkProgress(BaseModel):
    model_config = ConfigDict(extra="allow")

    stage: str = ""
    done: int = 0  # levels (or candidates) done
    total: int = 0
    level_done: int | None = None  # requests of the level under way
    level_total: int | None = None


class Proposal(BaseModel):
    max_num_seqs: int
    output_throughput: float
    p95_e2e_s: float
    target_p95_s: float
    gain_over_max_num_seqs_1: float | None


class BenchmarkRunOut(BaseModel):
    id: int
    kind: str
    revision_id: int | None
    preset: str
    params: dict[str, JsonValue]
    status: str
    progress: BenchmarkProgress
    results: list[BenchmarkLevel]
    proposal: Proposal | None
    error: str | None
    author: str
    started_at: float
    finished_at: float | None


class CompareCell(BaseModel):
    a: float | None
    b: float | None
    change_pct: float | None


class CompareLevel(BaseModel):
    concurrency: int
    output_throughput: CompareCell
    p95_ttft_ms: CompareCell
    p95_itl_ms: CompareCell
    p95_e2el_ms: CompareCell
    tokens_per_joule: CompareCell


class CompareOut(BaseModel):
    a: BenchmarkRunOut
    b: BenchmarkRunOut
    levels: list[CompareLevel]
