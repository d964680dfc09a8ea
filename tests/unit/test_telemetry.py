"""The GPU sampler and its alerts, driven through the scripted NVML double (this machine has no GPU)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from engine.gpu import AlertEngine, AlertThresholds, Sampler, Snapshot
from tests.testkit.nvml_double import FakeGpu, NvmlDouble

GIB = 1 << 30


class Events:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, str, dict[str, Any]]] = []

    def __call__(self, kind: str, message: str, severity: str, data: dict[str, Any]) -> None:
        self.items.append((kind, message, severity, data))

    def kinds(self, alert: str | None = None) -> list[str]:
        return [k for k, _, _, d in self.items if alert is None or d.get("alert") == alert]


def make(gpus: list[FakeGpu], slow_every: int = 1, **kw: Any) -> tuple[Sampler, NvmlDouble, Events, AlertEngine]:
    nvml = NvmlDouble(gpus, **kw)
    events = Events()
    alerts = AlertEngine(AlertThresholds(power_hold_s=10, quiet_s=60), events)
    sampler = Sampler(nvml, 1.0, lambda: {os.getpid(): "demo"}, [alerts.evaluate], events, slow_every=slow_every)
    return sampler, nvml, events, alerts


def test_no_driver_says_so_and_reports_the_host() -> None:
    sampler, _, events, _ = make([], init_error="no lib")
    snap = sampler.tick()
    assert not snap.available and "NVML" in (snap.reason or "")
    assert snap.gpus == []
    assert snap.host["mem_total"] > 0 and snap.host["cpu_count"] >= 1
    assert snap.host["vllm_rss"] > 0  # our_pids here is the test process itself
    assert events.items == []


def test_readings_and_attribution_of_vllm_memory() -> None:
    gpu = FakeGpu("GPU-a", used=40 * GIB, processes=[(os.getpid(), 30 * GIB), (999_999, 8 * GIB)])
    sampler, _, _, _ = make([gpu, FakeGpu("GPU-b")])
    snap = sampler.tick()
    assert snap.available and snap.driver == "580.159.04"
    a = snap.gpus[0]
    assert a.values["mem_used"] == 40 * GIB and a.values["mem_reserved"] == 640_000_000
    assert a.values["power_w"] == 78.0 and a.values["power_limit_w"] == 700.0 and a.values["energy_j"] == 1000.0
    assert a.values["mem_temp_c"] == 35 and a.values["sm_clock_mhz"] == 1980
    assert a.values["vllm_mem"] == 30 * GIB
    assert [p["ours"] for p in a.processes] == [True, False]
    assert a.throttle_reasons == ["gpu_idle"]
    assert snap.gpus[1].values["vllm_mem"] == 0


def test_unsupported_call_is_not_available_with_reason_and_not_asked_again() -> None:
    gpu = FakeGpu("GPU-a", unsupported={"nvmlDeviceGetFanSpeed", "nvmlDeviceGetRemappedRows"})
    sampler, nvml, events, _ = make([gpu])
    first = sampler.tick().gpus[0]
    assert first.values["fan_pct"] is None and first.unavailable["fan"].startswith("not available")
    assert first.pages == {"retired_sbe": 0, "retired_dbe": 0}  # falls back to retired pages
    for _ in range(3):
        again = sampler.tick().gpus[0]
    assert again.unavailable["fan"].startswith("not available")
    assert nvml.calls["nvmlDeviceGetFanSpeed"] == 1  # learnt once, never asked again
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 4
    assert events.items == []


def test_costly_values_are_read_every_nth_tick_and_carried_over() -> None:
    gpu = FakeGpu("GPU-a")
    sampler, nvml, _, _ = make([gpu], slow_every=5)
    readings = [sampler.tick().gpus[0] for _ in range(10)]
    assert nvml.calls["nvmlDeviceGetTotalEnergyConsumption"] == 2
    assert nvml.calls["nvmlDeviceGetPcieThroughput"] == 4  # TX and RX, twice
    assert nvml.calls["nvmlDeviceGetPowerUsage"] == 10
    assert all(r.values["energy_j"] == 1000.0 and r.ecc["uncorrected_volatile"] == 0 for r in readings)


def test_lost_gpu_is_raised_once_and_cleared_once_while_sampling_goes_on() -> None:
    gpus = [FakeGpu("GPU-a"), FakeGpu("GPU-b")]
    sampler, _, events, alerts = make(gpus)
    sampler.tick()
    gpus[1].lost = True
    for _ in range(3):
        snap = sampler.tick()
        assert snap.gpus[0].values["mem_used"] is not None  # the healthy GPU is still read
        assert snap.gpus[1].lost
    assert events.kinds("gpu_lost") == ["alert_raised"]
    assert events.items[0][2] == "critical"
    assert [a["alert"] for a in alerts.snapshot()] == ["gpu_lost"]
    gpus[1].lost = False
    sampler.tick()
    sampler.tick()
    assert events.kinds("gpu_lost") == ["alert_raised", "alert_cleared"]


def test_gpu_that_vanishes_from_the_device_list_is_lost() -> None:
    gpus = [FakeGpu("GPU-a"), FakeGpu("GPU-b")]
    sampler, nvml, events, _ = make(gpus)
    sampler.tick()
    nvml.gpus = gpus[:1]
    snap = sampler.tick()
    assert [g.lost for g in snap.gpus] == [False, True]
    assert events.kinds("gpu_lost") == ["alert_raised"]


def test_xid_event_raises_an_alert_that_clears_after_quiet_time() -> None:
    sampler, nvml, events, alerts = make([FakeGpu("GPU-a"), FakeGpu("GPU-b")])
    nvml.xids.append((1, 79))
    snap = sampler.tick()
    assert snap.xids[0]["gpu"] == 1 and snap.xids[0]["xid"] == 79
    assert events.kinds("xid_error") == ["alert_raised"]
    assert "XID 79" in events.items[-1][1]
    sampler.tick()
    assert events.kinds("xid_error") == ["alert_raised"]
    later = Snapshot(snap.ts + 61, True, None, gpus=[], host={})
    alerts.evaluate(later)
    assert events.kinds("xid_error") == ["alert_raised", "alert_cleared"]


def test_ecc_errors_raise_an_alert() -> None:
    gpus = [FakeGpu("GPU-a")]
    sampler, _, events, _ = make(gpus)
    sampler.tick()
    gpus[0].ecc_uncorrected = 2
    sampler.tick()
    assert events.kinds("ecc_error") == ["alert_raised"]
    assert "2 new" in events.items[-1][1]


def level_snapshot(ts: float, **values: float) -> Snapshot:
    from engine.gpu import GpuReading

    base = {"mem_used": 10 * GIB, "mem_total": 100 * GIB, "temp_c": 40.0, "power_w": 100.0, "power_limit_w": 700.0}
    return Snapshot(ts, True, None, gpus=[GpuReading(0, "GPU-a", "H200", ts, values={**base, **values})], host={})


@pytest.mark.parametrize(("metric", "alert", "high", "middle", "low"), [
    ("mem_used", "memory_high", 96 * GIB, 93 * GIB, 89 * GIB),
    ("temp_c", "temperature_high", 90.0, 83.0, 79.0),
])
def test_level_alerts_have_hysteresis(metric: str, alert: str, high: float, middle: float, low: float) -> None:
    events = Events()
    engine = AlertEngine(AlertThresholds(), events)
    for t, value in enumerate([high, high, middle, high, middle, low, low]):
        engine.evaluate(level_snapshot(1000.0 + t, **{metric: value}))
    assert events.kinds(alert) == ["alert_raised", "alert_cleared"]


def test_power_alert_needs_the_limit_held_for_n_seconds() -> None:
    events = Events()
    engine = AlertEngine(AlertThresholds(power_hold_s=10), events)
    for t in range(0, 9):
        engine.evaluate(level_snapshot(1000.0 + t, power_w=695.0))
    assert events.kinds("power_at_limit") == []
    engine.evaluate(level_snapshot(1000.0 + 9, power_w=300.0))  # a dip restarts the count
    for t in range(10, 21):
        engine.evaluate(level_snapshot(1000.0 + t, power_w=699.0))
    assert events.kinds("power_at_limit") == ["alert_raised"]
    engine.evaluate(level_snapshot(1030.0, power_w=200.0))
    assert events.kinds("power_at_limit") == ["alert_raised", "alert_cleared"]


def test_sampler_reports_its_rate_and_cost() -> None:
    sampler, _, _, _ = make([FakeGpu(f"GPU-{i}") for i in range(8)])
    for _ in range(5):
        sampler.tick()
    stats = sampler.stats()
    assert stats["tick_cpu_ms"] is not None and stats["tick_cpu_ms"] > 0
    assert stats["samples_per_s"] is not None
