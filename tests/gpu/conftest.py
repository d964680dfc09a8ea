"""GPU tests (``pytest -m gpu``): the real sampler on the real NVIDIA driver, the real engine and the real vLLM.

Skipped where NVML finds no GPU. On the H200 they serve a Llama-3-8B-shaped model with dummy weights
(``LLMOPS_GPU_MODEL``, written by ../shared/gpu/make_shape_model.py). The data dir (``LLMOPS_GPU_DATA_DIR``)
outlives one pytest run, so a later run on the same machine starts calibrated. Figures go to
``LLMOPS_GPU_REPORT_DIR`` as JSON for docs/gpu-validation.md. The engine comes from the same harness as the CPU
suites (tests/testkit/engine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tests.testkit.engine import REPO, EngineHandle, running_engine

MODEL = os.environ.get("LLMOPS_GPU_MODEL", "/tmp/m8b")
DATA_DIR = Path(os.environ.get("LLMOPS_GPU_DATA_DIR", "/tmp/llmops-gpu"))
REPORT_DIR = Path(os.environ.get("LLMOPS_GPU_REPORT_DIR", str(REPO / "tests" / "artifacts")))
START_S = 900
SETTINGS = {"model": MODEL, "served_model_name": "m", "load_format": "dummy", "gpu_memory_utilization": 0.85,
            "max_model_len": 4096, "max_num_seqs": 64}


def gpu_count() -> int:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return 0
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


needs_gpu = [pytest.mark.gpu, pytest.mark.skipif(gpu_count() == 0, reason="NVML finds no GPU on this machine")]


def report(name: str, data: dict[str, Any]) -> None:
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    path = REPORT_DIR / "gpu-report.json"
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing[name] = data
    path.write_text(json.dumps(existing, indent=1, default=str))


def bench(url: str, concurrency: int, prompts: int, label: str) -> dict[str, Any]:
    """vLLM's own serving benchmark against ``url`` (random prompts of 200 tokens, 128 out)."""
    out = subprocess.run(
        [sys.executable, "-m", "engine.benchmarks.runner", "--base-url", url, "--model", "m", "--tokenizer", MODEL,
         "--dataset-name", "random", "--random-input-len", "200", "--random-output-len", "128",
         "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos", "--disable-tqdm",
         "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99", "--label", label],
        capture_output=True, text=True, cwd=REPO, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("LLMOPS_BENCH_RESULT ")), None)
    assert line, out.stdout[-3000:] + out.stderr[-3000:]
    result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
    return result


@pytest.fixture(scope="session")
def gpu_engine() -> Iterator[EngineHandle]:
    """The engine on the GPU, vLLM not started yet (the tests start it with the settings they need)."""
    env = {"LLMOPS_AUTOSTART": "false", "LLMOPS_STARTUP_TIMEOUT_S": str(START_S),
           "LLMOPS_MODEL_ROOTS": json.dumps([str(Path(MODEL).parent)])}
    with running_engine(DATA_DIR, env, demo=False) as handle:
        yield handle


@pytest.fixture(scope="session")
def serving_8b(gpu_engine: EngineHandle) -> int:
    """vLLM serving the 8B shape at utilization 0.85, ready; its revision (each test module that needs a good,
    applied revision asks for it: no test depends on another having run)."""
    c = gpu_engine.client
    current = c.settings()
    if any(getattr(current.values, k) != v for k, v in SETTINGS.items()):
        current = c.put_settings(current.revision, SETTINGS, "gpu validation: 8B shape")
    c.engine_action("start")
    c.wait_for({"ready"}, START_S, revision=current.revision)
    return current.revision
