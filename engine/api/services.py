"""The services container: every part of the engine, built once by the composition root (engine/app.py) and
reached by routes through typed dependencies (engine/api/deps.py), which tests may override."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from engine.access import AuditLog, AuditTallies, Auth, RateLimiter
from engine.benchmarks import Benchmarks
from engine.capacity import Planner
from engine.config import AppConfig
from engine.db import Database
from engine.events import EventLog
from engine.gateway import Gateway, Ledger
from engine.gpu import AlertEngine, Sampler, TelemetryStore
from engine.metrics import SeriesStore, ServingMonitor
from engine.prompts import PromptStore
from engine.revisions import RevisionStore, SettingsWriter
from engine.serving import Supervisor


@dataclass
class Services:
    config: AppConfig
    db: Database
    revisions: RevisionStore
    writer: SettingsWriter
    events: EventLog
    prompts: PromptStore
    auth: Auth
    audit: AuditLog
    tallies: AuditTallies
    limits: RateLimiter
    supervisor: Supervisor
    planner: Planner
    sampler: Sampler
    telemetry: TelemetryStore
    alerts: AlertEngine
    serving: ServingMonitor
    serving_history: SeriesStore
    ledger: Ledger
    benchmarks: Benchmarks
    gateway: Gateway
    registry: CollectorRegistry
    public_url: str  # the engine's address as clients reach it
    gateway_keys: bool  # /v1 needs an API key
