"""What clients see of an apply: N streaming clients in a loop while a revision is applied, and the longest
stretch with no completed request, failed requests, the plan the engine chose, and how long it took.

    python -m bench apply-gap --out DIR                                          # CPU: two demo instances
    python -m bench apply-gap --out DIR --model /tmp/m8b --load-format dummy \\
        --base gpu_memory_utilization=0.85 max_num_seqs=256 max_model_len=4096 \\
        --apply max_num_seqs=128 --apply-bad max_model_len=999999 --apply-pause gpu_memory_utilization=0.95

Each ``--apply*`` is one apply, in turn, under the same load: ``--apply`` a good change, ``--apply-bad`` a forced
revision that cannot start (rolled back), ``--apply-pause`` a change that fits beside nothing (a pause; on CUDA
with sleep mode the old instance sleeps, and with ``--apply-bad`` after it the time to wake is measured).
First ``--steady`` seconds of the same load with no apply: the longest gap clients see anyway (the floor of
the figure). ``--repeat N`` instead applies ``--apply`` and the base values back and forth, N applies in all:

    python -m bench apply-gap --out DIR --clients 16 --base max_num_seqs=16 --apply max_num_seqs=12 --repeat 5

Every request has its own text (tests/testkit/load.py: a random token first), so no apply is measured on prompts
the prefix cache holds. For each apply it records the longest gap, how long the apply took against the plan's
predicted duration (the plan shown before the write: each step's ETA, and each step's measured time), and the
host's load average during it. Writes ``apply-gap.json`` under ``--out`` as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.base import REPO
from tests.testkit.load import Load, longest_gap, longest_gap_span, parse_values, summary

PASSWORD = "apply-gap-bench-password"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--base", nargs="*", default=[], help="KEY=VALUE of the revision that serves first")
    p.add_argument("--apply", nargs="*", default=None, help="KEY=VALUE of a good change")
    p.add_argument("--apply-bad", nargs="*", default=None, help="KEY=VALUE of a forced change that cannot start")
    p.add_argument("--apply-pause", nargs="*", default=None, help="KEY=VALUE of a change that fits beside nothing")
    p.add_argument("--order", default="apply,apply-bad,apply-pause,apply-bad")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--settle", type=int, default=64, help="requests to see completed before and after each apply")
    p.add_argument("--steady", type=float, default=60.0,
                   help="seconds of the same load with no apply first: the longest gap clients see anyway")
    p.add_argument("--repeat", type=int, default=0,
                   help="apply --apply and the base values back and forth, this many applies (instead of --order)")


def run(a: argparse.Namespace) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="apply-gap-"))
    port = int(subprocess.run([sys.executable, "-c", "from engine.vllm import free_port; print(free_port())"],
                              capture_output=True, text=True, check=True, cwd=REPO).stdout)
    env = {**os.environ, "LLMOPS_ADMIN_PASSWORD": PASSWORD, "LLMOPS_AUTOSTART": "false",
           "LLMOPS_STARTUP_TIMEOUT_S": "1200"}
    if a.model:
        env["LLMOPS_MODEL_ROOTS"] = json.dumps([str(Path(a.model).resolve().parent)])
    else:
        env["LLMOPS_MODEL_ROOTS"] = json.dumps([str((REPO / "data" / "models").resolve())])
    log = open(a.out / "engine.log", "wb")  # noqa: SIM115 - closed at the end
    engine = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data_dir), "--port",
                               str(port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=120)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "applies": []}

    def save() -> None:
        (a.out / "apply-gap.json").write_text(json.dumps(report, indent=1, default=str))

    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if http.get("/healthz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert engine.poll() is None and time.monotonic() < deadline, "the engine did not come up"
            time.sleep(0.3)
        token = http.post("/api/auth/login", json={"username": "admin", "password": PASSWORD}).json()["token"]
        http.headers["authorization"] = f"Bearer {token}"
        base = parse_values(a.base)
        if a.model:
            base.update(model=str(Path(a.model).resolve()), load_format=a.load_format)
        else:  # the demo model of this checkout (a fresh data dir has none of its own)
            base.setdefault("model", str((REPO / "data" / "models" / "demo").resolve()))
        base.setdefault("served_model_name", "demo")
        current = http.get("/api/settings").json()
        r = http.put("/api/settings", json={"base_revision": current["revision"], "values": base, "force": True,
                                            "note": "apply-gap bench: the first revision"})
        r.raise_for_status()
        http.post("/api/engine/start")
        t0 = time.monotonic()
        while http.get("/api/status").json()["state"] != "ready":
            assert time.monotonic() - t0 < 1500, "vLLM did not become ready"
            time.sleep(1)
        report["first_start_s"] = round(time.monotonic() - t0, 1)
        save()
        load = Load(url, clients=a.clients, max_tokens=a.max_tokens, stream=True)
        load.outcomes = []
        load.start()
        load.wait_for(a.settle, timeout=600)
        if a.steady > 0:  # the floor: how long clients go without a completed request when nothing is applied
            lag0 = loop_lag(http)
            s0 = time.monotonic()
            while time.monotonic() - s0 < a.steady:
                time.sleep(0.5)
            s1 = time.monotonic()
            window = [o for o in load.outcomes if s0 <= o.finished <= s1]
            report["steady"] = {"seconds": round(s1 - s0, 1), "longest_gap_s": round(
                longest_gap(list(load.outcomes), s0, s1), 3), "requests": len(window),
                "failed": sum(1 for o in window if not o.ok), "load_1m": os.getloadavg()[0]}
            report["steady"]["loop_late"] = late_between(lag0, loop_lag(http))
            print(f"steady ({a.steady:.0f} s, no apply): longest gap {report['steady']['longest_gap_s']:.2f} s, "
                  f"{len(window)} requests", flush=True)
            save()
        changes = {"apply": a.apply, "apply-bad": a.apply_bad, "apply-pause": a.apply_pause}
        if a.repeat:
            assert a.apply, "--repeat applies --apply and the base back and forth: give --apply"
            there = parse_values(a.apply)
            serving = http.get("/api/settings").json()["values"]
            back = {k: serving.get(k) for k in there}
            for i in range(a.repeat):
                change, name = (there, f"apply {i + 1}") if i % 2 == 0 else (back, f"back {i + 1}")
                report["applies"].append(one_apply(http, load, name, change, a.settle))
                save()
        for step in [] if a.repeat else a.order.split(","):
            values = changes.get(step)
            if values is None:
                continue
            report["applies"].append(one_apply(http, load, step, parse_values(values), a.settle))
            save()
        outcomes = load.stop()
        report["load"] = summary(outcomes)
    finally:
        report["events"] = http.get("/api/events", params={"limit": 500}).json() if engine.poll() is None else []
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save()
        engine.terminate()
        try:
            engine.wait(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(engine.pid, 9)
        log.close()
    for row in report["applies"]:
        predicted = row.get("predicted_s")
        print(f"{row['step']}: plan {row['plan']}, outcome {row['outcome']}, {row['failed']} failed of "
              f"{row['requests']}, longest gap {row['longest_gap_s']:.2f} s, took {row['apply_s']:.1f} s"
              + (f" (predicted {predicted:.1f} s, {100 * (row['apply_s'] - predicted) / predicted:+.0f} %)"
                 if predicted else "")
              + f", load {row['load_1m']['mean']:.1f} (max {row['load_1m']['max']:.1f})"
              + (f", woke in {row['wake_s']} s" if row.get("wake_s") is not None else "")
              + f"; the engine's loop late by > 0.25 s {row['loop_late'].get('0.25')} times"
              + f"; the gap from +{row['longest_gap_during']['starts_s']} s, beside: "
              + " | ".join(row["longest_gap_during"]["events"]))


class LoadAverage:
    """The host's 1-minute load average, read every second while an apply runs."""

    def __init__(self) -> None:
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="loadavg")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(5)
        return {"start": round(self.samples[0], 2), "mean": round(statistics.fmean(self.samples), 2),
                "max": round(max(self.samples), 2), "end": round(self.samples[-1], 2), "cores": os.cpu_count() or 0}


