"""Every table of the engine's database, in one place: which tables exist does not depend on what was imported.

Revisions are immutable apart from their status; the audit trail is append-only (triggers, in engine/db/database.py).
A change here needs a schema revision: ``llmops db revision -m "what changes"`` (docs/database.md).
The time-series tables (GPU telemetry by device, vLLM's serving figures by revision) keep raw rows for a short window
and per-minute min/avg/max for a long one; their columns are the metrics listed here.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Float, Index, Integer, String, Table, UniqueConstraint
from sqlmodel import Field, SQLModel
from sqlmodel.sql.sqltypes import AutoString

from engine.db.sql import PortableString, epoch_now


class RevisionStatus(StrEnum):
    PENDING = "pending"
    APPLIED = "applied"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"


ACTIVE = (RevisionStatus.PENDING.value, RevisionStatus.APPLIED.value)


# SQLite's AUTOINCREMENT: an id once given is never given again, though its row be deleted (without it, SQLite
# reuses the largest id; PostgreSQL's sequences never do). Migration 0006 rebuilt the tables so.
NEVER_REUSED: dict[str, Any] = {"sqlite_autoincrement": True}

DEFAULT_DEPLOYMENT = 1  # the deployment today's routes act on; a data dir of one model is all this deployment's


class Deployment(SQLModel, table=True):
    """A model served under one name (the ``model`` clients ask for), with its own revisions, instances and
    placement. Created by the API or the CLI; the engine supervises every enabled one."""

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    enabled: bool = Field(default=True, sa_column_kwargs={"server_default": "1"})
    gpus: list[int] | None = Field(default=None, sa_column=Column(JSON))  # placement: GPU indices; None = any
    created_at: float = Field(default_factory=time.time, sa_column_kwargs={"server_default": epoch_now()})
    created_by: str = Field(default="engine", sa_column_kwargs={"server_default": "engine"})
    note: str = Field(default="", sa_column_kwargs={"server_default": ""})
    # what 1,000 tokens cost on it (usage you can bill: GET /api/usage), prompt and completion; None: no price
    price_input_per_1k: float | None = None
    price_output_per_1k: float | None = None


class Revision(SQLModel, table=True):
    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(default=DEFAULT_DEPLOYMENT, index=True,
                               sa_column_kwargs={"server_default": str(DEFAULT_DEPLOYMENT)})
    values: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    author: str = Field(default="unknown", sa_column_kwargs={"server_default": "unknown"})
    note: str = Field(default="", sa_column_kwargs={"server_default": ""})
    created_at: float = Field(default_factory=time.time, sa_column_kwargs={"server_default": epoch_now()})
    parent_id: int | None = Field(default=None, foreign_key="revision.id")
    status: str = Field(default=RevisionStatus.PENDING.value, index=True,
                        sa_column_kwargs={"server_default": RevisionStatus.PENDING.value})
    status_reason: str = Field(default="", sa_column_kwargs={"server_default": ""})
    status_at: float | None = None
    forced: bool = Field(default=False, sa_column_kwargs={"server_default": "0"})
    warnings: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False,
                                                                                    server_default="[]"))


class Event(SQLModel, table=True):
    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=time.time, index=True)
    kind: str = Field(index=True)
    severity: str = "info"
    message: str = ""
    revision_id: int | None = None
    deployment_id: int | None = Field(default=None, index=True)  # None: the engine's own (GPUs, the engine)
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False, server_default="{}"))


class SavedPrompt(SQLModel, table=True):
    __tablename__ = "saved_prompt"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True)
    mode: str = "chat"  # chat | completion
    system: str = ""
    prompt: str = ""
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False, server_default="{}"))
    author: str = "unknown"
    created_at: float = Field(default_factory=time.time)


class User(SQLModel, table=True):
    __tablename__ = "user"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(index=True, unique=True)
    password_hash: str
    role: str = "viewer"
    disabled: bool = False
    failed_attempts: int = 0
    locked_until: float | None = None
    created_at: float = Field(default_factory=time.time)
    last_login: float | None = None
    team_id: int | None = Field(default=None, index=True)  # the team they belong to (they see its usage)


class Team(SQLModel, table=True):
    """A group of gateway keys and users: its limits hold for all its keys together, its weight is its share of a
    deployment at capacity (fair queues), and its usage is billed together."""

    __tablename__ = "team"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    weight: float = 1.0
    rate_limit_per_min: int | None = None
    tokens_per_minute: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    token_budget: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    budget_period: str | None = None  # day | month (UTC), with token_budget
    note: str = ""
    created_at: float = Field(default_factory=time.time)
    created_by: str = ""


class ApiToken(SQLModel, table=True):
    __tablename__ = "api_token"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    name: str
    digest: str = Field(index=True, unique=True)  # SHA-256 of the token; the token itself is never stored
    prefix: str  # its first characters, to tell tokens apart in lists
    role: str = "viewer"
    kind: str = "api"  # api (the engine's API) | gateway (an API key for /v1) | session (a console sign-in)
    user_id: int | None = None
    created_by: str = ""
    created_at: float = Field(default_factory=time.time)
    expires_at: float | None = None
    revoked_at: float | None = None
    last_used_at: float | None = None
    rate_limit_per_min: int | None = None
    # gateway keys: the deployments (by name) it may ask for; None: every deployment
    deployments: list[str] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    # gateway keys: its team, and limits on tokens (prompt + completion) besides requests
    team_id: int | None = Field(default=None, index=True)
    tokens_per_minute: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    token_budget: int | None = Field(default=None, sa_column=Column(BigInteger, nullable=True))
    budget_period: str | None = None  # day | month (UTC), with token_budget
    # its share of a deployment at capacity against other keys (a team's key: the team's)
    weight: float = Field(default=1.0, sa_column_kwargs={"server_default": "1"})


class AuditRecord(SQLModel, table=True):
    __tablename__ = "audit"

    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=time.time, index=True)
    actor: str = Field(default="anonymous", index=True)
    role: str = ""
    action: str = Field(index=True)
    target: str = ""
    before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    after: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    source: str = ""
    result: int = 0  # the HTTP status, or 0 for the engine's own actions
    detail: str = ""
    deployment: str | None = None  # the deployment acted on, by name (the audit outlives a deleted one)


class AuditTally(SQLModel, table=True):
    """Refused anonymous requests, counted per minute, source, action, target and result instead of one audit row
    each (an anonymous client could otherwise write rows as fast as it can send requests). Bounded: a minute holds
    at most a configured number of keys (the rest are counted under source "(others)"), and the oldest minutes are
    dropped past a total. Counts grow, so this table is not append-only; the audit trail is."""

    __tablename__ = "audit_tally"
    __table_args__ = (UniqueConstraint("minute", "source", "action", "target", "result", name="uq_audit_tally_key"),
                      {**NEVER_REUSED})

    id: int | None = Field(default=None, primary_key=True)
    minute: float = Field(index=True)  # Unix seconds of the minute's start
    source: str = ""
    action: str = ""
    target: str = ""
    result: int = 0
    count: int = 0
    last_ts: float = 0.0


class LoginFailure(SQLModel, table=True):
    """Failed sign-ins of names that are no user (or a disabled one), so that they lock out like a user's and stay
    locked across a restart: a name's answers never tell whether it is a user. Bounded (oldest dropped)."""

    __tablename__ = "login_failure"

    name: str = Field(primary_key=True)
    failures: int = 0
    locked_until: float = 0.0
    updated_at: float = Field(default_factory=time.time, index=True)


