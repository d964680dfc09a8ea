"""The planner joins the capacity model to the live device: what memory there is now (NVML, or the host for
the CPU build), the last calibration on this host, and which memory the running vLLM would give back.

With several deployments on one host a planner is *scoped* to one (``scoped``): the device it sees is that
deployment's GPUs, the memory it counts as coming back is that deployment's own (its neighbours keep theirs), and
pre-flight adds up what its neighbours reserve on the same GPUs (or host), so that placing or resizing one never
takes what another uses."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.capacity.calibration import CalibrationStore, StartReport
from engine.capacity.model import (
    GIB,
    Device,
    ModelShape,
    batched_tokens,
    estimate_activation,
    load_shape,
    lora_bytes,
    predict,
)
from engine.capacity.plans import MARGIN_BYTES, PlanInputs, Running, StepTimes, cpu_need_bytes, plan_apply
from engine.capacity.preflight import Cluster, Neighbour, PreflightResult, TrafficNeed, check, find_model_config
from engine.revisions import DeploymentRef, EngineSettings
from engine.schemas import ApplyPlanOut, Build

if TYPE_CHECKING:  # the sampler is handed in; capacity does not depend on the GPU package
    from engine.gpu import Sampler

log = logging.getLogger("llmops.planner")


class Planner:
    def __init__(self, build: Build, data_dir: Path, sampler: Sampler, calibrations: CalibrationStore,
                 traffic_max_tokens: Callable[[], int | None] = lambda: None,
                 traffic_need: Callable[[], TrafficNeed | None] = lambda: None) -> None:
        """``traffic_max_tokens``: the p99 of what recent requests needed (sizes a bridge's max_num_seqs);
        ``traffic_need``: the longest request of a long window (sizes a suggested max_model_len)."""
        self.build = build
        self.data_dir = data_dir
        self.sampler = sampler
        self.calibrations = calibrations
        self.traffic_max_tokens = traffic_max_tokens
        self.traffic_need = traffic_need
        self.scope: DeploymentRef | None = None  # the deployment this planner plans for (None: the whole host)
        # what the other deployments reserve (set by the registry): (this deployment) -> its neighbours
        self.neighbours: Callable[[DeploymentRef | None], list[Neighbour]] = lambda _: []
        self.cluster: Callable[[], Cluster | None] = lambda: None  # a Ray cluster's GPUs (set by the registry)
        self.sleep_mode = False  # instances put to sleep wake in about a second (CUDA, LLMOPS_SLEEP_MODE)

    def scoped(self, deployment: DeploymentRef) -> Planner:
        """This planner for one deployment (the same calibrations, sampler and neighbours)."""
        planner = copy.copy(self)
        planner.scope = deployment
        return planner

    def _own(self, processes: list[dict[str, Any]], fallback: float, sleepers: frozenset[str] = frozenset()
             ) -> float:
        """Memory the scoped deployment's processes hold on one GPU (unscoped: every vLLM's, ``fallback``), and
        those of the neighbours in ``sleepers`` (they are put to sleep for it)."""
        if self.scope is None:
            return fallback
        mine = {self.scope.name} | sleepers
        return float(sum(int(p.get("used_memory") or 0) for p in processes if p.get("deployment") in mine))

    def device(self, tensor_parallel_size: int = 1, sleepers: frozenset[str] = frozenset()) -> Device | None:
        """Memory as vLLM will see it after this deployment's running instances stop (their memory counts as
        free; a neighbour's does not, unless it is in ``sleepers``: put to sleep for this one). Its GPUs: the
        deployment's placement, else the first ones."""
        snap = self.sampler.latest
        if self.build == "cuda":
            gpus = [g for g in snap.gpus if not g.lost and g.values.get("mem_total")]
            if not snap.available or not gpus:
                return None
            placed = self.scope.gpus if self.scope is not None and self.scope.gpus else None
            pool = [g for g in gpus if g.index in placed] if placed else gpus
            pool = pool or gpus
            group = pool[:tensor_parallel_size] if tensor_parallel_size <= len(pool) else pool
            totals = [float(g.values["mem_total"] or 0) - float(g.values.get("mem_reserved") or 0) for g in group]
            frees = [totals[i] - float(g.values.get("mem_used") or 0)
                     + self._own(g.processes, float(g.values.get("vllm_mem") or 0), sleepers)
                     for i, g in enumerate(group)]
            return Device("cuda", int(min(totals)), int(min(frees)), count=len(gpus), name=group[0].name,
                          indices=tuple(g.index for g in group))
        host = snap.host
        if not host:
            return None
        own = float(host.get("vllm_rss", 0)) if self.scope is None else \
            float((host.get("vllm_rss_by_deployment") or {}).get(self.scope.name, 0))
        return Device("cpu", int(host["mem_total"]), int(host["mem_available"] + own), name="host")

    def room_for(self, settings: EngineSettings, snap: Any = None, index: int = 0) -> str | None:
        """Whether replica ``index`` of ``settings`` fits beside everything that runs now (the engine's host, or
        the node whose sample ``snap`` is): None when it does, else what it needs and what there is. On GPUs
        enough for each replica's own group (launcher.device_for), replica ``index``'s group is looked at."""
        snap = snap if snap is not None else self.sampler.latest
        if self.build == "cuda":
            gpus = [g for g in snap.gpus if not g.lost and g.values.get("mem_total")]
            placed = self.scope.gpus if self.scope is not None and self.scope.gpus else None
            pool = [g for g in gpus if g.index in placed] if placed else gpus
            tp = settings.tensor_parallel_size
            own = len(pool) >= settings.most_replicas * tp and settings.most_replicas >= 2
            group = pool[index * tp:(index + 1) * tp] if own else pool[:tp]
            if not group:
                return None  # no reading: vLLM's own start says whether it fits
            need = settings.gpu_memory_utilization * min(float(g.values["mem_total"] or 0) for g in group)
            free = min(float(g.values["mem_total"] or 0) - float(g.values.get("mem_used") or 0) for g in group)
            if free - MARGIN_BYTES >= need:
                return None
            return f"it needs {need / GIB:.1f} GiB of GPU {group[0].index}, which has {free / GIB:.1f} GiB free"
        host = snap.host or {}
        if not host:
            return None
        need = cpu_need_bytes(settings, self._shape(settings))
        available = float(host.get("mem_available") or 0)
        if available - MARGIN_BYTES >= need:
            return None
        return (f"it needs about {need / GIB:.1f} GiB of the host's memory, which has {available / GIB:.1f} GiB "
                "available")

    def free_bytes(self, snap: Any = None) -> float | None:
        """The memory free on a node (the engine's host, or the node whose sample ``snap`` is): its GPUs' on CUDA,
        its host's on the CPU build; None without a reading."""
        snap = snap if snap is not None else self.sampler.latest
        if snap is None:
            return None
        if self.build == "cuda":
            gpus = [g for g in snap.gpus if not g.lost and g.values.get("mem_total")]
            if not gpus:
                return None
            return sum(float(g.values["mem_total"] or 0) - float(g.values.get("mem_used") or 0) for g in gpus)
        available = (snap.host or {}).get("mem_available")
        return float(available) if available is not None else None

    def check(self, settings: EngineSettings) -> PreflightResult:
        calibration = self.calibrations.latest(settings.model, settings.tensor_parallel_size, settings.dtype)
        neighbours = self.neighbours(self.scope)
        sleepers = frozenset(n.name for n in neighbours if n.sleeps)  # their memory comes back when this one wakes
        return check(settings, data_dir=self.data_dir, device=self.device(settings.tensor_parallel_size, sleepers),
                     calibration=calibration, traffic=self.traffic_need(), neighbours=neighbours,
                     cluster=self.cluster(), sleep_mode=self.sleep_mode, host_available=self._host_available())

    def _host_available(self) -> int | None:
        host = self.sampler.latest.host if self.sampler.latest is not None else None
        value = (host or {}).get("mem_available")
        return int(value) if value is not None else None

    def calibrate(self, report: StartReport, settings: EngineSettings, logged_batched_tokens: int | None,
                  revision_id: int | None) -> None:
        """Record a successful start's measured terms, with the model's estimate for it (to learn its error)."""
        folder = find_model_config(settings.model, self.data_dir)
        if folder is None:
            return
        shape = load_shape(folder)
        tokens = logged_batched_tokens or batched_tokens(settings, shape, "cuda")
        self.calibrations.record(report, settings, tokens, estimate_activation(shape, settings, tokens), revision_id,
                                 lora=lora_bytes(shape, settings))

    def compare(self, settings: EngineSettings, report: StartReport, predicted: dict[str, Any] | None
                ) -> dict[str, Any] | None:
        """Predicted against logged KV tokens for one start (the capacity model's running accuracy)."""
        if predicted is None or report.kv_tokens is None:
            return None
        pred = int(predicted["kv_tokens"])
        error = (pred - report.kv_tokens) / report.kv_tokens if report.kv_tokens else None
        return {"predicted_kv_tokens": pred, "logged_kv_tokens": report.kv_tokens,
                "error_pct": None if error is None else round(100 * error, 2),
                "calibrated": predicted.get("calibrated")}

    def predict_now(self, settings: EngineSettings) -> dict[str, Any] | None:
        """The prediction for a start about to happen; advisory: a model config it cannot read gives None."""
        folder = find_model_config(settings.model, self.data_dir)
        device = self.device(settings.tensor_parallel_size)
        if folder is None or device is None:
            return None
        calibration = self.calibrations.latest(settings.model, settings.tensor_parallel_size, settings.dtype)
        try:
            shape = load_shape(folder)
        except (KeyError, ValueError, TypeError, OSError) as exc:
            log.warning("no capacity prediction for %s: %s", folder, exc)
            return None
        return predict(shape, settings, device, calibration).as_dict()

    def vllm_memory(self) -> int | None:
        """What the running vLLM instances hold now: on a GPU the most on any one GPU, on the CPU build their
        resident memory; None when the sampler has not seen it."""
        snap = self.sampler.latest
        if self.build == "cuda":
            held = [int(self._own(g.processes, float(g.values.get("vllm_mem") or 0))) for g in snap.gpus
                    if not g.lost]
            return max(held) if held else None
        host = snap.host or {}
        if self.scope is not None:
            return int((host.get("vllm_rss_by_deployment") or {}).get(self.scope.name, 0)) if host else None
        rss = host.get("vllm_rss")
        return int(rss) if rss is not None else None

    def _shape(self, settings: EngineSettings) -> ModelShape | None:
        folder = find_model_config(settings.model, self.data_dir)
        if folder is None:
            return None
        try:
            return load_shape(folder)
        except (KeyError, ValueError, TypeError, OSError):
            return None

    def plan(self, new: EngineSettings, old: EngineSettings | None, *, replicas: int, memory_bytes: int | None,
             eta_new_s: float | None, eta_bridge_s: float | None, times: StepTimes | None = None,
             sleep: bool = False) -> ApplyPlanOut:
        """How applying ``new`` over ``old`` (running as ``replicas`` instances holding ``memory_bytes``) keeps
        serving: engine/capacity/plans.py; each step's ETA from ``times`` (else the two start ETAs), a pause by
        ``sleep`` mode or not."""
        calibration = None
        if old is not None:
            calibration = self.calibrations.latest(old.model, old.tensor_parallel_size, old.dtype)
        return plan_apply(PlanInputs(
            new=new, running=None if old is None else Running(old, replicas, memory_bytes),
            device=self.device(new.tensor_parallel_size), shape_old=None if old is None else self._shape(old),
            shape_new=self._shape(new), calibration=calibration, eta_new_s=eta_new_s, eta_bridge_s=eta_bridge_s,
            request_tokens=self.traffic_max_tokens(), times=times, sleep=sleep))

    def wait_released(self, pids: set[int], timeout: float) -> bool:
        """After a stop on a GPU: wait until NVML lists none of the old processes (their memory is back)."""
        if self.build != "cuda" or not pids:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = self.sampler.latest
            held = {p["pid"] for g in snap.gpus for p in g.processes} & pids
            if not held and snap.ts > time.time() - 2 * self.sampler.interval_s:
                return True
            time.sleep(self.sampler.interval_s / 2)
        return False
