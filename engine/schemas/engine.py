"""The engine and its vLLM child as the API shows them: status, the start in progress, events and logs, and how
clients reach the served model."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, JsonValue

from engine.schemas.common import Build, EngineState
from engine.schemas.settings import ApplyPlanOut, StartKindName, StepAction


class StartupPhase(BaseModel):
    name: str
    title: str
    started_s: float
    seconds: float
    done: bool


class StartupView(BaseModel):
    """A vLLM start phase by phase (read from its log), with the ETA from earlier starts and, once ready, its error."""

    revision: int | None = None
    elapsed_s: float
    phase: str
    phase_title: str
    phases: list[StartupPhase]
    eta_s: float | None = None
    eta_basis: str | None = None
    start_kind: StartKindName | None = Field(None, description="the kind of start its ETA is taken from")
    remaining_s: float | None = Field(None, description="seconds left by the ETA (None once it overruns)")
    overrun_s: float | None = Field(None, description="how far the start runs past its ETA (or the phase under "
                                    "way past its usual length), growing while it does")
    ready_s: float | None = None
    failed: str | None = None
    error_s: float | None = None
    error_pct: float | None = None


class GatewayCounts(BaseModel):
    in_flight: int
    waiting: int
    rejected: int
    routing: Literal["prefix", "least_outstanding"] = Field("prefix", description="how the gateway chooses among "
                                                            "the instances that serve (the revision's `routing`)")


InstanceRole = Literal["serving", "starting", "draining", "stopping", "bridge", "sleeping", "failed"]


class RoutingCounts(BaseModel):
    """How the gateway routed an instance's requests since it opened (engine/gateway/routing.py)."""

    prefix: int = Field(0, description="to it because it was sent the longest start of the prompt before")
    home: int = Field(0, description="a prompt seen nowhere, to its home by hashing")
    load: int = Field(0, description="by load alone: a short prompt, every instance over its share, or the policy "
                      "least_outstanding")
    matched_share: float | None = Field(None, description="share of the prompts' blocks routed to it that it had "
                                        "been sent before: the gateway's guess at its prefix-cache hit rate")
    kv_cache_usage: float | None = Field(None, description="its KV cache's use, 0-1, by vLLM's own metrics")
    prefix_cache_hit_pct: float | None = Field(None, description="vLLM's own prefix-cache hit rate (prompt "
                                               "tokens found in the cache) between its last two scrapes, %")


class InstanceOut(BaseModel):
    """One vLLM instance the engine supervises."""

    name: str
    role: InstanceRole
    revision: int | None
    port: int
    pid: int | None
    device: str | None = Field(None, description="CUDA_VISIBLE_DEVICES of the instance (None: all, or the CPU)")
    node: str | None = Field(None, description="the Ray node it runs on (None: the engine's own host)")
    address: str | None = Field(None, description="where the gateway reaches it")
    serving: bool = Field(description="the gateway sends requests to it")
    outstanding: int = 0
    since: datetime | None = None
    startup: StartupView | None = None
    routing: RoutingCounts | None = Field(None, description="how the gateway routed to it (while it serves)")


class StepTiming(BaseModel):
    """One step of an apply as it ran: what it took, beside what its plan expected."""

    action: StepAction
    instance: str
    seconds: float
    start_kind: StartKindName | None = None
    in_flight: int = Field(0, description="requests in flight through the gateway when it began")
    eta_s: float | None = Field(None, description="what the plan expected of this step (its n-th of this action)")


class ApplyProgress(BaseModel):
    """The apply under way (or the latest one): its plan and where it is."""

    revision: int
    from_revision: int | None
    plan: ApplyPlanOut
    step: str
    started: datetime
    finished: datetime | None = None
    outcome: Literal["running", "applied", "rejected", "aborted"] = "running"
    longest_gap_s: float | None = Field(None, description="longest stretch with no instance serving")
    timings: list[StepTiming] = Field(default_factory=list, description="each step as it ran, with its time")


