"""Real vLLM starts of each kind this host can produce, through the real engine, recorded as the engine records them
(each start's ``ready`` event: its kind, phases, the host's load at launch) with the ETA the engine gave it.

    flock /tmp/llmops-heavy.lock python -m bench start-kinds --out DIR [--clients 16]

The engine gets empty compile caches (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``), so its first start is cold.
Then, in turn: stop and start (warm, alone); an apply with nobody sending requests (alone: blue/green beside an
idle instance, a new compile key, so cold; then back, warm); applies under ``--clients`` streaming clients (beside
an instance that serves: a new key, then back and forth); a stop, a revision with a new key written while
stopped, a start (cold, alone). A bridge and a wake-up from sleep need a GPU. Writes ``start-kinds.json`` (the
ready events' data and the applies' ``apply_done`` data, oldest first) under ``--out`` as it goes:
tests/fixtures/starts/ keeps one such run for the ETA replay test.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.client import EngineClient
from tests.testkit.engine import COLD_START_S, running_engine
from tests.testkit.load import Load
from tests.testkit.wait import wait_until


def applied(client: EngineClient, values: dict[str, Any], note: str) -> int:
    """Write ``values`` and wait until its apply has ended."""
    base = client.settings()
    rev = client.put_settings(base.revision, values, note).revision

    def ended() -> bool:
        apply = client.status().apply
        return apply is not None and apply.revision == rev and apply.outcome != "running"

    wait_until(ended, COLD_START_S, every=0.5, what=f"the apply of revision {rev}")
    return rev


def restarted(client: EngineClient, values: dict[str, Any] | None = None) -> None:
    """Stop vLLM, write ``values`` meanwhile if given, start it, wait until it is ready."""
    client.engine_action("stop")
    client.wait_for({"stopped"}, 300)
    if values is not None:
        base = client.settings()
        client.put_settings(base.revision, values, "start-kinds bench: written while stopped")
    client.engine_action("start")
    client.wait_for({"ready"}, COLD_START_S)


def settled(cores: int, most_s: float = 120.0) -> None:
    """Wait (at most ``most_s``) until the load average is back under two runnable threads a core, so that a start
    meant to be quiet is not taken in the wake of the loaded ones (the 1-minute average lags by a minute)."""
    deadline = time.monotonic() + most_s
    while os.getloadavg()[0] > 2 * cores and time.monotonic() < deadline:
        time.sleep(2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seqs", type=int, nargs=4, default=[16, 12, 8, 6],
                   help="max_num_seqs: the base, one for the quiet applies, one for the loaded, one while stopped")


def run(a: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="start-kinds-"))
    env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache"),
           "LLMOPS_STARTUP_TIMEOUT_S": "900"}
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "host_cores": os.cpu_count(),
                              "args": vars(a) | {"out": str(a.out)}, "steps": []}

    def save(client: EngineClient) -> None:
        ready = client.events(kinds=["ready"], limit=500)
        done = client.events(kinds=["apply_done"], limit=500)
        report["ready"] = [{"ts": e.ts.isoformat(), "message": e.message, **e.data} for e in ready]
        report["apply_done"] = [{"ts": e.ts.isoformat(), **e.data} for e in done]
        (a.out / "start-kinds.json").write_text(json.dumps(report, indent=1, default=str))

    base, quiet, loaded, stopped = a.seqs
    with running_engine(work / "data", env=env) as engine:
        client = engine.client
        client.wait_for({"ready"}, COLD_START_S)
        first = client.settings()
        if first.values.max_num_seqs != base:
            applied(client, {"max_num_seqs": base}, "start-kinds bench: the base")
        save(client)

        def step(what: str, fn: Any, *args: Any) -> None:
            t0 = time.monotonic()
            fn(*args)
            report["steps"].append({"what": what, "s": round(time.monotonic() - t0, 1),
                                    "load_1m": round(os.getloadavg()[0], 2)})
            save(client)
            print(f"{what}: {report['steps'][-1]['s']} s (load {report['steps'][-1]['load_1m']})", flush=True)

        step("stop, start (warm, alone)", restarted, client)
        step("stop, start (warm, alone)", restarted, client)
        step("quiet apply, new key (cold, alone)", applied, client, {"max_num_seqs": quiet}, "quiet apply")
        step("quiet apply back (warm, alone)", applied, client, {"max_num_seqs": base}, "quiet apply back")
        load = Load(engine.url, clients=a.clients, max_tokens=32, stream=True).start()
        try:
            load.wait_for(32, timeout=600)
            step("loaded apply, new key (cold, beside)", applied, client, {"max_num_seqs": loaded}, "loaded apply")
            for i in range(3):
                seqs = base if i % 2 == 0 else loaded
                step(f"loaded apply {seqs} (warm, beside)", applied, client, {"max_num_seqs": seqs}, "loaded apply")
        finally:
            report["load"] = len(load.stop())
        settled(os.cpu_count() or 2)
        step("quiet apply (warm, alone)", applied, client, {"max_num_seqs": quiet}, "quiet apply")
        step("stop, new key, start (cold, alone)", restarted, client, {"max_num_seqs": stopped})
        step("stop, start (warm, alone)", restarted, client)
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save(client)
    for r in report["ready"]:
        s = r.get("startup") or {}
        print(f"{s.get('kind')}: {r['startup_s']} s, expected {s.get('eta_s')} ({s.get('eta_basis')}), "
              f"load {s.get('load_1m')}")