class CalibrationRow(SQLModel, table=True):
    __tablename__ = "calibration"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=time.time)
    host: str = Field(index=True)
    model: str = Field(index=True)
    revision_id: int | None = None
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enforce_eager: bool = False
    batched_tokens: int = 0
    max_num_seqs: int = 0
    weights: int = 0
    activation: int = 0
    activation_estimate: int = 0  # the capacity model's estimate for the same start, to learn its error
    non_torch: int = 0
    device_total: int | None = None
    kv_bytes: int = 0
    kv_tokens: int | None = None


class RequestLog(SQLModel, table=True):
    __tablename__ = "request_log"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(index=True)  # arrival at the gateway
    revision_id: int | None = Field(default=None, index=True)
    model: str = ""
    endpoint: str = ""
    stream: bool = False
    status: int = 0
    input_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    client: str = ""
    error: str | None = None
    prompt: str | None = None  # only when prompt sampling is on
    instance: str | None = None  # which vLLM instance answered (None: refused before reaching one)
    deployment_id: int | None = Field(default=None, index=True)  # the deployment the request's model named
    max_tokens: int | None = None  # the max_tokens the request asked for (None: it asked for none)
    key_id: int | None = None  # the gateway key (token id) that sent it (None: keys not required)
    team_id: int | None = None  # that key's team when it was sent


