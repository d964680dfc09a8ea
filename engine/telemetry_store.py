"""Telemetry history in SQLite: raw samples for the last hour, per-minute min/avg/max for 7 days (configurable).

One wide row per device and sample: the GPUs by index, and the host as device -1 (its CPU % in ``util_gpu``, its
RAM in ``mem_*``, vLLM's resident memory in ``vllm_mem``) so that a machine without a GPU has a history too.
Queries bucket the rows so that a series never has more than about 1,000 points, whatever the window.
"""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy import Column, Engine, Float, Index, Integer, MetaData, Table, cast, func, insert, select

from engine.migrate import add_missing_columns
from engine.telemetry import Snapshot

HOST = -1
METRICS: tuple[str, ...] = (
    "mem_used", "mem_total", "util_gpu", "util_mem", "power_w", "power_limit_w", "energy_j", "temp_c",
    "mem_temp_c", "sm_clock_mhz", "mem_clock_mhz", "fan_pct", "pcie_tx_kbs", "pcie_rx_kbs", "vllm_mem",
)
MAX_POINTS = 1000

metadata = MetaData()
raw = Table(
    "telemetry_raw", metadata,
    Column("ts", Float, nullable=False), Column("device", Integer, nullable=False),
    *(Column(m, Float) for m in METRICS),
    Index("ix_telemetry_raw_ts", "ts"),
)
minute = Table(
    "telemetry_minute", metadata,
    Column("ts", Float, nullable=False), Column("device", Integer, nullable=False), Column("n", Integer),
    *(Column(f"{m}_{agg}", Float) for m in METRICS for agg in ("min", "avg", "max")),
    Index("ix_telemetry_minute_ts", "ts"),
)


def rows_of(snap: Snapshot) -> list[dict[str, Any]]:
    rows = []
    for gpu in snap.gpus:
        if gpu.lost:
            continue
        rows.append({"ts": snap.ts, "device": gpu.index, **{m: gpu.values.get(m) for m in METRICS}})
    if snap.host:
        h = snap.host
        rows.append({"ts": snap.ts, "device": HOST, **dict.fromkeys(METRICS), "util_gpu": h["cpu_pct"],
                     "mem_used": h["mem_used"], "mem_total": h["mem_total"], "vllm_mem": h["vllm_rss"]})
    return rows


class TelemetryStore:
    def __init__(self, engine: Engine, raw_retention_s: float, minute_retention_s: float) -> None:
        self.engine = engine
        self.raw_retention_s = raw_retention_s
        self.minute_retention_s = minute_retention_s
        add_missing_columns(engine, metadata)
        self._last_rollup = float(math.floor(time.time() / 60) * 60)

    def write(self, snap: Snapshot) -> None:
        rows = rows_of(snap)
        with self.engine.begin() as conn:
            if rows:
                conn.execute(insert(raw), rows)
            boundary = float(math.floor(snap.ts / 60) * 60)
            if boundary > self._last_rollup:
                self._rollup(conn, self._last_rollup, boundary)
                self._last_rollup = boundary
                conn.execute(raw.delete().where(raw.c.ts < snap.ts - self.raw_retention_s))
                conn.execute(minute.delete().where(minute.c.ts < snap.ts - self.minute_retention_s))

    def _rollup(self, conn: Any, start: float, end: float) -> None:
        """Aggregate the raw rows of [start, end) into one row per device and minute."""
        bucket = (cast(raw.c.ts / 60, Integer) * 60).label("bucket")
        cols = [bucket, raw.c.device, func.count().label("n")]
        for m in METRICS:
            cols += [func.min(raw.c[m]).label(f"{m}_min"), func.avg(raw.c[m]).label(f"{m}_avg"),
                     func.max(raw.c[m]).label(f"{m}_max")]
        q = select(*cols).where(raw.c.ts >= start, raw.c.ts < end).group_by(bucket, raw.c.device)
        rows = [dict(r._mapping) for r in conn.execute(q)]
        for r in rows:
            r["ts"] = r.pop("bucket")
        if rows:
            conn.execute(insert(minute), rows)

    def history(self, window_s: float, step_s: float | None = None, devices: list[int] | None = None,
                metrics: list[str] | None = None, now: float | None = None) -> dict[str, Any]:
        """Series of each device over the last ``window_s``: per bucket the min, avg and max of each metric."""
        now = time.time() if now is None else now
        metrics = [m for m in (metrics or list(METRICS)) if m in METRICS]
        use_raw = window_s <= self.raw_retention_s
        floor_step = 1.0 if use_raw else 60.0
        step = max(step_s or 0.0, floor_step, math.ceil(window_s / MAX_POINTS))
        if not use_raw:
            step = math.ceil(step / 60) * 60
        table = raw if use_raw else minute
        bucket = (cast(table.c.ts / step, Integer) * step).label("bucket")
        cols: list[Any] = [bucket, table.c.device]
        for m in metrics:
            if use_raw:
                cols += [func.min(table.c[m]), func.avg(table.c[m]), func.max(table.c[m])]
            else:
                cols += [func.min(table.c[f"{m}_min"]),
                         func.sum(table.c[f"{m}_avg"] * table.c.n) / func.sum(table.c.n),
                         func.max(table.c[f"{m}_max"])]
        q = select(*cols).where(table.c.ts >= now - window_s).group_by(bucket, table.c.device).order_by(
            table.c.device, bucket)
        if devices:
            q = q.where(table.c.device.in_(devices))
        out: dict[str, Any] = {}
        with self.engine.connect() as conn:
            for row in conn.execute(q):
                dev = str(row[1])
                series = out.setdefault(dev, {"t": [], **{m: {"min": [], "avg": [], "max": []} for m in metrics}})
                series["t"].append(float(row[0]))
                for i, m in enumerate(metrics):
                    lo, avg, hi = row[2 + 3 * i: 5 + 3 * i]
                    series[m]["min"].append(lo)
                    series[m]["avg"].append(None if avg is None else round(float(avg), 3))
                    series[m]["max"].append(hi)
        return {"window_s": window_s, "step_s": step, "source": "raw" if use_raw else "minute",
                "metrics": metrics, "devices": out}