def one_apply(http: httpx.Client, load: Load, step: str, values: dict[str, Any], settle: int) -> dict[str, Any]:
    current = http.get("/api/settings").json()
    capacity = http.get("/api/capacity", params=values).json()
    marker = http.get("/api/events", params={"limit": 1, "newest_first": True}).json()[0]["id"]
    before = len(load.outcomes)
    loadavg = LoadAverage()
    lag0 = loop_lag(http)
    t0, wall0 = time.monotonic(), time.time()
    r = http.put("/api/settings", json={"base_revision": current["revision"], "values": values, "force": True,
                                        "note": f"apply-gap bench: {step}"})
    r.raise_for_status()
    rev = r.json()["revision"]
    while True:
        st = http.get("/api/status").json()
        apply = st.get("apply") or {}
        if apply.get("revision") == rev and apply.get("outcome") != "running":
            break
        assert time.monotonic() - t0 < 900, f"the apply of revision {rev} did not end"
        time.sleep(0.2)
    t1 = time.monotonic()
    lag1 = loop_lag(http)
    host_load = loadavg.stop()
    seen = load.count()
    load.wait_for(seen + settle, timeout=600)
    window = list(load.outcomes)[before:]  # every request that ended from the write until the settle after it
    events = http.get("/api/events", params={"since": marker, "limit": 500}).json()
    woke = [e for e in events if e["kind"] == "woken"]
    shown = capacity.get("plan") or {}
    ran = apply.get("plan") or {}
    return {"step": step, "revision": rev, "values": values, "plan": ran.get("kind"),
            "plan_shown": shown, "outcome": apply.get("outcome"),
            "apply_s": round(t1 - t0, 1), "predicted_s": shown.get("expected_s"),
            "engine_apply_s": _engine_seconds(apply), "predicted_by_apply_s": ran.get("expected_s"),
            "steps": [{"action": s.get("action"), "eta_s": s.get("eta_s"), "basis": s.get("basis")}
                      for s in ran.get("step_etas") or []],
            "timings": apply.get("timings") or [], "load_1m": host_load,
            "longest_gap_s": round(longest_gap(list(load.outcomes), t0, t1), 3),
            "longest_gap_during": gap_context(list(load.outcomes), t0, t1, wall0, events),
            # the engine's event loop during the apply: wake-ups (every 0.1 s) later than each bound
            "loop_late": late_between(lag0, lag1),
            "engine_gap_s": apply.get("longest_gap_s"), "requests": len(window),
            "failed": sum(1 for o in window if not o.ok),
            "wake_s": woke[-1]["data"].get("wake_s") if woke else None,
            "events": [f"{e['kind']}: {e['message']}" for e in events]}


