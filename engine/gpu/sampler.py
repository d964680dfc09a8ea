"""GPU telemetry: one NVML session per process, sampled on a background thread (1 Hz by default).

Each tick reads every GPU (``engine/nvml_reader.py``), the host's CPU and memory (psutil; where the CPU build of
vLLM runs, the host *is* the device), drains NVML's XID events, and hands the snapshot to its consumers: the
history store and the alert rules. Without a GPU or driver, the snapshot says so with NVML's own reason and never
carries invented GPU numbers.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil

from engine.gpu.nvml import GpuLostError, GpuReader, GpuReading

log = logging.getLogger("llmops.telemetry")
Emit = Callable[[str, str, str, dict[str, Any]], None]  # kind, message, severity, data


@dataclass
class Snapshot:
    ts: float
    available: bool
    reason: str | None
    driver: str | None = None
    gpus: list[GpuReading] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)
    xids: list[dict[str, Any]] = field(default_factory=list)


def host_reading(ours: Mapping[int, str | None]) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    rss = 0
    cpu = 0.0
    by_deployment: dict[str, float] = {}
    for pid, deployment in ours.items():
        try:
            proc = _proc(pid)
            held = proc.memory_info().rss
            rss += held
            cpu += proc.cpu_percent(None)
        except psutil.Error:
            continue
        if deployment is not None:
            by_deployment[deployment] = by_deployment.get(deployment, 0.0) + float(held)
    load = psutil.getloadavg()
    return {
        "cpu_pct": psutil.cpu_percent(None),
        "cpu_count": psutil.cpu_count() or 0,
        "load_1m": load[0],
        "mem_total": float(vm.total),
        "mem_used": float(vm.total - vm.available),
        "mem_available": float(vm.available),
        "vllm_rss": float(rss),
        "vllm_rss_by_deployment": by_deployment,
        "vllm_cpu_pct": cpu,
    }


_procs: dict[int, psutil.Process] = {}


def _proc(pid: int) -> psutil.Process:
    # psutil measures cpu_percent between calls on the same Process object: keep them.
    proc = _procs.get(pid)
    if proc is None or not proc.is_running():
        proc = _procs[pid] = psutil.Process(pid)
    return proc


class Sampler:
    """Samples on a daemon thread; ``latest`` is always the newest snapshot."""

    def __init__(self, nvml: Any, interval_s: float, our_pids: Callable[[], Mapping[int, str | None]],
                 consumers: list[Callable[[Snapshot], None]], emit: Emit, slow_every: int = 10) -> None:
        self.nvml = nvml
        self.interval_s = interval_s
        self.our_pids = our_pids
        self.consumers = consumers
        self.emit = emit
        self.slow_every = slow_every
        self._ticks = 0
        self.latest = Snapshot(time.time(), False, "sampler not started")
        self._readers: dict[str, GpuReader] = {}  # by UUID
        self._lost: set[str] = set()  # GPUs whose calls answer "GPU is lost"
        self._vanished: set[str] = set()  # GPUs no longer in NVML's device list
        self._errors: dict[str, str] = {}  # last driver error per GPU, to report each once
        self._events: Any = None
        self._initialised = False
        self._init_error: str | None = None
        self._next_init = 0.0
        self._driver: str | None = None
        self._count = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tick_cpu_s: deque[float] = deque(maxlen=600)
        self.tick_times: deque[float] = deque(maxlen=600)

    # --- lifecycle ------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.tick()  # the first sample is there before anyone asks (pre-flight reads the device from it)
        self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._initialised:
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as exc:
                log.warning("nvmlShutdown: %s", exc)

    def _loop(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            self.tick()
            next_tick += self.interval_s
            delay = next_tick - time.monotonic()
            if delay < 0:  # fell behind (slow driver call): skip, don't burst
                next_tick = time.monotonic()
                delay = 0
            self._stop.wait(delay)

    # --- one tick -------------------------------------------------------------------------------------------

    def tick(self) -> Snapshot:
        cpu0 = time.thread_time()
        ours = self.our_pids()
        snap = self._sample(ours)
        self.latest = snap
        for consumer in self.consumers:
            try:
                consumer(snap)
            except Exception:  # a failing consumer must not stop sampling; it is logged
                log.exception("telemetry consumer %r failed", consumer)
        self.tick_cpu_s.append(time.thread_time() - cpu0)
        self.tick_times.append(time.monotonic())
        return snap

    def _sample(self, ours: Mapping[int, str | None]) -> Snapshot:
        now = time.time()
        host = host_reading(ours)
        if not self._ensure_init():
            return Snapshot(now, False, self._init_error, host=host)
        nv = self.nvml
        try:
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as exc:
            if self._errors.get("*") != str(exc):
                self._errors["*"] = str(exc)
                self.emit("gpu_driver_error", f"NVML could not count GPUs: {exc}", "error", {"error": str(exc)})
            return Snapshot(now, False, f"NVML error: {exc}", self._driver, host=host)
        self._discover(count)
        gpus: list[GpuReading] = []
        for uuid, reader in list(self._readers.items()):
            if uuid in self._vanished:
                gpus.append(GpuReading(reader.index, uuid, reader.name, now, lost=True,
                                       error="disappeared from NVML's device list"))
                continue
            try:
                gpus.append(reader.read(ours, slow=self._ticks % self.slow_every == 0))
                self._lost.discard(uuid)
                self._errors.pop(uuid, None)
            except GpuLostError as exc:
                self._lost.add(uuid)
                gpus.append(GpuReading(reader.index, uuid, reader.name, now, lost=True, error=str(exc)))
            except nv.NVMLError as exc:
                gpus.append(GpuReading(reader.index, uuid, reader.name, now, error=str(exc)))
                if self._errors.get(uuid) != str(exc):  # an event per new error, not per tick
                    self._errors[uuid] = str(exc)
                    self.emit("gpu_driver_error", f"GPU {reader.index}: NVML error {exc}", "error",
                              {"gpu": reader.index, "uuid": uuid, "error": str(exc)})
        self._ticks += 1
        gpus.sort(key=lambda g: g.index)
        return Snapshot(now, True, None, self._driver, gpus, host, self._drain_xids())

    def _ensure_init(self) -> bool:
        if self._initialised:
            return True
        if time.monotonic() < self._next_init:
            return False
        nv = self.nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            self._init_error = f"NVML unavailable: {exc}"
            self._next_init = time.monotonic() + 60  # a driver may appear later; don't retry every tick
            return False
        self._initialised = True
        try:
            self._driver = _text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError:
            self._driver = None
        return True

    def _discover(self, count: int) -> None:
        """Readers for GPUs seen for the first time; a known GPU that vanished from the count is lost.

        Runs when the count changes or a GPU is lost, not every tick."""
        if count == self._count and not self._lost and not self._vanished:
            return
        self._count = count
        nv = self.nvml
        seen: set[str] = set()
        for index in range(count):
            try:
                reader = GpuReader(nv, index)
            except nv.NVMLError as exc:
                log.warning("GPU %d: %s", index, exc)
                continue
            seen.add(reader.uuid)
            if reader.uuid not in self._readers:
                self._readers[reader.uuid] = reader
                self._register_xid(reader)
            else:
                self._readers[reader.uuid].handle = reader.handle
        self._vanished = set(self._readers) - seen

    def _register_xid(self, reader: GpuReader) -> None:
        nv = self.nvml
        try:
            if self._events is None:
                self._events = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(reader.handle, nv.nvmlEventTypeXidCriticalError, self._events)
        except nv.NVMLError as exc:
            log.info("GPU %d: XID events not available: %s", reader.index, exc)

    def _drain_xids(self) -> list[dict[str, Any]]:
        if self._events is None:
            return []
        nv = self.nvml
        out: list[dict[str, Any]] = []
        for _ in range(64):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError_Timeout:
                break
            except nv.NVMLError as exc:
                log.warning("XID event wait: %s", exc)
                break
            index = next((r.index for r in self._readers.values() if _same(r.handle, data.device)), -1)
            out.append({"gpu": index, "xid": int(data.eventData), "ts": time.time()})
        return out

    def energy_now(self) -> float | None:
        """Joules of the energy counters of all GPUs, read now (for tokens per joule); None without GPUs."""
        if not self._initialised or not self._readers:
            return None
        total = 0.0
        for reader in list(self._readers.values()):  # the sampler thread may add a GPU meanwhile
            try:
                total += float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(reader.handle)) / 1000
            except self.nvml.NVMLError:
                return None
        return total

    # --- what the API reports about the sampler itself --------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        ticks = list(self.tick_times)
        rate = (len(ticks) - 1) / (ticks[-1] - ticks[0]) if len(ticks) > 2 and ticks[-1] > ticks[0] else None
        cpu = list(self.tick_cpu_s)
        mean_cpu = sum(cpu) / len(cpu) if cpu else None
        return {
            "interval_s": self.interval_s,
            "samples_per_s": None if rate is None else round(rate, 3),
            "tick_cpu_ms": None if mean_cpu is None else round(mean_cpu * 1e3, 3),
            "cpu_pct_of_core": None if mean_cpu is None else round(100 * mean_cpu / self.interval_s, 3),
        }


def _same(a: Any, b: Any) -> bool:
    """Two NVML device handles (ctypes pointers) name the same GPU."""
    try:
        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return bool(a == b)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
