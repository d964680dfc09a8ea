"""On a GPU: telemetry from the real driver while the real engine serves an 8B-shaped model, under load."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.gpu.conftest import MODEL, START_S, GpuEngine, needs_gpu, report

pytestmark = needs_gpu
GIB = 1 << 30
SETTINGS = {"model": MODEL, "served_model_name": "m", "load_format": "dummy", "gpu_memory_utilization": 0.85,
            "max_model_len": 4096, "max_num_seqs": 64}


def test_engine_starts_the_8b_model(gpu_engine: GpuEngine) -> None:
    c = gpu_engine.client
    capacity = c.capacity(SETTINGS)
    assert capacity["ok"], capacity["errors"]
    rev = c.put_settings(c.settings().revision, SETTINGS, "gpu validation: 8B shape", force=False)
    c.engine_action("start")
    t0 = time.monotonic()
    status = c.wait_for({"ready"}, START_S, revision=rev.revision)
    ready = [e for e in c.events(kinds=["ready"]) if e.revision == rev.revision][-1]
    report("start", {"seconds": round(time.monotonic() - t0, 1), "predicted_uncalibrated": capacity["prediction"],
                     "ready_event": ready.data, "status": status.model_dump()})
    assert status.state == "ready"


def test_real_sampler_holds_its_rate(gpu_engine: GpuEngine) -> None:
    time.sleep(12)  # let the rate window fill with samples taken while vLLM is up
    gpu = gpu_engine.client._request("GET", "/api/gpu")
    assert gpu["available"] is True and gpu["driver"]
    assert gpu["gpus"] and "H" in gpu["gpus"][0]["name"]
    rate = gpu["sampler"]["samples_per_s"]
    report("sampler", {"driver": gpu["driver"], "name": gpu["gpus"][0]["name"], **gpu["sampler"],
                       "unavailable": gpu["gpus"][0]["unavailable"], "throttle": gpu["gpus"][0]["throttle_reasons"],
                       "ecc": gpu["gpus"][0]["ecc"], "pages": gpu["gpus"][0]["pages"]})
    assert abs(rate - 1.0) < 0.05, gpu["sampler"]


def test_vllm_memory_is_attributed_to_the_engine(gpu_engine: GpuEngine) -> None:
    g = gpu_engine.client._request("GET", "/api/gpu")["gpus"][0]
    ours = [p for p in g["processes"] if p["ours"]]
    v = g["values"]
    report("attribution", {"processes": g["processes"], "mem_used": v["mem_used"], "mem_total": v["mem_total"],
                           "mem_reserved": v["mem_reserved"], "vllm_mem": v["vllm_mem"],
                           "vllm_share_of_used_pct": g["vllm_mem_pct_of_used"]})
    assert ours, g["processes"]
    assert v["vllm_mem"] > 100 * GIB  # weights + KV cache at utilization 0.85
    assert g["vllm_mem_pct_of_used"] > 95


def _watch(engine: GpuEngine, stop: threading.Event, seen: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        seen.append(engine.client._request("GET", "/api/gpu")["gpus"][0]["values"])
        stop.wait(0.5)


def test_power_and_utilization_rise_under_load(gpu_engine: GpuEngine) -> None:
    idle = gpu_engine.client._request("GET", "/api/gpu/history", params={"window": "10s"})["devices"]["0"]
    idle_power = [p for p in idle["power_w"]["avg"] if p is not None]
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(gpu_engine, stop, seen))
    watcher.start()
    try:
        result = gpu_engine.bench(concurrency=64, prompts=640, label="seqs64-c64")
    finally:
        stop.set()
        watcher.join()
    loaded_power = max(s["power_w"] for s in seen)
    loaded_util = max(s["util_gpu"] for s in seen)
    report("load", {"idle_power_w": sum(idle_power) / len(idle_power), "loaded_power_w_max": loaded_power,
                    "loaded_util_max": loaded_util, "sm_clock_max": max(s["sm_clock_mhz"] for s in seen),
                    "temp_max": max(s["temp_c"] for s in seen), "energy_j_delta": seen[-1]["energy_j"]
                    - seen[0]["energy_j"], "bench": result})
    assert loaded_power > sum(idle_power) / len(idle_power) + 100
    assert loaded_util >= 50
    history = gpu_engine.client._request("GET", "/api/gpu/history", params={"window": "5m"})
    assert history["source"] == "raw" and len(history["devices"]["0"]["t"]) > 60


def test_apply_max_num_seqs_1_and_compare_throughput(gpu_engine: GpuEngine) -> None:
    c = gpu_engine.client
    rev = c.put_settings(c.settings().revision, {"max_num_seqs": 1}, "gpu validation: one at a time")
    t0 = time.monotonic()
    c.wait_for({"ready"}, START_S, revision=rev.revision)
    applied_s = time.monotonic() - t0
    one = gpu_engine.bench(concurrency=16, prompts=24, label="seqs1-c16")
    ready = [e for e in c.events(kinds=["ready"]) if e.revision == rev.revision][-1]
    report("max_num_seqs_1", {"apply_s": round(applied_s, 1), "bench": one, "ready_event": ready.data})
    assert one["completed"] == 24
