"""Capacity accuracy table on the CPU build: predicted KV tokens against the figure the real vLLM logs.

Each case starts vLLM 0.32 (CPU) on the demo model with the project's own argument builder, waits for its
"CPU KV cache size: N tokens" line and stops it. The table is written to tests/artifacts/ for docs/.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from pathlib import Path

import pytest

from engine.capacity import GIB, Device, load_shape, predict
from engine.revisions import EngineSettings
from engine.vllm import ChildLog, VllmChild, build_command, build_env, free_port
from tests.support.engine import REPO, ensure_demo_model

pytestmark = pytest.mark.integration

CASES: list[dict[str, object]] = [
    {"cpu_kv_cache_gib": 0.25},
    {"cpu_kv_cache_gib": 0.3, "dtype": "float16"},
    {"cpu_kv_cache_gib": 0.1, "dtype": "float32"},
    {"cpu_kv_cache_gib": 0.2, "kv_cache_dtype": "fp8"},
    {"cpu_kv_cache_gib": 0.5, "max_model_len": 1024, "max_num_seqs": 4},
    {"cpu_kv_cache_gib": 0.07, "max_model_len": 512},
]
KV_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens")


async def logged_kv_tokens(settings: EngineSettings, data_dir: Path, log_dir: Path, n: int) -> int:
    args = build_command(settings, python=sys.executable, port=free_port(), data_dir=data_dir, build="cpu")
    log = ChildLog(log_dir / f"accuracy-{n}.log", 10_000_000, 0)
    child = VllmChild(args, build_env(offline=True), int(args[args.index("--port") + 1]), n, log,
                      log_dir / f"accuracy-{n}.json")
    await child.spawn()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and child.returncode is None:
            for line in list(child.lines):
                if m := KV_LINE.search(line):
                    return int(m[1].replace(",", ""))
            await asyncio.sleep(0.2)
        raise AssertionError(f"no KV cache line; last lines: {list(child.lines)[-5:]}")
    finally:
        await child.stop(5)  # vLLM may not act on SIGTERM while it initialises: no need to wait long
        log.close()


def test_cpu_accuracy_table(tmp_path: Path) -> None:
    demo = ensure_demo_model()
    shape = load_shape(demo)
    host = Device("cpu", 24 * GIB, 20 * GIB)
    rows = []
    for n, case in enumerate(CASES):
        settings = EngineSettings.model_validate({"model": str(demo), "max_model_len": 2048, "enforce_eager": True,
                                                  **case})
        predicted = predict(shape, settings, host).kv_tokens
        logged = asyncio.run(logged_kv_tokens(settings, demo.parent, tmp_path, n))
        error = (predicted - logged) / logged
        rows.append((case, predicted, logged, error))
    table = ["| settings | predicted KV tokens | vLLM logged | error |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {', '.join(f'{k}={v}' for k, v in case.items())} | {p:,} | {lg:,} | {100 * e:+.2f} % |"
              for case, p, lg, e in rows]
    artifacts = REPO / "tests" / "artifacts"
    artifacts.mkdir(exist_ok=True)
    (artifacts / "capacity-accuracy-cpu.md").write_text("\n".join(table) + "\n")
    assert all(abs(e) < 0.03 for *_, e in rows), "\n".join(table)
