"""ETAs: what a vLLM start should take by its kind (``starts``), and each step of an apply's plan (``steps``), from
what this engine measured before. Pure functions of recorded starts and steps: nothing here starts or stops."""

from __future__ import annotations

from engine.serving.eta.starts import (
    KINDS,
    PRIOR_RATIO,
    PRIOR_WARM_S,
    Company,
    Eta,
    PastStart,
    StartKind,
    cache_cold,
    cache_missed,
    estimate,
    host_load,
    past_start,
    past_wake,
    start_kind,
    start_view,
    with_cache,
)
from engine.serving.eta.steps import PRIOR_STEP_S, EtaTable, PastStep, past_steps

__all__ = [
    "KINDS",
    "PRIOR_RATIO",
    "PRIOR_STEP_S",
    "PRIOR_WARM_S",
    "Company",
    "Eta",
    "EtaTable",
    "PastStart",
    "PastStep",
    "StartKind",
    "cache_cold",
    "cache_missed",
    "estimate",
    "host_load",
    "past_start",
    "past_steps",
    "past_wake",
    "start_kind",
    "start_view",
    "with_cache",
]
