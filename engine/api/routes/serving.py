"""Serving: live figures from vLLM's /metrics, their history per revision, and the request-ledger KPIs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from pydantic import Field

from engine.api.deps import (
    InstanceHistoryDep,
    RuntimeDep,
    ScalingHistoryDep,
    ServicesDep,
    ServingDep,
    ServingHistoryDep,
    access,
)
from engine.api.params import step_of, window_of
from engine.schemas import MAX_ID, KpiRow, KpisOut, SeriesOut, ServingOut

router = APIRouter(tags=["serving"])


@router.get("/api/serving", response_model=ServingOut, dependencies=access("viewer"))
def serving_now(serving: ServingDep) -> ServingOut:
    """Live figures from vLLM's /metrics: requests running and waiting, KV-cache use, token rates, latency
    quantiles since the previous scrape. ``available: false`` while vLLM is not ready."""
    return ServingOut.model_validate({"available": serving.latest is not None, "error": serving.error,
                                      "interval_s": serving.interval_s, **(serving.latest or {})})


@router.get("/api/serving/history", response_model=SeriesOut, dependencies=access("viewer"))
def serving_history(history: ServingHistoryDep, runtime: RuntimeDep, window: str = Query("1h", max_length=20),
                    step: str | None = Query(None, max_length=20),
                    revision: list[Annotated[int, Field(ge=1, le=MAX_ID)]] | None = Query(None, max_length=64),
                    metric: list[str] | None = Query(None, max_length=64)) -> SeriesOut:
    """Serving metrics over time, one series per revision of the deployment that served (raw for an hour, per
    minute for 7 d)."""
    seconds = window_of(window, history.minute_retention_s)
    own = [r.id for r in runtime.revisions.history(1000) if r.id is not None]
    keys = [r for r in revision if r in own] if revision else own
    return SeriesOut.model_validate(history.history(seconds, step_of(step, seconds), keys or [0], metric))


@router.get("/api/serving/instances/history", response_model=SeriesOut, dependencies=access("viewer"))
def instance_history(history: InstanceHistoryDep, runtime: RuntimeDep, window: str = Query("1h", max_length=20),
                     step: str | None = Query(None, max_length=20),
                     metric: list[str] | None = Query(None, max_length=64)) -> SeriesOut:
    """Each instance of the deployment over time, one series per instance name (a, b, r1…): requests routed to
    it a second, the share of them routed by prefix, vLLM's prefix-cache hit rate (%) and KV-cache use (raw for
    an hour, per minute for 7 d)."""
    seconds = window_of(window, history.minute_retention_s)
    prefix = f"{runtime.ref.id}/"
    out = history.history(seconds, step_of(step, seconds), metrics=metric, key_prefix=prefix)
    out["series"] = {key.removeprefix(prefix): series for key, series in out["series"].items()}
    return SeriesOut.model_validate(out)


@router.get("/api/serving/scaling/history", response_model=SeriesOut, dependencies=access("viewer"))
def scaling_history(history: ScalingHistoryDep, runtime: RuntimeDep, window: str = Query("1h", max_length=20),
                    step: str | None = Query(None, max_length=20),
                    metric: list[str] | None = Query(None, max_length=64)) -> SeriesOut:
    """The deployment's replicas (serving, and wanted by autoscaling: 0 when scaled to zero) against its load
    (requests in flight and waiting, 5 s mean) over time, one series keyed by its id (raw for an hour, per minute
    for 7 d); recorded while it is scaled to zero too."""
    seconds = window_of(window, history.minute_retention_s)
    return SeriesOut.model_validate(history.history(seconds, step_of(step, seconds), [runtime.ref.id], metric))


@router.get("/api/kpis", response_model=KpisOut, dependencies=access("viewer"))
def kpis(svc: ServicesDep, runtime: RuntimeDep,
         window: str = Query("1h", max_length=20, description="e.g. 15m, 1h, 7d"),
         revision: int | None = Query(None, ge=1, le=MAX_ID),
         client: str | None = Query(None, max_length=200, description="only requests of this client "
                                    "(X-LLMOps-Client)")) -> KpisOut:
    """Per revision: requests, average input and output tokens, P50/P95/P99 latency, P95 time to first token,
    tokens/s, error rate and OOM rate, from the gateway's request ledger."""
    seconds = window_of(window, 400 * 86400)
    svc.ledger.flush_for_read()
    return KpisOut(window_s=seconds, revisions=[KpiRow.model_validate(r) for r in svc.ledger.kpis(
        seconds, revision, client=client, deployment_id=runtime.ref.id)])