class AlertChannel(SQLModel, table=True):
    """Where alerts go: a webhook (Slack-compatible, or a generic JSON body). Its URL may hold a secret: the API
    shows its host only."""

    __tablename__ = "alert_channel"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    kind: str = "webhook"  # slack | webhook
    url: str
    enabled: bool = True
    created_at: float = Field(default_factory=time.time)
    created_by: str = ""


class AlertRule(SQLModel, table=True):
    """A condition watched (engine/notify/rules.py: its kind, a threshold where it has one, how long it must hold),
    on one deployment or every one, sent to some channels or every one."""

    __tablename__ = "alert_rule"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True, unique=True)
    kind: str
    threshold: float | None = None
    for_s: float = 60.0  # the condition holds this long before it fires, and is gone this long before it resolves
    deployment: str | None = None  # None: every deployment (or the engine's own: GPUs, budgets)
    channels: list[int] | None = Field(default=None, sa_column=Column(JSON, nullable=True))  # None: every one
    enabled: bool = True
    created_at: float = Field(default_factory=time.time)
    created_by: str = ""


class AlertFired(SQLModel, table=True):
    """An alert that fired (and when it resolved), and what each channel answered."""

    __tablename__ = "alert_fired"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    rule_id: int = Field(index=True)
    rule: str = ""
    kind: str = ""
    subject: str = ""  # what it is about: a deployment, GPU 0, team research, key 12…
    state: str = "firing"  # firing | resolved
    fired_at: float = Field(default_factory=time.time, index=True)
    resolved_at: float | None = None
    value: float | None = None
    message: str = ""
    deliveries: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False,
                                                                                    server_default="[]"))


class LoraAdapter(SQLModel, table=True):
    """A LoRA adapter registered under a deployment: a folder (PEFT layout) checked against its base model, served
    by every instance of the deployment as model ``name`` on /v1."""

    __tablename__ = "lora_adapter"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    deployment_id: int = Field(index=True)
    name: str = Field(index=True, unique=True)  # a model name on /v1: unique across deployments
    path: str  # the folder, resolved (inside the allowed model roots)
    rank: int
    alpha: float
    target_modules: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    base_model: str = ""  # what its adapter_config.json names as its base
    size_bytes: int = 0
    created_at: float = Field(default_factory=time.time)
    created_by: str = ""


class UsageDay(SQLModel, table=True):
    """Usage you can bill: requests and tokens per UTC day, key, team, deployment (0: none) and model, summed from the
    request ledger as it is written. Kept for ever (a row per day and key and deployment at most); budgets per day
    or month are read from it at start, so they survive restarts."""

    __tablename__ = "usage_day"
    __table_args__ = (UniqueConstraint("day", "key_id", "team_id", "deployment_id", "model", name="uq_usage_day"),)
    id: int | None = Field(default=None, primary_key=True)
    day: str = Field(index=True)  # YYYY-MM-DD, UTC
    key_id: int = 0
    team_id: int = 0
    deployment_id: int = 0
    model: str = Field(default="", sa_column=Column(String, nullable=False, server_default=""))  # as requests named
    # it: the deployment's served name, or one of its LoRA adapters
    requests: int = 0
    failed: int = 0  # answered 4xx/5xx or cut
    input_tokens: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    output_tokens: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))