class AutoscaleOut(BaseModel):
    """Where a deployment's replica count stands: what it wants, why, what holds it (engine/serving/autoscale.py)."""

    autoscaled: bool = Field(description="max_replicas is set: the count follows the load")
    min_replicas: int
    max_replicas: int
    target_in_flight: float = Field(description="requests in flight per replica it scales to")
    target_queue_wait_s: float | None = Field(
        None, description="set: it scales up on queue wait (the longest wait for a free slot) instead")
    queue_wait_s: float = Field(0.0, description="the longest wait for a free slot over the last 5 s (or now)")
    wanted: int = Field(description="replicas wanted now (0: scaled to zero)")
    serving: int = Field(description="replicas that serve now")
    load: float = Field(description="requests in flight and waiting, averaged over the last 5 s")
    asleep: bool = Field(description="scaled to zero: the next request wakes it")
    idle_s: float | None = Field(None, description="seconds since the last request")
    scale_to_zero_after_s: float | None = None
    wake: Literal["sleep", "cold_start"] | None = Field(
        None, description="how it comes back from zero: vLLM's sleep mode (about a second), or a cold start")
    cold_start_s: float | None = Field(None, description="what a cold start of its revision should take (ETA)")
    pending: str | None = Field(None, description="a change the load asks for, waiting out its delay")
    held: str | None = Field(None, description="why the count does not follow the load (at max_replicas, no room)")


class StatusOut(BaseModel):
    deployment: str = Field("demo", description="the deployment this is the status of")
    state: EngineState
    since: datetime | None
    reason: str
    running_revision: int | None
    desired_revision: int | None
    model: str | None
    pid: int | None
    vllm_version: str | None
    vllm_build: Build
    enabled: bool
    halted: str | None = None
    ready_since: datetime | None
    restarts: int
    gateway: GatewayCounts
    startup: StartupView | None = None
    instances: list[InstanceOut] = Field(default_factory=list)
    apply: ApplyProgress | None = None
    autoscale: AutoscaleOut | None = None


class ActionOut(StatusOut):
    accepted: str


class HealthOut(BaseModel):
    ok: bool


class ReadyOut(BaseModel):
    ready: bool
    state: EngineState
    reason: str


class ModelCard(BaseModel):
    architecture: str
    parameters: int
    context_length: int
    model_max_length: int
    dtype: str
    kv_bytes_per_token: int
    layers: int


class GatewayWorkerOut(BaseModel):
    """One of the processes that serve /v1 on the data port (gateway_workers)."""

    index: int
    pid: int | None = Field(description="its process now (None: between an exit and its next start)")
    alive: bool
    started_at: float | None = Field(description="when its process started, Unix time")
    restarts: int = Field(description="times it exited and was started again since the engine started")
    last_exit: int | None = Field(description="its last exit code (negative: the signal that ended it)")
    requests: int = Field(description="requests it was given a slot on an instance for, since its process started")
    in_flight: int = Field(description="its requests on an instance now")
    waiting: int = Field(description="its requests waiting for a key's check or a slot now")
    refused: int = Field(description="its requests refused by the engine (key, model, queue) since it started")
    accepting: bool = Field(True, description="it takes new connections now, as it last said (with "
                            "gateway_worker_busy_share, new connections go to as few workers as their load needs)")
    shedding: float = Field(0.0, description="the share of its responses after which it lets their connection go, "
                            "so that those clients reconnect to a worker with room (0: none)")
    cpu: float | None = Field(None, description="its share of a core lately, as it said (None: not said yet)")


class GatewayInfo(BaseModel):
    base_url: str
    keys_required: bool
    served_model: str | None
    model: ModelCard | None
    data_base_url: str | None = Field(None, description="the /v1 base URL of the gateway workers (the data port), "
                                      "where the relay runs on several cores; None: no workers (gateway_workers 0)")
    workers: list[GatewayWorkerOut] = Field(default_factory=list)


class EventOut(BaseModel):
    id: int
    ts: datetime
    kind: str
    severity: str
    message: str
    revision: int | None
    data: dict[str, JsonValue] = Field(description="what the event is about; its keys depend on its kind")
    deployment: str | None = Field(None, description="the deployment it is about (None: the engine itself)")


class LogsOut(BaseModel):
    lines: list[str]
    path: str
