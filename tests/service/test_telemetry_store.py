"""Telemetry history on a real database (SQLite, or PostgreSQL on make test's second pass): roll-ups, retention,
and at most ~1,000 points per series."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.db import open_database
from engine.gpu import HOST, GpuReading, Snapshot, TelemetryStore
from engine.metrics import MAX_POINTS

pytestmark = pytest.mark.store
T0 = 1_800_000_000.0  # a fixed, minute-aligned clock


def snap(ts: float, util: float) -> Snapshot:
    gpus = [GpuReading(i, f"GPU-{i}", "H200", ts, values={"util_gpu": util + i, "mem_used": 1e9, "mem_total": 2e9})
            for i in range(2)]
    host = {"cpu_pct": 50.0, "mem_used": 4e9, "mem_total": 8e9, "vllm_rss": 1e9}
    return Snapshot(ts, True, None, gpus=gpus, host=host)


def fill(db_target: Path | str, seconds: int, raw_retention: float = 3600) -> TelemetryStore:
    history = TelemetryStore(open_database(db_target), raw_retention, 7 * 86400)
    history.series._last_rollup = T0
    for s in range(seconds):
        history.write(snap(T0 + s, util=float(s % 60)))
    return history


def test_hour_window_is_raw_and_capped(db_target: Path | str) -> None:
    history = fill(db_target, 3600)
    out = history.history(3600, now=T0 + 3600)
    assert out["source"] == "raw"
    assert set(out["devices"]) == {"0", "1", str(HOST)}
    gpu0 = out["devices"]["0"]
    assert len(gpu0["t"]) <= MAX_POINTS
    assert out["step_s"] == 4  # 3600 s / 1000 points, rounded up
    assert gpu0["util_gpu"]["min"][0] == 0 and gpu0["util_gpu"]["max"][0] == 3
    assert out["devices"][str(HOST)]["util_gpu"]["avg"][0] == 50.0


def test_short_window_keeps_one_second_points(db_target: Path | str) -> None:
    history = fill(db_target, 600)
    out = history.history(300, now=T0 + 600, devices=[0], metrics=["util_gpu"])
    assert out["step_s"] == 1 and list(out["devices"]) == ["0"] and out["metrics"] == ["util_gpu"]
    assert 299 <= len(out["devices"]["0"]["t"]) <= 301


def test_minute_rollups_serve_long_windows_and_raw_is_pruned(db_target: Path | str) -> None:
    history = fill(db_target, 2 * 3600 + 30, raw_retention=3600)
    with history.series.engine.connect() as conn:
        oldest = conn.exec_driver_sql("SELECT min(ts) FROM telemetry_raw").scalar()
        minutes = conn.exec_driver_sql("SELECT count(*) FROM telemetry_minute WHERE device = 0").scalar()
    assert oldest is not None and oldest >= T0 + 3600 - 60  # older raw rows pruned at a minute boundary
    assert minutes == 120
    out = history.history(7 * 86400, now=T0 + 7200)
    assert out["source"] == "minute" and out["step_s"] >= 60
    series = out["devices"]["0"]
    assert len(series["t"]) <= MAX_POINTS
    assert min(series["util_gpu"]["min"]) == 0 and max(series["util_gpu"]["max"]) == 59
    assert abs(series["util_gpu"]["avg"][0] - 29.5) < 1e-6
