"""Capacity accuracy table on the CPU build: predicted KV tokens against the figure the real vLLM logs.

    python -m bench capacity-cpu [--out DIR]

Each case starts vLLM (the CPU build) on the demo model with the project's own argument builder, waits for its
"CPU KV cache size: N tokens" line and stops it: six starts, a minute or more each on two cores. The prediction is
the engine's capacity model for a host of 24 GiB (20 GiB free), uncalibrated. Writes ``capacity-cpu.md`` (the
table) and ``capacity-cpu.json`` under ``--out``; exits 1 when a case is 3 % or more off, the bar it held as a
test (tests/integration/test_capacity_accuracy.py until it left the test suite for this scenario).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path

from engine.capacity import GIB, Device, load_shape, predict
from engine.revisions import EngineSettings
from engine.vllm import ChildLog, VllmChild, build_command, build_env, free_port
from tests.testkit.engine import ensure_demo_model

CASES: list[dict[str, object]] = [
    {"cpu_kv_cache_gib": 0.25},
    {"cpu_kv_cache_gib": 0.3, "dtype": "float16"},
    {"cpu_kv_cache_gib": 0.1, "dtype": "float32"},
    {"cpu_kv_cache_gib": 0.2, "kv_cache_dtype": "fp8"},
    {"cpu_kv_cache_gib": 0.5, "max_model_len": 1024, "max_num_seqs": 4},
    {"cpu_kv_cache_gib": 0.07, "max_model_len": 512},
]
KV_LINE = re.compile(r"CPU KV cache size: ([\d,]+) tokens")
BAR = 0.03  # the largest error the table may show


async def logged_kv_tokens(settings: EngineSettings, data_dir: Path, log_dir: Path, n: int,
                           within_s: float) -> int:
    args = build_command(settings, python=sys.executable, port=free_port(), data_dir=data_dir, build="cpu")
    log = ChildLog(log_dir / f"accuracy-{n}.log", 10_000_000, 0)
    child = VllmChild(args, build_env(offline=True), int(args[args.index("--port") + 1]), n, log,
                      log_dir / f"accuracy-{n}.json")
    await child.spawn()
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and child.returncode is None:
            for line in list(child.lines):
                if m := KV_LINE.search(line):
                    return int(m[1].replace(",", ""))
            await asyncio.sleep(0.2)
        raise RuntimeError(f"no KV cache line; last lines: {list(child.lines)[-5:]}")
    finally:
        await child.stop(5)  # vLLM may not act on SIGTERM while it initialises: no need to wait long
        log.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--start-timeout-s", type=float, default=300, help="the longest one start may take")


def run(a: argparse.Namespace) -> int:
    demo = ensure_demo_model()
    shape = load_shape(demo)
    host = Device("cpu", 24 * GIB, 20 * GIB)
    rows = []
    for n, case in enumerate(CASES):
        settings = EngineSettings.model_validate({"model": str(demo), "max_model_len": 2048, "enforce_eager": True,
                                                  **case})
        predicted = predict(shape, settings, host).kv_tokens
        logged = asyncio.run(logged_kv_tokens(settings, demo.parent, a.out, n, a.start_timeout_s))
        error = (predicted - logged) / logged
        rows.append((case, predicted, logged, error))
        print(f"{case}: predicted {predicted:,}, vLLM logged {logged:,} ({100 * error:+.2f} %)", flush=True)
    table = ["| settings | predicted KV tokens | vLLM logged | error |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {', '.join(f'{k}={v}' for k, v in case.items())} | {p:,} | {lg:,} | {100 * e:+.2f} % |"
              for case, p, lg, e in rows]
    (a.out / "capacity-cpu.md").write_text("\n".join(table) + "\n")
    within = all(abs(e) < BAR for *_, e in rows)
    (a.out / "capacity-cpu.json").write_text(json.dumps({
        "host": {"total_bytes": host.total_bytes, "free_bytes": host.free_bytes}, "bar_pct": 100 * BAR,
        "within_bar": within, "cases": [{"settings": case, "predicted": p, "logged": lg, "error_pct": round(100 * e, 3)}
                                        for case, p, lg, e in rows]}, indent=1) + "\n")
    print("\n".join(table))
    if not within:
        print(f"a case is {100 * BAR:.0f} % or more off", file=sys.stderr)
    return 0 if within else 1
