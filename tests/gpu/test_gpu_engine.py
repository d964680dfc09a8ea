"""On a GPU: telemetry from the real driver while the real engine serves an 8B-shaped model, under load."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime

from engine.schemas import GpuView
from tests.gpu.conftest import SETTINGS, START_S, bench, needs_gpu, report
from tests.testkit.engine import EngineHandle
from tests.testkit.wait import wait_until

pytestmark = needs_gpu
GIB = 1 << 30


def test_engine_starts_the_8b_model(gpu_engine: EngineHandle) -> None:
    c = gpu_engine.client
    capacity = c.capacity(SETTINGS)
    assert capacity.ok, capacity.errors
    rev = c.put_settings(c.settings().revision, {**SETTINGS, "max_num_seqs": 63}, "gpu validation: 8B shape")
    c.engine_action("start")
    t0 = time.monotonic()
    status = c.wait_for({"ready"}, START_S, revision=rev.revision)
    ready = [e for e in c.events(kinds=["ready"]) if e.revision == rev.revision][-1]
    report("start", {"seconds": round(time.monotonic() - t0, 1), "predicted": capacity.prediction,
                     "ready_event": ready.data, "status": status.model_dump()})
    assert status.state == "ready"


def test_real_sampler_holds_its_rate(gpu_engine: EngineHandle, serving_8b: int) -> None:
    def ready_for(seconds: float) -> bool:  # the rate window holds samples taken while vLLM is up
        since = gpu_engine.client.status().ready_since
        return since is not None and (datetime.now(UTC) - since).total_seconds() >= seconds

    wait_until(lambda: ready_for(12), 60, every=1, what="12 s of samples with vLLM up")
    gpu = gpu_engine.client.gpu()
    assert gpu.available is True and gpu.driver
    assert gpu.gpus and "H" in gpu.gpus[0].name
    rate = gpu.sampler.samples_per_s
    report("sampler", {"driver": gpu.driver, "name": gpu.gpus[0].name, **gpu.sampler.model_dump(),
                       "unavailable": gpu.gpus[0].unavailable, "throttle": gpu.gpus[0].throttle_reasons,
                       "ecc": gpu.gpus[0].ecc, "pages": gpu.gpus[0].pages})
    assert rate is not None and abs(rate - 1.0) < 0.05, gpu.sampler


def test_vllm_memory_is_attributed_to_the_engine(gpu_engine: EngineHandle, serving_8b: int) -> None:
    g = gpu_engine.client.gpu().gpus[0]
    ours = [p for p in g.processes if p.ours]
    v = g.values
    report("attribution", {"processes": [p.model_dump() for p in g.processes], "mem_used": v["mem_used"],
                           "mem_total": v["mem_total"], "mem_reserved": v["mem_reserved"], "vllm_mem": v["vllm_mem"],
                           "vllm_share_of_used_pct": g.vllm_mem_pct_of_used})
    assert ours, g.processes
    assert (v["vllm_mem"] or 0) > 100 * GIB  # weights + KV cache at utilization 0.85
    assert (g.vllm_mem_pct_of_used or 0) > 95


def _watch(engine: EngineHandle, stop: threading.Event, seen: list[GpuView]) -> None:
    while not stop.is_set():
        seen.append(engine.client.gpu().gpus[0])
        stop.wait(0.5)


def test_power_and_utilization_rise_under_load(gpu_engine: EngineHandle, serving_8b: int) -> None:
    idle = gpu_engine.client.gpu_history("10s").devices["0"]
    idle_power = [p for p in idle.__pydantic_extra__["power_w"].avg if p is not None]
    seen: list[GpuView] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(gpu_engine, stop, seen))
    watcher.start()
    try:
        result = bench(gpu_engine.url, concurrency=64, prompts=640, label="seqs64-c64")
    finally:
        stop.set()
        watcher.join()
    loaded_power = max(s.values["power_w"] or 0 for s in seen)
    loaded_util = max(s.values["util_gpu"] or 0 for s in seen)
    report("load", {"idle_power_w": sum(idle_power) / len(idle_power), "loaded_power_w_max": loaded_power,
                    "loaded_util_max": loaded_util, "sm_clock_max": max(s.values["sm_clock_mhz"] or 0 for s in seen),
                    "temp_max": max(s.values["temp_c"] or 0 for s in seen),
                    "energy_j_delta": (seen[-1].values["energy_j"] or 0) - (seen[0].values["energy_j"] or 0),
                    "bench": result})
    assert loaded_power > sum(idle_power) / len(idle_power) + 100
    assert loaded_util >= 50
    history = gpu_engine.client.gpu_history("5m")
    assert history.source == "raw" and len(history.devices["0"].t) > 60


def test_apply_max_num_seqs_1_and_compare_throughput(gpu_engine: EngineHandle, serving_8b: int) -> None:
    c = gpu_engine.client
    rev = c.put_settings(c.settings().revision, {"max_num_seqs": 1}, "gpu validation: one at a time")
    t0 = time.monotonic()
    c.wait_for({"ready"}, START_S, revision=rev.revision)
    applied_s = time.monotonic() - t0
    one = bench(gpu_engine.url, concurrency=16, prompts=24, label="seqs1-c16")
    ready = [e for e in c.events(kinds=["ready"]) if e.revision == rev.revision][-1]
    report("max_num_seqs_1", {"apply_s": round(applied_s, 1), "bench": one, "ready_event": ready.data})
    assert one["completed"] == 24
