"""The services container: every part of the engine, built once by the composition root (engine/app.py) and
reached by routes through typed dependencies (engine/api/deps.py), which tests may override."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from engine.access import AuditLog, AuditTallies, Auth, RateLimiter
from engine.capacity import Planner
from engine.config import AppConfig
from engine.db import Database
from engine.deployments import DeploymentStore, Fleet
from engine.events import EventLog
from engine.gateway import Gateway, KeyLimits, Ledger, WorkerPool
from engine.gpu import AlertEngine, Sampler, TelemetryStore
from engine.metrics import SeriesStore
from engine.notify import AlertStore, Notifier
from engine.prompts import PromptStore
from engine.schemas import Build


@dataclass
class Services:
    """The engine-wide parts; what is one deployment's (its controller, revisions, settings writer, events,
    gateway admission, serving figures, benchmarks) is its Runtime in ``fleet`` (engine/api/deps.py picks it)."""

    config: AppConfig
    db: Database
    events: EventLog  # the engine's own log; a deployment's is its runtime's
    prompts: PromptStore
    auth: Auth
    audit: AuditLog
    tallies: AuditTallies
    limits: RateLimiter
    fleet: Fleet
    deployments: DeploymentStore
    planner: Planner  # unscoped: the whole host
    sampler: Sampler
    telemetry: TelemetryStore
    alerts: AlertEngine
    serving_history: SeriesStore
    instance_history: SeriesStore  # each instance's requests, routing, prefix-cache hits and KV use over time
    scaling_history: SeriesStore  # each deployment's replicas against its load over time
    ledger: Ledger
    gateway: Gateway
    registry: CollectorRegistry
    public_url: str  # the engine's address as clients reach it
    gateway_keys: bool  # /v1 needs an API key
    build: Build
    vllm_version: str | None
    workers: WorkerPool | None = None  # the data path's worker processes (gateway_workers), if any
    key_limits: KeyLimits | None = None  # keys' and teams' token limits and budgets (the /v1 path's)
    alert_store: AlertStore | None = None  # alert channels, rules and what fired
    notifier: Notifier | None = None  # what watches the rules and sends to the channels
    data_url: str | None = None  # their address as clients reach it (the data port)
