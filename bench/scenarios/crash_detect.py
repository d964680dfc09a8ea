"""How fast the engine sees vLLM die, under load: N streaming clients through the gateway (and, with ``--busy``,
processes that keep every core busy), then SIGKILL of vLLM's API server, several times in a row.

    python -m bench crash-detect --out DIR [--clients 16] [--busy 2] [--kills 5]

For each kill it records the time from the SIGKILL to the engine's ``instance_exited`` event (the moment the
gateway stopped sending to it), to the state leaving ``ready``, and to serving again; the requests that failed
(those in flight on the killed instance may), and how many arrived after the exit was seen and still failed (none
should: they wait for the next instance). Writes ``crash-detect.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.testkit.engine import COLD_START_S, EngineHandle, running_engine
from tests.testkit.load import Load, summary
from tests.testkit.wait import wait_until


def burn() -> None:  # a process that keeps one core busy
    while True:
        pass


def one_kill(engine: EngineHandle, load: Load, n: int) -> dict[str, Any]:
    before = engine.client.status()
    assert before.pid is not None
    marker = engine.client.events(limit=1, newest_first=True)[0].id
    first = load.count()
    killed = time.time()
    os.kill(before.pid, signal.SIGKILL)
    left_ready = wait_until(lambda: time.time() if engine.client.status().state != "ready" else None,
                            120, every=0.02, what="the state to leave ready")
    # the first sign the engine saw it (an engine before instance_exited existed: its "failed" event)
    exited = wait_until(lambda: next(iter(engine.client.events(kinds=["instance_exited", "failed"], since=marker)),
                                     None), 120, every=0.05, what="instance_exited")

    def ready_again() -> float | None:
        status = engine.client.status()
        return time.time() if status.state == "ready" and status.pid != before.pid else None

    back = wait_until(ready_again, COLD_START_S, every=0.2, what="ready again")
    seen = exited.ts.timestamp()
    seen_mono = seen + time.monotonic() - time.time()  # Outcome times are monotonic
    window = list(load.outcomes)[first:]
    late = [o for o in window if not o.ok and o.finished - o.seconds >= seen_mono]
    return {"kill": n, "exit_seen_s": round(seen - killed, 3), "state_left_ready_s": round(left_ready - killed, 3),
            "ready_again_s": round(back - killed, 1), "seen_by": exited.kind,
            "in_flight_on_it": exited.data.get("in_flight"),
            "requests": len(window), "failed": sum(1 for o in window if not o.ok), "failed_after_exit_seen": len(late)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU beside the engine")
    p.add_argument("--kills", type=int, default=5)


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "clients": a.clients,
                              "busy": a.busy, "cores": os.cpu_count(), "kills": []}
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(a.busy)]
    # every kill is a crash to the engine: the crash-loop guard (3 in 10 minutes halt restarts) is lifted here
    with running_engine(Path(tempfile.mkdtemp(prefix="crash-detect-")),
                        env={"LLMOPS_CRASHLOOP_MAX_FAILURES": "1000"}) as engine:
        engine.client.wait_for({"ready"}, COLD_START_S)
        load = Load(engine.url, clients=a.clients, stream=True, max_tokens=16).start()
        load.wait_for(32, timeout=300)
        for b in burners:
            b.start()
        try:
            for n in range(a.kills):
                row = one_kill(engine, load, n + 1)
                report["kills"].append(row)
                print(row, flush=True)
                (a.out / "crash-detect.json").write_text(json.dumps(report, indent=1))
                load.wait_for(load.count() + 32, timeout=300)
        finally:
            for b in burners:
                b.terminate()
            outcomes = load.stop()
    seen_s = [r["exit_seen_s"] for r in report["kills"]]
    report["summary"] = {"load": summary(outcomes), "exit_seen_s_median": statistics.median(seen_s),
                         "exit_seen_s_max": max(seen_s)}
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (a.out / "crash-detect.json").write_text(json.dumps(report, indent=1))
    print(report["summary"])

