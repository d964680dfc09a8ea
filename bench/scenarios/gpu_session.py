"""The product's guided search on a GPU, through its own API: start the engine on an 8B-shaped model, run the guided
search for max_num_seqs (vLLM's benchmark module through the gateway), and collect what the engine measured: the
search, its proposal, the capacity model's prediction at every start, tokens per joule, KPIs and the sampler's cost.

    python -m bench guided-search --profile h200 [--candidates 1 16 64] [--target 5]     # --model: the profile's

Writes gpu-session.json (updated as it goes, so a run cut short still reports what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.base import REPO
from engine.client import EngineClient
from engine.vllm import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True)
    p.add_argument("--data-dir", type=Path, default=Path("/tmp/llmops-gpu-session"))
    p.add_argument("--utilization", type=float, default=0.8)
    p.add_argument("--candidates", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--target", type=float, default=5.0)
    p.add_argument("--num-prompts", type=int, default=64)


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.time()}

    def save() -> None:
        (a.out / "gpu-session.json").write_text(json.dumps(report, indent=1, default=str))

    port = free_port()
    a.data_dir.mkdir(parents=True, exist_ok=True)
    token = subprocess.run([sys.executable, "-m", "engine.cli", "token", "create", "--role", "admin", "--name",
                            "gpu-session", "--data-dir", str(a.data_dir)], capture_output=True, text=True,
                           check=True, cwd=REPO).stdout.strip()
    env = {**os.environ, "LLMOPS_AUTOSTART": "false", "LLMOPS_STARTUP_TIMEOUT_S": "900",
           "LLMOPS_ADMIN_PASSWORD": "gpu-session-password",
           "LLMOPS_MODEL_ROOTS": json.dumps([str(Path(a.model).parent)])}
    log = open(a.out / "engine.log", "wb")  # noqa: SIM115
    engine = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(a.data_dir),
                               "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=60, token=token)
    try:
        deadline = time.monotonic() + 60
        while not client.healthz():
            assert engine.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        values = {"model": a.model, "served_model_name": "m", "load_format": "dummy",
                  "gpu_memory_utilization": a.utilization, "max_model_len": 4096, "max_num_seqs": 32}
        report["capacity_before_start"] = client.capacity(values)
        client.put_settings(client.settings().revision, values, "gpu session")
        client.engine_action("start")
        t0 = time.monotonic()
        client.wait_for({"ready"}, 900)
        report["first_start_s"] = round(time.monotonic() - t0, 1)
        save()
        run = client.start_search("short_chat", a.target, a.candidates, a.num_prompts)
        while (run := client.benchmark(run.id)).status == "running":
            report["search"] = run.model_dump()
            save()
            time.sleep(5)
        report["search"] = run.model_dump()
        report["ready_events"] = [e.model_dump() for e in client.events(kinds=["ready"], limit=50)]
        report["kpis"] = [k.model_dump() for k in client.kpis("1h")]
        report["gpu"] = client.gpu().model_dump()
        report["history"] = client.settings().model_dump()
    finally:
        report["finished"] = time.time()
        save()
        engine.terminate()
        engine.wait(timeout=120)
        client.close()
        log.close()