class BenchmarkRun(SQLModel, table=True):
    __tablename__ = "benchmark_run"

    __table_args__ = {**NEVER_REUSED}
    id: int | None = Field(default=None, primary_key=True)
    kind: str = "sweep"  # sweep | search
    revision_id: int | None = Field(default=None, index=True)  # serving when the run started
    deployment_id: int = Field(default=DEFAULT_DEPLOYMENT, index=True,
                               sa_column_kwargs={"server_default": str(DEFAULT_DEPLOYMENT)})
    preset: str = "short_chat"
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    status: str = "running"  # running | done | failed | cancelled
    progress: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    results: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    proposal: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    error: str | None = None
    author: str = "api"
    started_at: float = Field(default_factory=time.time)
    finished_at: float | None = None


# --- time series ---------------------------------------------------------------------------------------------

TELEMETRY_METRICS: tuple[str, ...] = (
    "mem_used", "mem_total", "util_gpu", "util_mem", "power_w", "power_limit_w", "energy_j", "temp_c",
    "mem_temp_c", "sm_clock_mhz", "mem_clock_mhz", "fan_pct", "pcie_tx_kbs", "pcie_rx_kbs", "vllm_mem",
)
SERVING_FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")
SERVING_METRICS: tuple[str, ...] = (
    "requests_running", "requests_waiting", "kv_cache_usage", "preemptions_per_s", "prompt_tokens_per_s",
    "generation_tokens_per_s", "ttft_seconds_p50", "ttft_seconds_p95", "ttft_seconds_p99", "itl_seconds_p50",
    "itl_seconds_p95", "itl_seconds_p99", "e2e_seconds_p50", "e2e_seconds_p95", "e2e_seconds_p99",
    "queue_seconds_p95", *(f"finished_{r}_per_s" for r in SERVING_FINISH_REASONS),
)


def series_tables(name: str, key: str, metrics: tuple[str, ...], key_type: Any = Integer) -> tuple[Table, Table]:
    """A series' raw table (one row per sample and key) and its per-minute roll-up (min, avg, max per metric)."""
    raw = Table(f"{name}_raw", SQLModel.metadata, Column("ts", Float, nullable=False), Column(key, key_type),
                *(Column(m, Float) for m in metrics), Index(f"ix_{name}_raw_ts", "ts"))
    minute = Table(f"{name}_minute", SQLModel.metadata, Column("ts", Float, nullable=False), Column(key, key_type),
                   Column("n", Integer),
                   *(Column(f"{m}_{agg}", Float) for m in metrics for agg in ("min", "avg", "max")),
                   Index(f"ix_{name}_minute_ts", "ts"))
    return raw, minute


TELEMETRY_RAW, TELEMETRY_MINUTE = series_tables("telemetry", "device", TELEMETRY_METRICS)
SERVING_RAW, SERVING_MINUTE = series_tables("serving", "revision", SERVING_METRICS)
INSTANCE_METRICS: tuple[str, ...] = ("requests_per_s", "prefix_routed_share", "prefix_cache_hit_pct", "kv_cache_usage")
# each instance that serves, keyed "DEPLOYMENT_ID/INSTANCE" (an instance's name is its deployment's: a, b, r1…)
INSTANCE_RAW, INSTANCE_MINUTE = series_tables("instance", "instance", INSTANCE_METRICS, String(80))
# each deployment's replica count against its load (autoscaling), keyed by the deployment's id; written while it
# is scaled to zero too
SCALING_METRICS: tuple[str, ...] = ("replicas_serving", "replicas_wanted", "load")
SCALING_RAW, SCALING_MINUTE = series_tables("scaling", "deployment", SCALING_METRICS)


# --- the same values on both dialects (keep this last: it applies to every table above) ----------------------

INTEGER = Integer().with_variant(BigInteger(), "postgresql")
"""SQLite's INTEGER holds 64 bits, PostgreSQL's 32: there every integer column (ids, byte counts of a GPU's memory,
tokens) is a BIGINT, so that what one dialect stores the other does too."""

for _table in SQLModel.metadata.tables.values():
    for _column in _table.columns:
        if type(_column.type) is Integer:
            _column.type = INTEGER
        elif type(_column.type) in (String, AutoString):
            _column.type = PortableString()  # VARCHAR on both; a NUL is storable on PostgreSQL too
