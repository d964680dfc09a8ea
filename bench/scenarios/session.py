"""Several scenarios in turn on one machine, as one run: a GPU session as data, where each used to need a script.

    python -m bench session --profile h200 --scenarios gateway-overhead,apply-gap
    python -m bench session --profile h200 \\
        --step 'gateway-overhead --ray --cap-vs-restart 128 32 --cap-prompts 2800 1400 --cap-runs 2' \\
        --step 'capacity-archs --only qwen3-4b qwen3-30b-a3b --budget-s 420 --pair-s 200' \\
        --step gateway-overhead

Each step runs in a process of its own (``python -m bench SCENARIO --profile P --out OUT/STEP [its options]``),
with the profile's knobs for that scenario and its time limit (the profile's ``timeout_s`` for it, or
``--timeout``): at the limit the step is interrupted (SIGINT, so that it stops the engine and vLLM it started),
then killed. A step that fails or runs out of time leaves its log and the next one runs. Under ``--out``:
``progress.txt`` ("SECONDS s: what", as it goes), ``STEP.log`` (each step's output), ``STEP/`` (its results and its
run.json), ``session.json`` (each step's command, outcome and seconds) and ``DONE`` at the end. On a GPU host it
waits after each step until the GPU's memory is free again. With no step given, the profile's ``session`` list.

On the H200, staged as ../shared/gpu/README.md says, start it detached and collect ``/var/tmp/out`` back to back:

    setsid nohup bash bench/gpu.sh session --scenarios gateway-overhead,apply-gap > /var/tmp/session.out 2>&1 &

The machine is given back 30 s after a call ends, so every collection call begins with
``[ -d /var/tmp/out ] || { echo gone; exit 9; }``: on 2026-12-04 a call that found a bare machine waited out its
limit and spent the rest of the session.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.base import REPO, write_json
from bench.profiles import get
from bench.scenarios import SCENARIOS

STOP_GRACE_S = 180.0  # after SIGINT at a step's limit: time to stop its engine and vLLM before SIGKILL


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenarios", dest="steps", action="extend", type=_names, default=None, metavar="A,B,...",
                   help="scenarios to run in this order, each with the profile's knobs")
    p.add_argument("--step", dest="steps", action="append", metavar="'SCENARIO [OPTIONS]'",
                   help="one more step, with options of its own over the profile's (in order with --scenarios)")
    p.add_argument("--timeout", action="append", default=[], metavar="STEP=SECONDS",
                   help="a step's time limit (by its scenario's name, or STEP as in the output: apply-gap-2)")
    p.add_argument("--gpu-free-mib", type=int, default=2000,
                   help="after each step on a GPU host, wait (at most 120 s) until the GPU uses less than this")


def plan(steps: list[str]) -> list[tuple[str, str, list[str]]]:
    """(step, scenario, options) for each step; a scenario twice gets -2, -3 ... Checked before anything runs."""
    seen: Counter[str] = Counter()
    out = []
    for spec in steps:
        words = shlex.split(spec)
        if not words or words[0] not in SCENARIOS or words[0] == "session":
            raise SystemExit(f"session: {spec!r} is no scenario (`python -m bench --help` lists them)")
        seen[words[0]] += 1
        out.append((words[0] if seen[words[0]] == 1 else f"{words[0]}-{seen[words[0]]}", words[0], words[1:]))
    return out


def run_step(cmd: list[str], log: Path, limit_s: float | None) -> tuple[int, str]:
    """``cmd`` in a process group of its own, its output in ``log``: its exit status and how it ended."""
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=limit_s), "ended"
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            return 124, f"stopped at its limit of {limit_s:.0f} s"


def gpu_used_mib() -> int | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30, check=False)
        return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.split() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def wait_gpu_free(below_mib: int, within_s: float = 120.0) -> int | None:
    """Wait until the first GPU uses less than ``below_mib`` (a stopped vLLM's memory comes back a little after
    it exits); what it used at the end."""
    deadline = time.monotonic() + within_s
    used = gpu_used_mib()
    while used is not None and used >= below_mib and time.monotonic() < deadline:
        time.sleep(2)
        used = gpu_used_mib()
    return used


def run(a: argparse.Namespace) -> int:
    profile = get(a.profile)
    steps = plan(a.steps or profile.session)
    limits = {k: float(v) for k, v in (t.split("=", 1) for t in a.timeout)}
    t0 = time.monotonic()
    progress = a.out / "progress.txt"

    def mark(text: str) -> None:
        with progress.open("a") as f:
            f.write(f"{time.monotonic() - t0:.0f} s: {text}\n")
        print(text, flush=True)

    (a.out / "DONE").unlink(missing_ok=True)
    report: dict[str, Any] = {"profile": profile.name, "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "steps": []}
    mark(f"start: {', '.join(step for step, _, _ in steps)}")
    for step, name, options in steps:
        limit = limits.get(step) or limits.get(name) or profile.timeout_s(name)
        cmd = [sys.executable, "-m", "bench", name, "--profile", profile.name, "--out", str(a.out / step), *options]
        began = time.monotonic()
        rc, how = run_step(cmd, a.out / f"{step}.log", limit)
        report["steps"].append({"step": step, "command": shlex.join(["python", "-m", "bench", *cmd[3:]]),
                                "limit_s": limit, "rc": rc, "ended": how,
                                "seconds": round(time.monotonic() - began, 1)})
        write_json(a.out / "session.json", report)
        mark(f"{step} done rc={rc}" + ("" if how == "ended" else f" ({how})"))
        if profile.gpu:
            mark(f"gpu free: {wait_gpu_free(a.gpu_free_mib)} MiB used")
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    write_json(a.out / "session.json", report)
    (a.out / "DONE").write_text(json.dumps({"finished": report["finished"]}) + "\n")
    return 0 if all(s["rc"] == 0 for s in report["steps"]) else 1
