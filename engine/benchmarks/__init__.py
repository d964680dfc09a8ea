"""Benchmarks: sweeps and the guided search around vLLM's own benchmark module, stored per revision."""

from __future__ import annotations

from engine.benchmarks.runner import RESULT_PREFIX
from engine.benchmarks.runs import PRESETS, BenchmarkBusyError, Benchmarks, lengths, propose

__all__ = ["PRESETS", "RESULT_PREFIX", "BenchmarkBusyError", "BenchmarkRun", "Benchmarks", "lengths", "propose"]
