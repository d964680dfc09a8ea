"""A scripted NVML test double: the pynvml calls the sampler makes, on GPUs whose failures a test decides.

Only for unit tests of failure paths (a GPU that vanishes, an unsupported call, an XID event, no driver): this
machine has no GPU. The real driver is exercised by the GPU tests (``pytest -m gpu``) on an H200.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total: int = 150_754_820_096
    reserved: int = 640_000_000
    used: int = 700_000_000
    util: int = 0
    mem_util: int = 0
    power_mw: int = 78_000
    limit_mw: int = 700_000
    energy_mj: int = 1_000_000
    temp: int = 30
    mem_temp: int = 35
    processes: list[tuple[int, int]] = field(default_factory=list)
    unsupported: set[str] = field(default_factory=set)  # NVML function names answering NotSupported
    lost: bool = False
    ecc_uncorrected: int = 0


class NvmlDouble:
    """Stands in for the ``pynvml`` module: same error classes and constants, scripted devices."""

    def __init__(self, gpus: list[FakeGpu], init_error: str | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.xids: list[tuple[int, int]] = []  # (gpu index, xid)
        self.calls: Counter[str] = Counter()  # NVML function name → times asked
        self.shutdown_called = False
        for name in dir(pynvml):
            if name.startswith(("NVMLError", "NVML_", "nvmlEventType", "nvmlMemory_v2")):
                setattr(self, name, getattr(pynvml, name))

    # --- session ----------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if self.init_error:
            raise pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        self.shutdown_called = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "580.159.04"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index >= len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return index

    # --- helpers ------------------------------------------------------------------------------------------

    def _gpu(self, handle: int, call: str) -> FakeGpu:
        self.calls[call] += 1
        gpu = self.gpus[handle]
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if call in gpu.unsupported:
            raise pynvml.NVMLError_NotSupported()
        return gpu

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.gpus[h].uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.gpus[h].name

    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> Any:
        g = self._gpu(h, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=g.total, reserved=g.reserved, used=g.used, free=g.total - g.used - g.reserved)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        g = self._gpu(h, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=g.util, memory=g.mem_util)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetEnforcedPowerLimit").limit_mw

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTotalEnergyConsumption").energy_mj

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._gpu(h, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        g = self._gpu(h, "nvmlDeviceGetFieldValues")
        return [SimpleNamespace(nvmlReturn=0, valueType=1, value=SimpleNamespace(uiVal=g.mem_temp))]

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        self._gpu(h, "nvmlDeviceGetClockInfo")
        return 1980 if clock == pynvml.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetFanSpeed(self, h: int) -> int:
        self._gpu(h, "nvmlDeviceGetFanSpeed")
        return 0

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        self._gpu(h, "nvmlDeviceGetPcieThroughput")
        return 1000

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        self._gpu(h, "nvmlDeviceGetCurrentClocksEventReasons")
        return 0x1

    def nvmlDeviceGetTotalEccErrors(self, h: int, err: int, counter: int) -> int:
        g = self._gpu(h, "nvmlDeviceGetTotalEccErrors")
        return g.ecc_uncorrected if err == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 0

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        self._gpu(h, "nvmlDeviceGetRemappedRows")
        return (0, 0, 0, 0)

    def nvmlDeviceGetRetiredPages(self, h: int, cause: int) -> list[int]:
        self._gpu(h, "nvmlDeviceGetRetiredPages")
        return []

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        g = self._gpu(h, "nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in g.processes]

    # --- XID events ---------------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, event_set: str) -> None:
        self._gpu(h, "nvmlDeviceRegisterEvents")

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        if not self.xids:
            raise pynvml.NVMLError_Timeout()
        index, xid = self.xids.pop(0)
        return SimpleNamespace(device=index, eventData=xid, eventType=pynvml.nvmlEventTypeXidCriticalError)
