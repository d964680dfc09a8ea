"""GPU tests (``pytest -m gpu``): the real sampler on the real NVIDIA driver, the real engine and the real vLLM.

Skipped where NVML finds no GPU. On the H200 they serve a Llama-3-8B-shaped model with dummy weights
(``LLMOPS_GPU_MODEL``, written by ../shared/gpu/make_shape_model.py). The data dir (``LLMOPS_GPU_DATA_DIR``)
outlives one pytest run, so a later run on the same machine starts calibrated. Figures go to
``LLMOPS_GPU_REPORT_DIR`` as JSON for docs/gpu-validation.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from console.client import EngineClient
from engine.serving import free_port
from tests.engine_process import ADMIN_PASSWORD, make_token

REPO = Path(__file__).resolve().parents[2]
MODEL = os.environ.get("LLMOPS_GPU_MODEL", "/tmp/m8b")
DATA_DIR = Path(os.environ.get("LLMOPS_GPU_DATA_DIR", "/tmp/llmops-gpu"))
REPORT_DIR = Path(os.environ.get("LLMOPS_GPU_REPORT_DIR", str(REPO / "tests" / "artifacts")))
START_S = 900


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


class GpuEngine:
    def __init__(self) -> None:
        DATA_DIR.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(DATA_DIR / "engine-stdout.log", "ab")  # noqa: SIM115 - lives as long as the engine
        self.token = make_token(DATA_DIR)
        env = {**os.environ, "LLMOPS_AUTOSTART": "false", "LLMOPS_STARTUP_TIMEOUT_S": str(START_S),
               "LLMOPS_ADMIN_PASSWORD": ADMIN_PASSWORD, "LLMOPS_MODEL_ROOTS": json.dumps([str(Path(MODEL).parent)])}
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(DATA_DIR),
                                      "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=REPO, env=env)
        self.client = EngineClient(self.url, timeout=60, token=self.token)
        deadline = time.monotonic() + 60
        while not self.client.healthz():
            assert self.proc.poll() is None and time.monotonic() < deadline, "engine did not come up"
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=120)
        self.client.close()
        self.log.close()

    def bench(self, concurrency: int, prompts: int, label: str) -> dict[str, Any]:
        """vLLM's own serving benchmark against the gateway (random prompts of 200 tokens, 128 out)."""
        out = subprocess.run(
            [sys.executable, "-m", "engine.benchmarks.runner", "--base-url", self.url, "--model", "m",
             "--tokenizer", MODEL, "--dataset-name", "random", "--random-input-len", "200",
             "--random-output-len", "128",
             "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos", "--disable-tqdm",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99", "--label", label],
            capture_output=True, text=True, cwd=REPO, timeout=600)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("LLMOPS_BENCH_RESULT ")), None)
        assert line, out.stdout[-3000:] + out.stderr[-3000:]
        result: dict[str, Any] = json.loads(line.split(" ", 1)[1])
        return result


@pytest.fixture(scope="module")
def gpu_engine() -> Iterator[GpuEngine]:
    engine = GpuEngine()
    try:
        yield engine
    finally:
        engine.stop()
