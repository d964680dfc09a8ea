"""Many models on one GPU (issue 33): N deployments of the same shape, each at ``--utilization`` (four at 0.85 do
not fit an H200 together), all scaling to zero, so that no more of them is awake at once than fits. Each is started
once by hand (the one before is put to sleep for it: a cold start each, reported apart). Then a load calls them in
turn for ``--rounds`` rounds: per turn, ``--clients`` streamed requests at once to the next deployment (asleep: the
least recently used one awake is put to sleep for it, and they wait for its wake), then ``--requests`` more, one
after another (awake). Fresh prompts every request.

Per switch: the first token of the turn's first request (the switch as a client sees it), the awake first token
(the median of the turn's later requests), the switch's own cost (the first less the awake), the sleep of the one
put to sleep and vLLM's wake-up as the engine timed them (its ``sleeping`` and ``woken`` events). Writes
``many_models.json`` and ``many_models.md`` under ``--out``.

    python -m bench many-models --profile h200          # four 8B-shaped deployments at 0.85 on one H200
    python -m bench many-models --out DIR --deployments 2   # the CPU build: every switch is a stop and a cold start
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.scenarios.scale_to_zero import first_token, pct
from tests.testkit.engine import COLD_START_S, running_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a model folder (default: the demo model)")
    p.add_argument("--load-format", default=None)
    p.add_argument("--deployments", type=int, default=4)
    p.add_argument("--utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="each deployment called this many times in turn")
    p.add_argument("--clients", type=int, default=4, help="streamed requests at once at a turn's start")
    p.add_argument("--requests", type=int, default=4, help="requests after them, one at a time (awake)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--start-timeout-s", type=float, default=2 * COLD_START_S)


class Caller:
    """Streamed requests to the engine's /v1 with no key (first_token's client) for a served name."""

    def __init__(self, url: str) -> None:
        self.url = url

    def one(self, model: str, max_tokens: int) -> dict[str, Any]:
        ttft, total, ok = first_token(self, max_tokens, model=model)
        return {"ttft_s": round(ttft, 4), "total_s": round(total, 4), "ok": ok, "at": time.monotonic()}


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"),
                              "args": vars(a) | {"out": str(a.out)}, "setup": [], "turns": []}

    def save() -> None:
        report["summary"] = summary(report)
        (a.out / "many_models.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "many_models.md").write_text(table(report["summary"]) + "\n")

    data_dir = Path(tempfile.mkdtemp(prefix="many-models-"))
    env = {"LLMOPS_MODEL_ROOTS": json.dumps([str(Path(a.model).resolve().parent)]), "LLMOPS_AUTOSTART": "false",
           "LLMOPS_STARTUP_TIMEOUT_S": "1200"} if a.model else {"LLMOPS_AUTOSTART": "false"}
    with running_engine(data_dir, env=env, demo=not a.model) as engine:
        model = str(Path(a.model).resolve()) if a.model else str(engine.data_dir / "models" / "demo")
        values: dict[str, Any] = {"model": model, "max_num_seqs": a.max_num_seqs, "scale_to_zero_after_s": 86400.0}
        if a.model:
            values.update(gpu_memory_utilization=a.utilization, max_model_len=a.max_model_len)
        if a.load_format:
            values["load_format"] = a.load_format
        names = [f"m{i + 1}" for i in range(a.deployments)]
        clients = {"m1": engine.client}
        first = engine.client.settings()
        engine.client.put_settings(first.revision, {**values, "served_model_name": "m1"}, "bench: m1", force=True)
        for name in names:
            t0 = time.monotonic()
            if name != "m1":
                engine.client.create_deployment(name, values, note=f"bench: {name}", force=True)
                clients[name] = engine.client.of(name)
            clients[name].engine_action("start")  # by hand: the one before is put to sleep for it
            clients[name].wait_for({"ready"}, a.start_timeout_s)
            report["setup"].append({"deployment": name, "cold_start_s": round(time.monotonic() - t0, 1)})
            print(json.dumps(report["setup"][-1]), flush=True)
        report["build"] = engine.client.status().vllm_build
        caller = Caller(engine.url)
        order = names  # the last started is awake: each turn calls the least recently used, asleep
        for rnd in range(a.rounds):
            for name in order:
                t0 = time.monotonic()
                with ThreadPoolExecutor(a.clients) as pool:
                    burst = list(pool.map(caller.one, [name] * a.clients, [a.max_tokens] * a.clients))
                after = [caller.one(name, a.max_tokens) for _ in range(a.requests)]
                awake = statistics.median(r["ttft_s"] for r in after if r["ok"]) if any(r["ok"] for r in after) \
                    else None
                firsts = [r["ttft_s"] for r in burst if r["ok"]]
                turn = {"round": rnd, "deployment": name, "first_token_s": min(firsts) if firsts else None,
                        "last_of_burst_s": max(firsts) if firsts else None, "awake_first_token_s": awake,
                        "switch_s": round(min(firsts) - awake, 4) if firsts and awake is not None else None,
                        "failed": sum(1 for r in burst + after if not r["ok"]), "requests": len(burst) + len(after),
                        "seconds": round(time.monotonic() - t0, 2)}
                report["turns"].append(turn)
                print(json.dumps(turn), flush=True)
                save()
        report["events"] = {name: [e.model_dump(mode="json") for e in c.events(
            kinds=["sleeping", "woken", "autoscale", "room_waiting", "ready", "stopped"], limit=1000)]
            for name, c in clients.items()}
        report["sleep_s"] = [e["data"].get("sleep_s") for evs in report["events"].values() for e in evs
                             if e["kind"] == "sleeping" and e.get("data")]
        report["wake_s"] = [e["data"].get("wake_s") for evs in report["events"].values() for e in evs
                            if e["kind"] == "woken" and e.get("data")]
        report["put_to_sleep"] = sum(1 for evs in report["events"].values() for e in evs
                                     if e["kind"] == "autoscale" and "to make room for" in e["message"])
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(table(report["summary"]))


def summary(report: dict[str, Any]) -> dict[str, Any]:
    turns = report["turns"]
    switches = [t for t in turns if t["switch_s"] is not None]

    def stat(values: list[float]) -> dict[str, float | None]:
        values = [v for v in values if v is not None]
        return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "max": max(values) if values else None}

    return {"deployments": report["args"]["deployments"], "turns": len(turns),
            "requests": sum(t["requests"] for t in turns), "failed": sum(t["failed"] for t in turns),
            "switch_first_token_s": stat([t["first_token_s"] for t in switches]),
            "awake_first_token_s": stat([t["awake_first_token_s"] for t in switches]),
            "switch_s": stat([t["switch_s"] for t in switches]),
            "switching_total_s": round(sum(t["switch_s"] for t in switches), 2),
            "turns_total_s": round(sum(t["seconds"] for t in turns), 2),
            "sleep_s": stat(report.get("sleep_s") or []), "wake_s": stat(report.get("wake_s") or []),
            "cold_starts_s": [s["cold_start_s"] for s in report["setup"]],
            "put_to_sleep": report.get("put_to_sleep")}


def table(s: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "–" if x is None else f"{x * 1000:.0f} ms"

    def row(name: str, key: str) -> str:
        v = s[key]
        return f"| {name} | {ms(v['p50'])} | {ms(v['p99'])} | {ms(v['max'])} |"

    return "\n".join([
        f"{s['deployments']} deployments, {s['turns']} turns, {s['requests']} requests, {s['failed']} failed; "
        f"{s['put_to_sleep']} put to sleep for another; switching {s['switching_total_s']} s of "
        f"{s['turns_total_s']} s; setup (a cold start each): "
        f"{', '.join(f'{x:g} s' for x in s['cold_starts_s'])}", "",
        "| measure | P50 | P99 | max |", "|---|---|---|---|",
        row("first token of a turn (a switch: one put to sleep, this one woken)", "switch_first_token_s"),
        row("first token, awake (the turn's later requests)", "awake_first_token_s"),
        row("a switch's own cost (the first less the awake)", "switch_s"),
        row("sleep of the one put to sleep (vLLM's /sleep)", "sleep_s"),
        row("vLLM's wake-up (/wake_up)", "wake_s")])
