"""Benchmarks: vLLM's own serving benchmark against the gateway, sweeps and the guided search, per revision."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi import Path as PathParam

from engine.api.deps import BenchmarksDep, NoteDep, access, actor
from engine.benchmarks import PRESETS
from engine.db import BenchmarkRun
from engine.schemas import (
    MAX_ID,
    BenchmarkRunOut,
    CompareCell,
    CompareLevel,
    CompareOut,
    Preset,
    SearchRequest,
    SweepRequest,
)

router = APIRouter(tags=["benchmarks"])


def run_out(run: BenchmarkRun) -> BenchmarkRunOut:
    return BenchmarkRunOut.model_validate(run.model_dump())


@router.get("/api/benchmarks/presets", response_model=dict[str, Preset], dependencies=access("viewer"))
def presets() -> dict[str, Preset]:
    return {name: Preset.model_validate(p) for name, p in PRESETS.items()}


@router.post("/api/benchmarks", status_code=202, response_model=BenchmarkRunOut,
             dependencies=access("operator", "benchmarks.sweep"))
async def sweep(body: SweepRequest, request: Request, benchmarks: BenchmarksDep, note: NoteDep) -> BenchmarkRunOut:
    """Run vLLM's serving benchmark on the running revision at each concurrency."""
    run = await benchmarks.start("sweep", body.preset, {"concurrency": body.concurrency,
                                                       "num_prompts": body.num_prompts, "seed": body.seed},
                                 actor(request))
    note.target, note.after = f"benchmark {run.id}", {"preset": body.preset, "concurrency": body.concurrency}
    return run_out(run)


@router.post("/api/benchmarks/search", status_code=202, response_model=BenchmarkRunOut,
             dependencies=access("operator", "benchmarks.search"))
async def search(body: SearchRequest, request: Request, benchmarks: BenchmarksDep,
                 note: NoteDep) -> BenchmarkRunOut:
    """Guided search for max_num_seqs: applies each candidate (restarts vLLM), benchmarks it, restores the
    original settings and proposes the best value that meets the P95 target."""
    run = await benchmarks.start("search", body.preset, {"target_p95_s": body.target_p95_s,
                                                        "candidates": body.candidates,
                                                        "num_prompts": body.num_prompts, "seed": body.seed},
                                 actor(request))
    note.target, note.after = f"benchmark {run.id}", {"preset": body.preset, "candidates": body.candidates,
                                                      "target_p95_s": body.target_p95_s}
    return run_out(run)


@router.get("/api/benchmarks", response_model=list[BenchmarkRunOut], dependencies=access("viewer"))
def runs(benchmarks: BenchmarksDep, revision: int | None = Query(None, ge=1, le=MAX_ID),
         limit: int = Query(50, ge=1, le=500)) -> list[BenchmarkRunOut]:
    return [run_out(r) for r in benchmarks.list(revision, limit)]


@router.get("/api/benchmarks/compare", response_model=CompareOut, dependencies=access("viewer"))
def compare(benchmarks: BenchmarksDep, a: int = Query(ge=1, le=MAX_ID), b: int = Query(ge=1, le=MAX_ID)
            ) -> CompareOut:
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
        cells = {}
        for key in ("output_throughput", "p95_ttft_ms", "p95_itl_ms", "p95_e2el_ms", "tokens_per_joule"):
            va, vb = la.get(key), lb.get(key)
            cells[key] = CompareCell(a=va, b=vb, change_pct=round(100 * (vb - va) / va, 1) if va and vb else None)
        rows.append(CompareLevel(concurrency=la["concurrency"], **cells))
    return CompareOut(a=run_out(ra), b=run_out(rb), levels=rows)


@router.get("/api/benchmarks/{run_id}", response_model=BenchmarkRunOut, dependencies=access("viewer"))
def run(benchmarks: BenchmarksDep, run_id: int = PathParam(ge=1, le=MAX_ID)) -> BenchmarkRunOut:
    found = benchmarks.get(run_id)
    if found is None:
        raise HTTPException(404, detail=f"no benchmark {run_id}")
    return run_out(found)


@router.post("/api/benchmarks/{run_id}/cancel", response_model=BenchmarkRunOut,
             dependencies=access("operator", "benchmarks.cancel"))
async def cancel(benchmarks: BenchmarksDep, note: NoteDep, run_id: int = PathParam(ge=1, le=MAX_ID)
                 ) -> BenchmarkRunOut:
    """Stop a run: it winds down in the background (a search restores the settings it started from).
    Async: the run's task is cancelled from the event loop it runs on."""
    note.target = f"benchmark {run_id}"
    found = await benchmarks.cancel(run_id)
    if found is None:
        raise HTTPException(409, detail=f"benchmark {run_id} is not running")
    return run_out(found)
