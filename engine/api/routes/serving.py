"""Serving routes: live figures from vLLM's /metrics, their history per revision, and the request-ledger KPIs."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import Field

from engine.api.routes.gpu import step_of, window_of
from engine.errors import MAX_ID
from engine.gateway import Ledger
from engine.metrics import SeriesStore, ServingMonitor


def build_router(serving: ServingMonitor, history: SeriesStore, ledger: Ledger) -> APIRouter:
    router = APIRouter(tags=["serving"])

    @router.get("/api/serving")
    def serving_now() -> dict[str, Any]:
        """Live figures from vLLM's /metrics: requests running and waiting, KV-cache use, token rates, latency
        quantiles since the previous scrape. ``available: false`` while vLLM is not ready."""
        return {"available": serving.latest is not None, "error": serving.error, "interval_s": serving.interval_s,
                **(serving.latest or {})}

    @router.get("/api/serving/history")
    def serving_history(window: str = Query("1h"), step: str | None = Query(None),
                        revision: list[Annotated[int, Field(ge=1, le=MAX_ID)]] | None = Query(None),
                        metric: list[str] | None = Query(None)) -> dict[str, Any]:
        """Serving metrics over time, one series per revision that served (raw for an hour, per minute for 7 d)."""
        seconds = window_of(window, history.minute_retention_s)
        return history.history(seconds, step_of(step, seconds), revision, metric)

    @router.get("/api/kpis")
    def kpis(window: str = Query("1h", description="e.g. 15m, 1h, 7d"),
             revision: int | None = Query(None, ge=1, le=MAX_ID),
             client: str | None = Query(None, description="only requests of this client (X-LLMOps-Client)"),
             ) -> dict[str, Any]:
        """Per revision: requests, average input and output tokens, P50/P95/P99 latency, P95 time to first token,
        tokens/s, error rate and OOM rate, from the gateway's request ledger."""
        seconds = window_of(window, 400 * 86400)
        ledger.flush()
        return {"window_s": seconds, "revisions": ledger.kpis(seconds, revision, client=client)}

    return router
