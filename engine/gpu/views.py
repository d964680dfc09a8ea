"""GPU health as the API shows it: a GPU's reading with its derived shares, the balance of an engine's GPUs, and
the whole latest sample."""

from __future__ import annotations

from engine.gpu.alerts import AlertEngine
from engine.gpu.nvml import GpuReading
from engine.gpu.sampler import Sampler
from engine.schemas import AlertOut, BalanceOut, GpuOut, GpuProcess, GpuView, HostReading, SamplerStats


def gpu_view(g: GpuReading) -> GpuView:
    used, total, vllm = g.values.get("mem_used"), g.values.get("mem_total"), g.values.get("vllm_mem")
    return GpuView(index=g.index, uuid=g.uuid, name=g.name, ts=g.ts, lost=g.lost, error=g.error, values=g.values,
                   unavailable=g.unavailable, throttle_reasons=g.throttle_reasons, ecc=g.ecc, pages=g.pages,
                   processes=[GpuProcess.model_validate(p) for p in g.processes],
                   mem_pct=None if used is None or not total else round(100 * used / total, 2),
                   vllm_mem_pct_of_used=None if vllm is None or not used else round(100 * vllm / used, 2))


def balance(gpus: list[GpuReading]) -> BalanceOut | None:
    """Spread of memory and utilisation across the GPUs of our engine (else all GPUs), when there are several."""
    live = [g for g in gpus if not g.lost and g.values.get("mem_used") is not None]
    ours = [g for g in live if any(p["ours"] for p in g.processes)]
    group, scope = (ours, "engine") if len(ours) >= 2 else (live, "all")
    if len(group) < 2:
        return None
    mem = [float(g.values["mem_used"] or 0) for g in group]
    util = [float(g.values.get("util_gpu") or 0) for g in group]
    mean_mem = sum(mem) / len(mem)
    return BalanceOut(scope=scope, gpus=[g.index for g in group], mem_used_min=min(mem), mem_used_max=max(mem),
                      mem_spread_bytes=max(mem) - min(mem),
                      mem_spread_pct=round(100 * (max(mem) - min(mem)) / mean_mem, 2) if mean_mem else 0.0,
                      util_min=min(util), util_max=max(util), util_spread_pct=max(util) - min(util))


def gpu_now(sampler: Sampler, alerts: AlertEngine) -> GpuOut:
    """The latest sample, or ``available: false`` with NVML's reason and the host where vLLM runs."""
    snap = sampler.latest
    return GpuOut(available=snap.available, reason=snap.reason, driver=snap.driver, ts=snap.ts,
                  gpus=[gpu_view(g) for g in snap.gpus],
                  host=HostReading.model_validate(snap.host) if snap.host else None,
                  alerts=[AlertOut.model_validate(a) for a in alerts.snapshot()], balance=balance(snap.gpus),
                  sampler=SamplerStats.model_validate(sampler.stats()))
