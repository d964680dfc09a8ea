"""Capacity accuracy on a GPU: predicted KV tokens against what vLLM logs, for a table of configurations.

Each case starts vLLM with the project's own argument builder, waits for "GPU KV cache size: N tokens", and
stops it. Predictions use the device as NVML reports it and the calibration the engine recorded on this host
(run tests/gpu/test_gpu_engine.py first), so they are what the console shows before an apply.

    python -m bench capacity-gpu --profile h200 --data-dir /tmp/llmops-gpu     # --model: the profile's
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import pynvml

from engine.capacity import CalibrationStore, Device, load_shape, parse_start, predict
from engine.db import open_database
from engine.revisions import EngineSettings
from engine.vllm import ChildLog, VllmChild, build_command, build_env, free_port

CASES: list[dict[str, Any]] = [
    {"gpu_memory_utilization": 0.5, "max_model_len": 8192, "max_num_seqs": 128},
    {"gpu_memory_utilization": 0.9, "max_model_len": 8192, "max_num_seqs": 256},
    {"gpu_memory_utilization": 0.3, "max_model_len": 4096, "max_num_seqs": 64, "kv_cache_dtype": "fp8"},
    {"gpu_memory_utilization": 0.2, "max_model_len": 4096, "max_num_seqs": 64, "max_num_batched_tokens": 4096},
    {"gpu_memory_utilization": 0.6, "max_model_len": 8192, "max_num_seqs": 64, "enforce_eager": True},
    {"gpu_memory_utilization": 0.15, "max_model_len": 2048, "max_num_seqs": 32, "enforce_eager": True,
     "max_num_batched_tokens": 16384},
]


def nvml_device() -> Device:
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    mem = pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
    name = pynvml.nvmlDeviceGetName(h)
    pynvml.nvmlShutdown()
    return Device("cuda", int(mem.total - mem.reserved), int(mem.free), 1, str(name))


async def run_case(settings: EngineSettings, logs: Path, n: int, timeout: float) -> tuple[list[str], float]:
    args = build_command(settings, python=sys.executable, port=free_port(), data_dir=None, build="cuda")
    log = ChildLog(logs / f"accuracy-{n}.log", 50_000_000, 0)
    child = VllmChild(args, build_env(offline=True), int(args[args.index("--port") + 1]), n, log,
                      logs / f"accuracy-{n}.json")
    t0 = time.monotonic()
    await child.spawn()
    try:
        while time.monotonic() - t0 < timeout and child.returncode is None:
            if any("KV cache size:" in line for line in child.lines):
                await asyncio.sleep(1.0)  # the "Free memory on device ..." line follows within a second
                break
            await asyncio.sleep(0.2)
        return list(child.lines), time.monotonic() - t0
    finally:
        await child.stop(10)
        log.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--budget", type=float, default=540, help="stop starting new cases after this many seconds")


def run(a: argparse.Namespace) -> None:
    shape = load_shape(Path(a.model))
    calibrations = CalibrationStore(open_database(a.data_dir / "llmops.db"))
    rows = []
    t_start = time.monotonic()
    for n, case in enumerate(CASES):
        if time.monotonic() - t_start > a.budget:
            break
        settings = EngineSettings.model_validate({"model": a.model, "served_model_name": "m", "load_format": "dummy",
                                                  **case})
        device = nvml_device()
        calibration = calibrations.latest(a.model, 1, "auto")
        pred = predict(shape, settings, device, calibration)
        uncal = predict(shape, settings, device, None)
        lines, seconds = asyncio.run(run_case(settings, a.out, n, a.timeout))
        logged = parse_start(lines)
        row = {"case": case, "predicted": pred.kv_tokens, "predicted_uncalibrated": uncal.kv_tokens,
               "logged": logged.kv_tokens, "calibrated": pred.calibrated, "seconds": round(seconds, 1),
               "logged_terms": logged.__dict__, "device_total": device.total_bytes}
        if logged.kv_tokens:
            row["error_pct"] = round(100 * (pred.kv_tokens - logged.kv_tokens) / logged.kv_tokens, 2)
            row["error_uncalibrated_pct"] = round(100 * (uncal.kv_tokens - logged.kv_tokens) / logged.kv_tokens, 2)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "logged_terms"}), flush=True)
    (a.out / "gpu-accuracy.json").write_text(json.dumps(rows, indent=1, default=str))

