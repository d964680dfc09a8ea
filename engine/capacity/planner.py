"""The planner joins the capacity model to the live device: what memory there is now (NVML, or the host for
the CPU build), the last calibration on this host, and which memory the running vLLM would give back."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.capacity.calibration import CalibrationStore, StartReport
from engine.capacity.model import Device, ModelShape, batched_tokens, estimate_activation, load_shape, predict
from engine.capacity.plans import PlanInputs, Running, plan_apply
from engine.capacity.preflight import PreflightResult, TrafficNeed, check, find_model_config
from engine.revisions import EngineSettings
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

    def device(self, tensor_parallel_size: int = 1) -> Device | None:
        """Memory as vLLM will see it after the running child stops (its own memory counts as free)."""
        snap = self.sampler.latest
        if self.build == "cuda":
            gpus = [g for g in snap.gpus if not g.lost and g.values.get("mem_total")]
            if not snap.available or not gpus:
                return None
            group = gpus[:tensor_parallel_size] if tensor_parallel_size <= len(gpus) else gpus
            totals = [float(g.values["mem_total"] or 0) - float(g.values.get("mem_reserved") or 0) for g in group]
            frees = [totals[i] - float(g.values.get("mem_used") or 0) + float(g.values.get("vllm_mem") or 0)
                     for i, g in enumerate(group)]
            return Device("cuda", int(min(totals)), int(min(frees)), count=len(gpus), name=group[0].name)
        host = snap.host
        if not host:
            return None
        return Device("cpu", int(host["mem_total"]), int(host["mem_available"] + host.get("vllm_rss", 0)),
                      name="host")

    def check(self, settings: EngineSettings) -> PreflightResult:
        calibration = self.calibrations.latest(settings.model, settings.tensor_parallel_size, settings.dtype)
        return check(settings, data_dir=self.data_dir, device=self.device(settings.tensor_parallel_size),
                     calibration=calibration, traffic=self.traffic_need())

    def calibrate(self, report: StartReport, settings: EngineSettings, logged_batched_tokens: int | None,
                  revision_id: int | None) -> None:
        """Record a successful start's measured terms, with the model's estimate for it (to learn its error)."""
        folder = find_model_config(settings.model, self.data_dir)
        if folder is None:
            return
        shape = load_shape(folder)
        tokens = logged_batched_tokens or batched_tokens(settings, shape, "cuda")
        self.calibrations.record(report, settings, tokens, estimate_activation(shape, settings, tokens), revision_id)

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
            held = [int(g.values.get("vllm_mem") or 0) for g in snap.gpus if not g.lost]
            return max(held) if held else None
        rss = (snap.host or {}).get("vllm_rss")
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
             eta_new_s: float | None, eta_bridge_s: float | None) -> ApplyPlanOut:
        """How applying ``new`` over ``old`` (running as ``replicas`` instances holding ``memory_bytes``) keeps
        serving: engine/capacity/plans.py."""
        calibration = None
        if old is not None:
            calibration = self.calibrations.latest(old.model, old.tensor_parallel_size, old.dtype)
        return plan_apply(PlanInputs(
            new=new, running=None if old is None else Running(old, replicas, memory_bytes),
            device=self.device(new.tensor_parallel_size), shape_old=None if old is None else self._shape(old),
            shape_new=self._shape(new), calibration=calibration, eta_new_s=eta_new_s, eta_bridge_s=eta_bridge_s,
            request_tokens=self.traffic_max_tokens()))

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
