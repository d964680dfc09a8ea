"""How long the engine takes to answer /healthz from its start (vLLM not started: autostart off), for two
checkouts side by side, alternated run by run: e.g. before and after a change to what the engine imports.

    python -m bench engine-startup --out DIR --checkout before=/path/to/old --checkout after=. --runs 10

Each run: a fresh data dir, `python -m engine.cli engine` with the checkout first on PYTHONPATH, the seconds to
the first /healthz 200, and whether Ray was imported (it must not be on the local path). Writes
``engine-startup.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_start(checkout: Path) -> float:
    data = Path(tempfile.mkdtemp(prefix="startup-"))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), "LLMOPS_AUTOSTART": "false",
           "LLMOPS_ADMIN_PASSWORD": "startup-bench-password"}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data), "--port",
                             str(port)], cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(f"the engine of {checkout} did not come up")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)


def imports_ray(checkout: Path) -> bool:
    code = ("import sys, tempfile; from engine.app import create_app; from engine.config import AppConfig; "
            "create_app(AppConfig(data_dir=tempfile.mkdtemp(), autostart=False)); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(checkout)})
    return out.stdout.strip().splitlines()[-1] == "True"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkout", action="append", required=True, help="NAME=PATH, twice or more")
    p.add_argument("--runs", type=int, default=10)


def run(a: argparse.Namespace) -> None:
    checkouts = {k: Path(v).resolve() for k, v in (c.split("=", 1) for c in a.checkout)}
    times: dict[str, list[float]] = {k: [] for k in checkouts}
    for _ in range(a.runs):
        for name, path in checkouts.items():
            times[name].append(round(one_start(path), 3))
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": a.runs, "load_1m":
                              os.getloadavg()[0], "checkouts": {k: str(v) for k, v in checkouts.items()}}
    for name, path in checkouts.items():
        report[name] = {"seconds": times[name], "median_s": statistics.median(times[name]),
                        "min_s": min(times[name]), "imports_ray": imports_ray(path)}
    (a.out / "engine-startup.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in checkouts}, indent=1))

