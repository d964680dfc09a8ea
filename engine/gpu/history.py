"""Telemetry history: the GPUs by index and the host as device -1 (its CPU % in ``util_gpu``, its RAM in
``mem_*``, vLLM's resident memory in ``vllm_mem``), so that a machine without a GPU has a history too."""

from __future__ import annotations

from typing import Any

from engine.db import TELEMETRY_METRICS, TELEMETRY_MINUTE, TELEMETRY_RAW, Database
from engine.gpu.sampler import Snapshot
from engine.metrics import SeriesStore

HOST = -1
METRICS = TELEMETRY_METRICS


def rows_of(snap: Snapshot) -> list[dict[str, Any]]:
    rows = [{"device": g.index, **{m: g.values.get(m) for m in METRICS}} for g in snap.gpus if not g.lost]
    if snap.host:
        h = snap.host
        rows.append({"device": HOST, **dict.fromkeys(METRICS), "util_gpu": h["cpu_pct"], "mem_used": h["mem_used"],
                     "mem_total": h["mem_total"], "vllm_mem": h["vllm_rss"]})
    return rows


class TelemetryStore:
    def __init__(self, db: Database, raw_retention_s: float, minute_retention_s: float) -> None:
        self.series = SeriesStore(db, TELEMETRY_RAW, TELEMETRY_MINUTE, "device", METRICS, raw_retention_s,
                                  minute_retention_s)

    @property
    def minute_retention_s(self) -> float:
        return self.series.minute_retention_s

    def write(self, snap: Snapshot) -> None:
        self.series.write(snap.ts, rows_of(snap))

    def history(self, window_s: float, step_s: float | None = None, devices: list[int] | None = None,
                metrics: list[str] | None = None, now: float | None = None) -> dict[str, Any]:
        out = self.series.history(window_s, step_s, devices, metrics, now)
        out["devices"] = out.pop("series")
        return out
