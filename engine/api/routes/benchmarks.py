"""Benchmark routes: run a sweep or a guided search, follow it, list and compare runs per revision."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from engine.api.routes.access import actor
from engine.benchmarks import PRESETS, BenchmarkBusyError, BenchmarkRun, Benchmarks
from engine.errors import MAX_ID

Concurrency = Annotated[int, Field(ge=1, le=4096)]


class SweepRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    preset: Literal["short_chat", "rag", "summarize"] = "short_chat"
    concurrency: list[Concurrency] = Field(default_factory=lambda: [1, 4, 16], min_length=1, max_length=12)
    num_prompts: int | None = Field(None, ge=1, le=100_000)


class SearchRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    preset: Literal["short_chat", "rag", "summarize"] = "short_chat"
    target_p95_s: float = Field(gt=0, le=3600, description="P95 end-to-end latency the result must meet")
    candidates: list[Concurrency] = Field(default_factory=lambda: [1, 4, 16, 64], min_length=1, max_length=10,
                                          description="max_num_seqs values to try")
    num_prompts: int | None = Field(None, ge=1, le=100_000)


def _out(run: BenchmarkRun) -> dict[str, Any]:
    return run.model_dump()


def build_router(benchmarks: Benchmarks) -> APIRouter:
    router = APIRouter(tags=["benchmarks"])

    def start(kind: str, preset: str, params: dict[str, Any], request: Request) -> dict[str, Any]:
        try:
            return _out(benchmarks.start(kind, preset, params, actor(request)))
        except BenchmarkBusyError as exc:
            raise HTTPException(409, detail=str(exc)) from None

    @router.get("/api/benchmarks/presets")
    def presets() -> dict[str, Any]:
        return PRESETS

    @router.post("/api/benchmarks", status_code=202)
    async def sweep(body: SweepRequest, request: Request) -> dict[str, Any]:
        """Run vLLM's serving benchmark on the running revision at each concurrency."""
        return start("sweep", body.preset, {"concurrency": body.concurrency, "num_prompts": body.num_prompts},
                     request)

    @router.post("/api/benchmarks/search", status_code=202)
    async def search(body: SearchRequest, request: Request) -> dict[str, Any]:
        """Guided search for max_num_seqs: applies each candidate (restarts vLLM), benchmarks it, restores the
        original settings and proposes the best value that meets the P95 target."""
        return start("search", body.preset, {"target_p95_s": body.target_p95_s, "candidates": body.candidates,
                                             "num_prompts": body.num_prompts}, request)

    @router.get("/api/benchmarks")
    def runs(revision: int | None = Query(None, ge=1, le=MAX_ID),
             limit: int = Query(50, ge=1, le=500)) -> list[dict[str, Any]]:
        return [_out(r) for r in benchmarks.list(revision, limit)]

    @router.get("/api/benchmarks/compare")
    def compare(a: int = Query(ge=1, le=MAX_ID), b: int = Query(ge=1, le=MAX_ID)) -> dict[str, Any]:
        """Two runs level by level (same concurrency): throughput, TTFT, inter-token latency, P95 latency."""
        ra, rb = benchmarks.get(a), benchmarks.get(b)
        if ra is None or rb is None:
            raise HTTPException(404, detail=f"no benchmark {a if ra is None else b}")
        levels = {r["concurrency"]: r for r in rb.results if "concurrency" in r}
        rows = []
        for la in ra.results:
            lb = levels.get(la.get("concurrency"))
            if lb is None:
                continue
            row: dict[str, Any] = {"concurrency": la["concurrency"]}
            for key in ("output_throughput", "p95_ttft_ms", "p95_itl_ms", "p95_e2el_ms", "tokens_per_joule"):
                va, vb = la.get(key), lb.get(key)
                row[key] = {"a": va, "b": vb, "change_pct": round(100 * (vb - va) / va, 1) if va and vb else None}
            rows.append(row)
        return {"a": _out(ra), "b": _out(rb), "levels": rows}

    @router.get("/api/benchmarks/{run_id}")
    def run(run_id: int = PathParam(ge=1, le=MAX_ID)) -> dict[str, Any]:
        found = benchmarks.get(run_id)
        if found is None:
            raise HTTPException(404, detail=f"no benchmark {run_id}")
        return _out(found)

    @router.post("/api/benchmarks/{run_id}/cancel")
    async def cancel(run_id: int = PathParam(ge=1, le=MAX_ID)) -> dict[str, Any]:
        """Stop a run: it winds down in the background (a search restores the settings it started from).
        Async: the run's task is cancelled from the event loop it runs on."""
        if not benchmarks.cancel(run_id):
            raise HTTPException(409, detail=f"benchmark {run_id} is not running")
        found = benchmarks.get(run_id)
        return _out(found) if found else {}

    return router
