"""CPU cost of GPU sampling: the whole tick (NVML reads, host reading, SQLite write, alert rules) per sample.

    python -m bench telemetry-cost --double 8     # 8 scripted GPUs: the project's own overhead (no GPU here)
    python -m bench telemetry-cost                # the real driver, every GPU NVML sees

Prints JSON and writes it to ``telemetry-cost.json`` under ``--out``: CPU milliseconds per tick (thread CPU time)
and the share of one core at the sampling interval.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.db import open_database
from engine.gpu import AlertEngine, AlertThresholds, Sampler, TelemetryStore


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--double", type=int, default=0, help="use N scripted GPUs instead of the driver")
    parser.add_argument("--ticks", type=int, default=120)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--per-call", action="store_true", help="also time each NVML call on GPU 0")


def run(args: argparse.Namespace) -> None:
    if args.double:
        from tests.testkit.nvml_double import FakeGpu, NvmlDouble

        nvml: Any = NvmlDouble([FakeGpu(f"GPU-{i}") for i in range(args.double)])
    else:
        import pynvml

        nvml = pynvml
    with tempfile.TemporaryDirectory() as tmp:
        history = TelemetryStore(open_database(Path(tmp) / "bench.db"), 3600, 7 * 86400)
        alerts = AlertEngine(AlertThresholds(), lambda *a: None)
        sampler = Sampler(nvml, args.interval, dict, [history.write, alerts.evaluate], lambda *a: None)
        sampler.tick()  # NVML init and discovery are start-up costs, not per-tick
        sampler.tick_cpu_s.clear()
        wall = []
        for _ in range(args.ticks):
            t0 = time.perf_counter()
            snap = sampler.tick()
            wall.append(time.perf_counter() - t0)
        cpu_ms = [c * 1e3 for c in sampler.tick_cpu_s]
    mean = statistics.mean(cpu_ms)
    calls = per_call(nvml) if args.per_call and snap.gpus else None
    report = {
        "per_call_ms": calls,
        "gpus": len(snap.gpus), "available": snap.available, "driver": snap.driver, "ticks": args.ticks,
        "tick_cpu_ms_mean": round(mean, 3), "tick_cpu_ms_p95": round(sorted(cpu_ms)[int(0.95 * len(cpu_ms))], 3),
        "tick_wall_ms_mean": round(1e3 * statistics.mean(wall), 3),
        "cpu_pct_of_one_core_at_interval": round(100 * mean / 1e3 / args.interval, 3),
        "interval_s": args.interval,
    }
    print(json.dumps(report, indent=1))
    (args.out / "telemetry-cost.json").write_text(json.dumps(report, indent=1) + "\n")


def per_call(nvml: Any, repeat: int = 20) -> dict[str, dict[str, Any]]:
    """Thread CPU and wall milliseconds of each NVML call the reader makes, on GPU 0."""
    from engine.gpu.nvml import _FAST, _SLOW

    h = nvml.nvmlDeviceGetHandleByIndex(0)
    calls: dict[str, Any] = {key: (lambda c=call: c(nvml, h)) for _, key, call, _ in (*_FAST, *_SLOW)}
    calls.update({
        "memory": lambda: nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2),
        "utilization": lambda: nvml.nvmlDeviceGetUtilizationRates(h),
        "processes": lambda: nvml.nvmlDeviceGetComputeRunningProcesses(h),
        "throttle_reasons": lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h),
        "memory_temperature": lambda: nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_MEMORY_TEMP]),
        "ecc": lambda: nvml.nvmlDeviceGetTotalEccErrors(h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                        nvml.NVML_VOLATILE_ECC),
        "remapped_rows": lambda: nvml.nvmlDeviceGetRemappedRows(h),
    })
    out: dict[str, dict[str, Any]] = {}
    for name, call in calls.items():
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            for _ in range(repeat):
                call()
        except nvml.NVMLError as exc:
            out[name] = {"error": str(exc)}
            continue
        out[name] = {"cpu_ms": round(1e3 * (time.thread_time() - cpu0) / repeat, 4),
                     "wall_ms": round(1e3 * (time.perf_counter() - wall0) / repeat, 4)}
    return out