def loop_lag(http: httpx.Client) -> dict[str, float]:
    """The engine's llmops_event_loop_lag_seconds buckets (cumulative counts by upper bound)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(http.get("/metrics").text):
        if family.name == "llmops_event_loop_lag_seconds":
            return {s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")}
    return {"+Inf": 0.0}


def late_between(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Of the loop's wake-ups between two readings of loop_lag, how many were later than each bound."""
    def late(buckets: dict[str, float], le: str) -> float:
        return buckets["+Inf"] - buckets.get(le, 0.0)

    return {le: round(late(after, le) - late(before, le)) for le in after if le != "+Inf"}


def gap_context(outcomes: list[Any], t0: float, t1: float, wall0: float, events: list[dict[str, Any]]
                ) -> dict[str, Any]:
    """Where the longest gap fell: its start after the write, and the engine's events from a second before it to
    its end (which step of the apply the clients waited through)."""
    start, end = longest_gap_span(outcomes, t0, t1)
    lo, hi = wall0 + (start - t0) - 1.0, wall0 + (end - t0)
    near = []
    for e in events:
        ts = datetime.fromisoformat(str(e["ts"]).replace("Z", "+00:00")).timestamp()
        if lo <= ts <= hi:
            near.append(f"+{ts - wall0:.1f} s {e['kind']}: {e['message'][:120]}")
    return {"starts_s": round(start - t0, 2), "ends_s": round(end - t0, 2), "events": near}


def _engine_seconds(apply: dict[str, Any]) -> float | None:
    """The apply's own duration, as the engine recorded it (from its plan to its last step)."""
    if not apply.get("started") or not apply.get("finished"):
        return None
    started, finished = (datetime.fromisoformat(str(apply[k]).replace("Z", "+00:00")) for k in ("started", "finished"))
    return round((finished - started).total_seconds(), 1)

