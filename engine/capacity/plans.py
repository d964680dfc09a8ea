"""How an apply keeps something serving while vLLM restarts: the plan, chosen from the capacity model and the
device's free memory now (the old instance still running), shown before the operator confirms, and recorded.

1. **rolling** when ≥ 2 replicas run: one replica at a time is drained and replaced; the others serve.
2. **blue/green** when the new instance fits beside the old one (a GPU: vLLM's start needs utilization × total
   free; the CPU build: its KV cache, weights and process overhead within the host's available memory).
3. **bridge** when a small instance of the old revision fits beside the old one and the new one fits beside the
   bridge: the largest such bridge that holds one max-length request; traffic moves old → bridge → new.
4. **pause** (drain, stop, start, hold requests in the queue) when nothing fits, with its predicted length.

Each plan is a list of steps with an ETA each (``step_etas``), from ``StepTimes``: a start by the earlier starts of
its kind (a blue/green start runs beside the old instance, a pause's alone, a bridge's beside the old one), a
handover, drain or stop by the earlier ones of this engine. ``expected_s`` is their sum:

- blue/green: start beside + handover + drain + stop;
- bridge: bridge start + handover + drain + stop, then the new start beside the bridge + handover + drain + stop;
- rolling: N x (drain + stop + start), a handover between one replica and the next;
- pause: drain + stop (or sleep) + start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from engine.capacity.model import GIB, Calibration, Device, ModelShape, predict, utilization_for
from engine.capacity.preflight import NEIGHBOUR_MARGIN_BYTES
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, BridgeOut, PlanKind, PlanStepOut, StartKindName, StepAction

MARGIN_BYTES = NEIGHBOUR_MARGIN_BYTES  # kept free beside two instances: allocator slack, CUDA context of the second
CPU_PROCESS_BYTES = int(1.5 * GIB)  # an idle vLLM CPU server beyond its KV cache and weights (API, engine core)
BRIDGE_MIN_UTILIZATION = 0.05


@dataclass(frozen=True)
class Running:
    """What serves now: the revision's settings, how many replicas, and the memory they hold (bytes, per GPU
    or on the host; None when unknown)."""

    settings: EngineSettings
    replicas: int
    memory_bytes: int | None


@dataclass(frozen=True)
class StepEta:
    """What one step should take (None: not known) and what that is taken from."""

    seconds: float | None
    basis: str
    start_kind: StartKindName | None = None


Company = Literal["alone", "beside", "bridge"]


class StepTimes(Protocol):
    """The ETAs of a plan's steps (the controller's, from its earlier starts and applies)."""

    def start(self, settings: EngineSettings, company: Company) -> StepEta:
        """A start of ``settings``: ``alone``, ``beside`` an instance that serves, or a ``bridge``."""
        ...

    def step(self, action: StepAction) -> StepEta:
        """A handover, drain, stop or sleep."""
        ...

    def note(self) -> str | None:
        """What may make these ETAs wrong now (a loaded host, priors)."""
        ...


@dataclass(frozen=True)
class StartEtasOnly:
    """StepTimes from one ETA for the new revision's start and one for a bridge's (what callers knew before steps
    had ETAs): other steps are not known."""

    new_s: float | None
    bridge_s: float | None

    def start(self, settings: EngineSettings, company: Company) -> StepEta:
        seconds = self.bridge_s if company == "bridge" else self.new_s
        return StepEta(seconds, "earlier starts of this engine" if seconds is not None else "no earlier start")

    def step(self, action: StepAction) -> StepEta:
        return StepEta(None, "not measured")

    def note(self) -> str | None:
        return None


@dataclass(frozen=True)
class Step:
    """A step of a plan before its ETA: what it does, its text, and for a start its settings and company."""

    action: StepAction
    text: str
    settings: EngineSettings | None = None
    company: Company = "alone"


@dataclass
class PlanInputs:
    new: EngineSettings
    running: Running | None
    device: Device | None  # free_bytes: free now, the running instances still holding theirs
    shape_old: ModelShape | None
    shape_new: ModelShape | None
    calibration: Calibration | None = None
    eta_new_s: float | None = None
    eta_bridge_s: float | None = None
    request_tokens: int | None = None  # what recent requests needed (p99 of prompt + output), if known
    warnings: list[str] = field(default_factory=list)
    times: StepTimes | None = None  # the steps' ETAs (None: from eta_new_s and eta_bridge_s alone)
    sleep: bool = False  # a pause puts the old instance to sleep (CUDA, sleep mode) instead of stopping it

    def step_times(self) -> StepTimes:
        return self.times if self.times is not None else StartEtasOnly(self.eta_new_s, self.eta_bridge_s)


def timed(inputs: PlanInputs, steps: Sequence[Step]) -> tuple[list[PlanStepOut], float | None]:
    """Each step with its ETA, and their sum (None when no start's ETA is known)."""
    times = inputs.step_times()
    out: list[PlanStepOut] = []
    for step in steps:
        eta = times.start(step.settings, step.company) if step.action == "start" and step.settings is not None \
            else times.step(step.action)
        out.append(PlanStepOut(action=step.action, text=step.text, start_kind=eta.start_kind,
                               eta_s=None if eta.seconds is None else round(eta.seconds, 1), basis=eta.basis))
    starts = [s.eta_s for s in out if s.action == "start"]
    if not starts or any(s is None for s in starts):
        return out, None
    return out, round(sum(s.eta_s or 0.0 for s in out), 1)


def _plan(inputs: PlanInputs, kind: PlanKind, reason: str, steps: Sequence[Step]
          ) -> tuple[ApplyPlanOut, list[PlanStepOut]]:
    """A plan of ``steps`` with their ETAs; the caller sets what clients should expect (pause, dip)."""
    etas, expected = timed(inputs, steps)
    plan = ApplyPlanOut(kind=kind, reason=reason, steps=[s.text for s in etas], step_etas=etas, expected_s=expected,
                        eta_note=inputs.step_times().note(), warnings=inputs.warnings)
    return plan, etas


def _sum(etas: Sequence[PlanStepOut]) -> float | None:
    if any(s.eta_s is None and s.action == "start" for s in etas):
        return None
    return round(sum(s.eta_s or 0.0 for s in etas), 1)


def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _pause(inputs: PlanInputs, why: str) -> ApplyPlanOut:
    """Drain, stop (or put to sleep), start; nothing serves from the drain until the new instance is ready."""
    stop = Step("sleep", "put the old instance to sleep; new requests wait in the gateway's queue") if inputs.sleep \
        else Step("stop", "stop it; new requests wait in the gateway's queue")
    steps = [Step("drain", "drain the old instance (requests in flight finish)"), stop,
             Step("start", "start the new revision; then it serves the queue", inputs.new, "alone")]
    plan, etas = _plan(inputs, "pause", why, steps)
    plan.pause_s, plan.capacity_dip_pct = _sum(etas), 100.0
    return plan


def plan_apply(inputs: PlanInputs) -> ApplyPlanOut:
    """The plan for applying ``inputs.new`` over what runs now."""
    running, new, device = inputs.running, inputs.new, inputs.device
    if running is None:
        plan, _ = _plan(inputs, "start", "nothing serves now: the new revision starts",
                        [Step("start", "start the new revision", new, "alone")])
        return plan
    if running.replicas >= 2:
        dip = 100.0 / running.replicas
        steps: list[Step] = []
        for i in range(running.replicas):
            steps += [Step("drain", f"replica {i + 1}: drain it (the others serve)"),
                      Step("stop", f"replica {i + 1}: stop it"),
                      Step("start", f"replica {i + 1}: start the new revision, then it serves", new, "beside")]
            if i + 1 < running.replicas:  # the next replica drains once this one has ended its first requests
                steps.append(Step("handover", f"replica {i + 1}: it takes its first requests beside the others"))
        steps += [Step("start", f"start replica {i + 1}", new, "beside") for i in range(running.replicas, new.replicas)]
        plan, _ = _plan(inputs, "rolling", f"{running.replicas} replicas serve: one at a time is replaced", steps)
        plan.pause_s, plan.capacity_dip_pct = 0.0, round(dip, 1)
        return plan
    if device is None:
        return _pause(inputs, "the device's free memory is not known: nothing can be started beside the old one")
    if device.kind == "cpu":
        return _plan_cpu(inputs, running, device)
    return _plan_gpu(inputs, running, device)


def cpu_need_bytes(settings: EngineSettings, shape: ModelShape | None) -> int:
    """What one more vLLM CPU instance takes of the host: its KV cache, its weights, the processes around them."""
    weights = 0 if shape is None else shape.parameters() * 2
    return int(settings.cpu_kv_cache_gib * GIB) + weights + CPU_PROCESS_BYTES


def _plan_cpu(inputs: PlanInputs, running: Running, device: Device) -> ApplyPlanOut:
    need = cpu_need_bytes(inputs.new, inputs.shape_new) * max(1, inputs.new.replicas)
    free_now = device.free_bytes - (running.memory_bytes or 0)  # the planner counts the old instance's as free
    if free_now - MARGIN_BYTES >= need:
        return _blue_green(inputs, f"the new instance ({need / GIB:.1f} GiB) fits beside the old one in the host's "
                           f"{free_now / GIB:.1f} GiB available")
    return _pause(inputs, f"the new instance needs {need / GIB:.1f} GiB and the host has {free_now / GIB:.1f} GiB "
                  "available beside the old one")


def _blue_green(inputs: PlanInputs, why: str) -> ApplyPlanOut:
    steps = [Step("start", "start the new revision beside the old one (the old one serves)", inputs.new, "beside"),
             Step("handover", "when it is ready, it takes its first requests beside the old one"),
             Step("drain", "send new requests to it; drain the old instance"), Step("stop", "stop the old instance")]
    plan, _ = _plan(inputs, "blue_green", why, steps)
    plan.pause_s, plan.capacity_dip_pct = 0.0, 0.0
    return plan


def _plan_gpu(inputs: PlanInputs, running: Running, device: Device) -> ApplyPlanOut:
    new, old = inputs.new, running.settings
    total = device.total_bytes
    old_mem = running.memory_bytes if running.memory_bytes is not None else int(old.gpu_memory_utilization * total)
    free_now = device.free_bytes - old_mem  # device() counts the running vLLM's memory as free; here it is not
    if new.gpu_memory_utilization * total + MARGIN_BYTES <= free_now:
        return _blue_green(inputs, f"the new instance ({new.gpu_memory_utilization:.2f} of the GPU) fits beside the "
                           f"old one ({free_now / GIB:.1f} GiB free)")
    # a bridge B beside the old instance, then the new one beside B
    beside_old = (free_now - MARGIN_BYTES) / total
    beside_new = (free_now + old_mem - MARGIN_BYTES) / total - new.gpu_memory_utilization
    largest = _floor2(min(beside_old, beside_new))
    bridge_settings = old.model_copy(update={"gpu_memory_utilization": largest, "replicas": 1})
    shape = inputs.shape_old
    if shape is None:
        return _pause(inputs, "the running model's shape is unknown: no bridge can be sized")
    max_len = old.max_model_len or shape.max_position_embeddings
    smallest = utilization_for(shape, old, device, inputs.calibration, max_len)
    if largest < BRIDGE_MIN_UTILIZATION or smallest is None or largest < smallest:
        why = (f"no bridge fits: beside the old instance {max(0.0, beside_old):.2f} of the GPU is free and beside "
               f"the new one {max(0.0, beside_new):.2f}; one {max_len}-token request needs "
               f"{smallest if smallest is not None else '>1'}")
        inputs.warnings.append(why + "; lower gpu_memory_utilization for a bridge, or accept the pause")
        return _pause(inputs, why)
    pred = predict(shape, bridge_settings, device, inputs.calibration)
    per_request = min(inputs.request_tokens or pred.tokens_per_request, pred.tokens_per_request) or 1
    seqs = max(1, min(old.max_num_seqs, pred.usable_tokens // per_request))  # what traffic's requests need
    bridge = BridgeOut(gpu_memory_utilization=largest, kv_tokens=pred.kv_tokens, max_num_seqs=seqs,
                       max_concurrency=pred.max_concurrency, max_model_len=max_len)
    old_pred = predict(shape, old, device, inputs.calibration)
    old_concurrency = min(float(old.max_num_seqs), old_pred.usable_tokens / per_request)
    dip = 100.0 * max(0.0, 1 - seqs / old_concurrency) if old_concurrency else None
    steps = [Step("start", f"start a bridge of the old revision at {largest:.2f} ({pred.kv_tokens:,} KV tokens, "
                  f"max_num_seqs {seqs}) beside the old instance",
                  bridge_settings.model_copy(update={"max_num_seqs": seqs}), "bridge"),
             Step("handover", "it takes its first requests beside the old instance"),
             Step("drain", "send new requests to the bridge; drain the old instance"),
             Step("stop", "stop the old instance"),
             Step("start", "start the new revision beside the bridge", new, "beside"),
             Step("handover", "it takes its first requests beside the bridge"),
             Step("drain", "send new requests to it; drain the bridge"), Step("stop", "stop the bridge")]
    plan, etas = _plan(inputs, "bridge", f"a bridge at {largest:.2f} fits beside the old instance, and the new one "
                       "beside it", steps)
    plan.bridge, plan.pause_s, plan.capacity_dip_pct = bridge, 0.0, None if dip is None else round(dip, 1)
    plan.dip_s = _sum(etas[2:6]) if inputs.times is not None else inputs.eta_new_s  # the bridge alone carries it
    return plan


__all__ = ["CPU_PROCESS_BYTES", "MARGIN_BYTES", "Company", "PlanInputs", "PlanKind", "Running", "StartEtasOnly",
           "StepEta", "StepTimes", "cpu_need_bytes", "plan_apply", "timed"]
