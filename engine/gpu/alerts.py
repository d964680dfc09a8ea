"""GPU alerts with hysteresis: each condition is raised once when it starts and cleared once when it ends.

Thresholds come from the engine's configuration. Level conditions (memory, temperature, power at its limit) clear
below a lower threshold, so a value hovering at the edge does not flap. Discrete faults (XID, ECC errors) clear
after a quiet period without a new one; a lost GPU clears when it answers again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.gpu.sampler import Snapshot

Emit = Callable[[str, str, str, dict[str, Any]], None]


@dataclass(frozen=True)
class AlertThresholds:
    memory_pct: float = 95.0
    memory_clear_pct: float = 90.0
    temperature_c: float = 85.0
    temperature_clear_c: float = 80.0
    power_limit_fraction: float = 0.98
    power_clear_fraction: float = 0.95
    power_hold_s: float = 30.0
    quiet_s: float = 600.0


@dataclass
class ActiveAlert:
    name: str
    gpu: int
    severity: str
    since: float
    message: str
    last_seen: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        return {"alert": self.name, "gpu": self.gpu, "severity": self.severity, "since": self.since,
                "message": self.message}


class AlertEngine:
    def __init__(self, thresholds: AlertThresholds, emit: Emit) -> None:
        self.t = thresholds
        self.emit = emit
        self.active: dict[tuple[str, int], ActiveAlert] = {}
        self._power_since: dict[int, float] = {}
        self._ecc_seen: dict[int, int] = {}

    def evaluate(self, snap: Snapshot) -> None:
        now = snap.ts
        for gpu in snap.gpus:
            i = gpu.index
            if gpu.lost:
                self._raise("gpu_lost", i, "critical", f"GPU {i} ({gpu.uuid}) is lost: {gpu.error}", now)
                continue
            self._clear("gpu_lost", i, f"GPU {i} answers again", now)
            v = gpu.values
            used, total = v.get("mem_used"), v.get("mem_total")
            if used is not None and total:
                pct = 100 * used / total
                if pct > self.t.memory_pct:
                    self._raise("memory_high", i, "warning",
                                f"GPU {i} memory at {pct:.1f} % of {total / 2**30:.1f} GiB "
                                f"(threshold {self.t.memory_pct:.0f} %)", now, {"value": pct})
                elif pct < self.t.memory_clear_pct:
                    self._clear("memory_high", i, f"GPU {i} memory back to {pct:.1f} %", now)
            temp = v.get("temp_c")
            if temp is not None:
                if temp >= self.t.temperature_c:
                    self._raise("temperature_high", i, "warning",
                                f"GPU {i} at {temp:.0f} °C (threshold {self.t.temperature_c:.0f} °C)", now,
                                {"value": temp})
                elif temp <= self.t.temperature_clear_c:
                    self._clear("temperature_high", i, f"GPU {i} cooled to {temp:.0f} °C", now)
            self._power(i, v.get("power_w"), v.get("power_limit_w"), now)
            self._ecc(i, gpu.ecc, gpu.pages, now)
        for xid in snap.xids:
            self._raise("xid_error", int(xid["gpu"]), "critical", f"GPU {xid['gpu']} reported XID {xid['xid']}",
                        now, {"xid": xid["xid"]}, refresh=True)
        for (name, gpu_index), alert in list(self.active.items()):
            if name in ("xid_error", "ecc_error") and now - alert.last_seen >= self.t.quiet_s:
                self._clear(name, gpu_index, f"no new {name.split('_')[0].upper()} error on GPU {gpu_index} for "
                            f"{self.t.quiet_s:.0f} s", now)

    def _power(self, i: int, power: float | None, limit: float | None, now: float) -> None:
        if power is None or not limit:
            return
        if power >= self.t.power_limit_fraction * limit:
            since = self._power_since.setdefault(i, now)
            if now - since >= self.t.power_hold_s:
                self._raise("power_at_limit", i, "warning",
                            f"GPU {i} has drawn {power:.0f} W of its {limit:.0f} W limit for {now - since:.0f} s",
                            now, {"value": power, "limit": limit})
        else:
            self._power_since.pop(i, None)
            if power < self.t.power_clear_fraction * limit:
                self._clear("power_at_limit", i, f"GPU {i} power back to {power:.0f} W", now)

    def _ecc(self, i: int, ecc: dict[str, int | None], pages: dict[str, int | None], now: float) -> None:
        bad = sum(x or 0 for x in (ecc.get("uncorrected_volatile"), pages.get("remapped_uncorrectable"),
                                   pages.get("retired_dbe"), pages.get("remap_failure")))
        seen = self._ecc_seen.get(i)
        self._ecc_seen[i] = bad
        if seen is not None and bad > seen:
            self._raise("ecc_error", i, "critical", f"GPU {i}: {bad - seen} new uncorrectable memory error(s)",
                        now, {"value": bad}, refresh=True)

    def _raise(self, name: str, gpu: int, severity: str, message: str, now: float,
               data: dict[str, Any] | None = None, refresh: bool = False) -> None:
        key = (name, gpu)
        if key in self.active:
            if refresh:
                self.active[key].last_seen = now
            return
        self.active[key] = ActiveAlert(name, gpu, severity, now, message, now)
        self.emit("alert_raised", message, severity, {"alert": name, "gpu": gpu, **(data or {})})

    def _clear(self, name: str, gpu: int, message: str, now: float) -> None:
        alert = self.active.pop((name, gpu), None)
        if alert is not None:
            self.emit("alert_cleared", message, "info",
                      {"alert": name, "gpu": gpu, "duration_s": round(now - alert.since, 1)})

    def snapshot(self) -> list[dict[str, Any]]:
        return [a.as_dict() for a in self.active.values()]
