"""Reading GPUs through NVML (nvidia-ml-py, imported as ``pynvml``).

Every call goes through ``_read``: a call that NVML does not support on a GPU yields "not available" with the
reason, once learnt and never asked again; a GPU that is lost, or a driver error, is reported in the reading,
never raised through it. The NVML module is injected, so that unit tests can script its failures.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("llmops.nvml")

# Clock-event (throttle) reason bits, as NVML names them.
THROTTLE_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the GPU is held back, not merely idle or configured.
SLOWDOWN_REASONS = {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
                    "hw_power_brake_slowdown"}


# Scalar readings: metric, key for "not available", NVML call, scale to the unit of the metric. Fast ones are
# read every tick; slow ones (costly calls, or values that change slowly) every ``slow_every`` ticks. Measured on an
# H200 (driver 580): nvmlDeviceGetPcieThroughput blocks for 20 ms (it samples a counter over that window) and
# nvmlDeviceGetTotalEnergyConsumption costs about 6 ms; the fast calls cost tens of microseconds.
_Scalar = tuple[str, str, Callable[[Any, Any], Any], float]
_FAST: tuple[_Scalar, ...] = (
    ("power_w", "power", lambda nv, h: nv.nvmlDeviceGetPowerUsage(h), 1e-3),  # mW
    ("temp_c", "temperature", lambda nv, h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), 1.0),
    ("sm_clock_mhz", "sm_clock", lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1.0),
    ("mem_clock_mhz", "mem_clock", lambda nv, h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM), 1.0),
)
_SLOW: tuple[_Scalar, ...] = (
    ("power_limit_w", "power_limit", lambda nv, h: nv.nvmlDeviceGetEnforcedPowerLimit(h), 1e-3),  # mW
    ("energy_j", "energy", lambda nv, h: nv.nvmlDeviceGetTotalEnergyConsumption(h), 1e-3),  # mJ
    ("fan_pct", "fan", lambda nv, h: nv.nvmlDeviceGetFanSpeed(h), 1.0),
    ("pcie_tx_kbs", "pcie_tx", lambda nv, h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES), 1.0),
    ("pcie_rx_kbs", "pcie_rx", lambda nv, h: nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES), 1.0),
)

# nvmlValueType_t → the member of the value union that holds it.
_VALUE_TYPES = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}


class GpuLostError(Exception):
    """The GPU stopped answering (NVML: GPU is lost, or its handle became invalid)."""


@dataclass
class GpuReading:
    index: int
    uuid: str
    name: str
    ts: float
    values: dict[str, float | None] = field(default_factory=dict)
    unavailable: dict[str, str] = field(default_factory=dict)
    throttle_reasons: list[str] = field(default_factory=list)
    ecc: dict[str, int | None] = field(default_factory=dict)
    pages: dict[str, int | None] = field(default_factory=dict)
    processes: list[dict[str, Any]] = field(default_factory=list)
    lost: bool = False
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "uuid": self.uuid, "name": self.name, "ts": self.ts, "lost": self.lost,
            "error": self.error, "values": self.values, "unavailable": self.unavailable,
            "throttle_reasons": self.throttle_reasons, "ecc": self.ecc, "pages": self.pages,
            "processes": self.processes,
        }


class GpuReader:
    """Reads one GPU each tick; remembers which calls the GPU does not support."""

    def __init__(self, nvml: Any, index: int) -> None:
        self.nvml = nvml
        self.index = index
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
        self.uuid = _text(nvml.nvmlDeviceGetUUID(self.handle))
        self.name = _text(nvml.nvmlDeviceGetName(self.handle))
        self._unsupported: dict[str, str] = {}
        self._slow: tuple[dict[str, float | None], dict[str, int | None], dict[str, int | None]] | None = None

    def _read(self, reading: GpuReading, key: str, call: Callable[[], Any]) -> Any:
        if key in self._unsupported:
            reading.unavailable[key] = self._unsupported[key]
            return None
        nv = self.nvml
        try:
            return call()
        except nv.NVMLError as exc:
            if isinstance(exc, nv.NVMLError_GpuIsLost):
                raise GpuLostError(str(exc)) from exc
            reason = str(exc) or type(exc).__name__
            if isinstance(exc, nv.NVMLError_NotSupported | nv.NVMLError_NoPermission | nv.NVMLError_FunctionNotFound):
                self._unsupported[key] = f"not available: {reason}"
            reading.unavailable[key] = f"not available: {reason}"
            return None

    def read(self, ours: Mapping[int, str | None], slow: bool = True) -> GpuReading:
        """One reading. ``ours``: the pids of the engine's vLLM instances, each with the deployment it serves
        (so each process's memory is attributed). ``slow``: also read the slowly changing or costly values
        (energy, ECC, pages, PCIe throughput, fan, power limit); between slow reads their last values are carried
        over."""
        nv, h = self.nvml, self.handle
        r = GpuReading(self.index, self.uuid, self.name, time.time())
        v = r.values

        mem = self._read(r, "memory", lambda: nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2))
        if mem is None:
            mem = self._read(r, "memory_v1", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            v["mem_used"], v["mem_total"] = float(mem.used), float(mem.total)
            v["mem_reserved"] = float(getattr(mem, "reserved", 0) or 0)
        util = self._read(r, "utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            v["util_gpu"], v["util_mem"] = float(util.gpu), float(util.memory)
        for metric, key, call, scale in _FAST:
            v[metric] = _scale(self._read(r, key, functools.partial(call, nv, h)), scale)
        v["mem_temp_c"] = self._field_value(r, "memory_temperature", nv.NVML_FI_DEV_MEMORY_TEMP)
        bits = self._read(r, "throttle_reasons", lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h))
        if bits is not None:
            r.throttle_reasons = [name for bit, name in THROTTLE_REASONS.items() if int(bits) & bit]

        if slow or self._slow is None:
            self._slow = self._read_slow(r)
        slow_values, r.ecc, r.pages = self._slow
        v.update(slow_values)
        r.unavailable.update({k: m for k, m in self._unsupported.items() if k not in r.unavailable})

        procs = self._read(r, "processes", lambda: nv.nvmlDeviceGetComputeRunningProcesses(h))
        vllm_mem = 0.0
        for p in procs or []:
            used = getattr(p, "usedGpuMemory", None)
            mine = int(p.pid) in ours
            r.processes.append({"pid": int(p.pid), "used_memory": None if used is None else int(used), "ours": mine,
                                "deployment": ours.get(int(p.pid)) if mine else None})
            if mine and used:
                vllm_mem += float(used)
        v["vllm_mem"] = vllm_mem if procs is not None else None
        return r

    def _read_slow(self, r: GpuReading) -> tuple[dict[str, float | None], dict[str, int | None],
                                                  dict[str, int | None]]:
        nv, h = self.nvml, self.handle
        values = {metric: _scale(self._read(r, key, functools.partial(call, nv, h)), scale)
                  for metric, key, call, scale in _SLOW}
        ecc: dict[str, int | None] = {}
        for err_type, err_name in ((nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, "corrected"),
                                   (nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "uncorrected")):
            for counter, counter_name in ((nv.NVML_VOLATILE_ECC, "volatile"), (nv.NVML_AGGREGATE_ECC, "aggregate")):
                key = f"{err_name}_{counter_name}"
                call = functools.partial(nv.nvmlDeviceGetTotalEccErrors, h, err_type, counter)
                ecc[key] = _int(self._read(r, f"ecc_{key}", call))
        pages: dict[str, int | None] = {}
        rows = self._read(r, "remapped_rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, pending, failure = (int(x) for x in rows)
            pages.update(remapped_correctable=corr, remapped_uncorrectable=unc, remap_pending=pending,
                         remap_failure=failure)
        else:
            for cause, name in ((nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS, "retired_sbe"),
                                (nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR, "retired_dbe")):
                retired = self._read(r, name, functools.partial(nv.nvmlDeviceGetRetiredPages, h, cause))
                pages[name] = None if retired is None else len(retired)
        return values, ecc, pages

    def _field_value(self, reading: GpuReading, key: str, field_id: int) -> float | None:
        nv = self.nvml
        values = self._read(reading, key, lambda: nv.nvmlDeviceGetFieldValues(self.handle, [field_id]))
        if not values:
            return None
        fv = values[0]
        if getattr(fv, "nvmlReturn", 0) != 0:
            self._unsupported[key] = "not available: field not supported by this GPU"
            reading.unavailable[key] = self._unsupported[key]
            return None
        attr = _VALUE_TYPES.get(int(getattr(fv, "valueType", 1)), "uiVal")
        return float(getattr(fv.value, attr))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _scale(value: Any, factor: float) -> float | None:
    return None if value is None else float(value) * factor
