"""How an apply keeps something serving while vLLM restarts: the plan, chosen from the capacity model and the
device's free memory now (the old instance still running), shown before the operator confirms, and recorded.

1. **rolling** when ≥ 2 replicas run: one replica at a time is drained and replaced; the others serve.
2. **blue/green** when the new instance fits beside the old one (a GPU: vLLM's start needs utilization × total
   free; the CPU build: its KV cache, weights and process overhead within the host's available memory).
3. **bridge** when a small instance of the old revision fits beside the old one and the new one fits beside the
   bridge: the largest such bridge that holds one max-length request; traffic moves old → bridge → new.
4. **pause** (drain, stop, start, hold requests in the queue) when nothing fits, with its predicted length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.capacity.model import GIB, Calibration, Device, ModelShape, predict, utilization_for
from engine.capacity.preflight import NEIGHBOUR_MARGIN_BYTES
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, BridgeOut, PlanKind

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


def _floor2(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _pause(inputs: PlanInputs, why: str) -> ApplyPlanOut:
    eta = inputs.eta_new_s
    return ApplyPlanOut(kind="pause", reason=why, pause_s=eta, expected_s=eta, capacity_dip_pct=100.0,
                        steps=["drain the old instance (requests in flight finish)",
                               "stop it; new requests wait in the gateway's queue",
                               "start the new revision", "serve the queue from the new instance"],
                        warnings=inputs.warnings)


def plan_apply(inputs: PlanInputs) -> ApplyPlanOut:
    """The plan for applying ``inputs.new`` over what runs now."""
    running, new, device = inputs.running, inputs.new, inputs.device
    if running is None:
        return ApplyPlanOut(kind="start", reason="nothing serves now: the new revision starts",
                            expected_s=inputs.eta_new_s, pause_s=None, capacity_dip_pct=None,
                            steps=["start the new revision"], warnings=inputs.warnings)
    if running.replicas >= 2:
        dip = 100.0 / running.replicas
        return ApplyPlanOut(kind="rolling", reason=f"{running.replicas} replicas serve: one at a time is replaced",
                            expected_s=None if inputs.eta_new_s is None else inputs.eta_new_s * running.replicas,
                            pause_s=0.0, capacity_dip_pct=round(dip, 1),
                            steps=[f"replica {i + 1}: drain, stop, start the new revision, serve"
                                   for i in range(running.replicas)]
                            + ([f"start {new.replicas - running.replicas} more"] if new.replicas > running.replicas
                               else []), warnings=inputs.warnings)
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
    return ApplyPlanOut(kind="blue_green", reason=why, expected_s=inputs.eta_new_s, pause_s=0.0,
                        capacity_dip_pct=0.0,
                        steps=["start the new revision beside the old one (the old one serves)",
                               "when it is ready, send new requests to it", "drain the old instance, then stop it"],
                        warnings=inputs.warnings)


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
    eta = None if inputs.eta_new_s is None or inputs.eta_bridge_s is None else inputs.eta_bridge_s + inputs.eta_new_s
    return ApplyPlanOut(
        kind="bridge", reason=f"a bridge at {largest:.2f} fits beside the old instance, and the new one beside it",
        bridge=bridge, expected_s=eta, pause_s=0.0, capacity_dip_pct=None if dip is None else round(dip, 1),
        dip_s=inputs.eta_new_s,
        steps=[f"start a bridge of the old revision at {largest:.2f} ({pred.kv_tokens:,} KV tokens, "
               f"max_num_seqs {seqs}) beside the old instance", "send new requests to the bridge; drain and stop "
               "the old instance", "start the new revision beside the bridge",
               "send new requests to it; drain and stop the bridge"],
        warnings=inputs.warnings)


__all__ = ["CPU_PROCESS_BYTES", "MARGIN_BYTES", "PlanInputs", "PlanKind", "Running", "cpu_need_bytes",
           "plan_apply"]
