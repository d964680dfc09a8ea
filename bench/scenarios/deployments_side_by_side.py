"""Two deployments side by side on one host (the demo model under two names, different settings; or a model of
your own on a GPU), N streaming clients on each: the untouched one's throughput before and during an apply of the
other (and a forced bad revision of the other), and the applied one's longest stretch with no completed request.

    python -m bench deployments --out DIR [--clients 16] [--window 60]
    python -m bench deployments --out DIR --model /tmp/m8b --load-format dummy \\
        --values gpu_memory_utilization=0.45 max_model_len=4096 --apply max_num_seqs=128

Fresh prompts every request; writes ``deployments.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.client import EngineClient
from tests.testkit.engine import COLD_START_S, running_engine
from tests.testkit.load import Load, longest_gap, parse_values, summary, tokens_per_s
from tests.testkit.wait import wait_until


def apply_and_wait(client: EngineClient, changes: dict[str, Any], note: str, force: bool = False) -> dict[str, Any]:
    """Write a revision on the client's deployment and wait for its apply to end; what happened."""
    base = client.settings()
    t0 = time.monotonic()
    rev = client.put_settings(base.revision, changes, note, force=force)

    def ended() -> Any:
        st = client.status()
        return st if st.apply is not None and st.apply.revision == rev.revision and st.apply.outcome != "running" \
            else None

    st = wait_until(ended, 2 * COLD_START_S, every=0.5, what=f"the apply of {changes}")
    client.wait_for({"ready"}, COLD_START_S)
    assert st.apply is not None
    return {"revision": rev.revision, "plan": st.apply.plan.kind if st.apply.plan else None,
            "outcome": st.apply.outcome, "seconds": round(time.monotonic() - t0, 1), "t0": t0,
            "t1": time.monotonic()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--model", default=None, help="default: the demo model")
    p.add_argument("--load-format", default=None)
    p.add_argument("--values", nargs="*", default=[], help="KEY=VALUE of both deployments")
    p.add_argument("--apply", nargs="*", default=["max_num_seqs=5"], help="KEY=VALUE applied to the second")
    p.add_argument("--bad", nargs="*", default=["cpu_kv_cache_gib=0.001"],
                   help="a forced revision that fails (--bad with no values: none)")


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "clients": a.clients}
    data_dir = Path(tempfile.mkdtemp(prefix="deployments-"))
    # a model of your own: the engine waits for the first revision (no demo model to build or start first)
    env = {"LLMOPS_MODEL_ROOTS": json.dumps([str(Path(a.model).resolve().parent)]), "LLMOPS_AUTOSTART": "false",
           "LLMOPS_STARTUP_TIMEOUT_S": "1200"} if a.model else {}
    with running_engine(data_dir, env=env, demo=not a.model) as engine:
        model = str(Path(a.model).resolve()) if a.model else str(engine.data_dir / "models" / "demo")
        both = {"model": model, **({"load_format": a.load_format} if a.load_format else {}), **parse_values(a.values)}
        first = engine.client.settings()
        engine.client.put_settings(first.revision, {**both}, "bench: deployment a", force=True)
        if a.model:
            engine.client.engine_action("start")
        engine.client.wait_for({"ready"}, 2 * COLD_START_S, revision=engine.client.settings().revision)
        engine.client.create_deployment("demo-b", {**both, "max_num_seqs": 8} if not a.model else both,
                                        note="bench: deployment b", force=True)
        b = engine.client.of("demo-b")
        if a.model:
            b.engine_action("start")
        b.wait_for({"ready"}, 2 * COLD_START_S)
        # the capacity model against vLLM's log, for each deployment's start (its ready event)
        report["capacity"] = {name: [e.data.get("capacity") for e in c.events(kinds=["ready"], since=0, limit=50)]
                              for name, c in (("demo", engine.client), ("demo-b", b))}
        report["deployments"] = [d.model_dump(mode="json") for d in engine.client.deployments()]
        load_a = Load(engine.url, clients=a.clients, stream=True, max_tokens=a.max_tokens, model="demo").start()
        load_b = Load(engine.url, clients=a.clients, stream=True, max_tokens=a.max_tokens, model="demo-b").start()
        load_a.wait_for(2 * a.clients, timeout=600)
        load_b.wait_for(2 * a.clients, timeout=600)
        t_before = time.monotonic()
        time.sleep(a.window)  # a measuring window of steady load
        t_after_window = time.monotonic()
        good = apply_and_wait(b, parse_values(a.apply), "bench: apply on b")
        bad = apply_and_wait(b, parse_values(a.bad), "bench: forced bad revision on b", force=True) if a.bad else None
        out_a, out_b = load_a.stop(), load_b.stop()
        before = tokens_per_s(out_a, t_before, t_after_window, a.max_tokens)
        report["untouched"] = {
            "throughput_before_tok_s": before,
            "throughput_during_apply_tok_s": tokens_per_s(out_a, good["t0"], good["t1"], a.max_tokens),
            "throughput_during_bad_tok_s": tokens_per_s(out_a, bad["t0"], bad["t1"], a.max_tokens) if bad else None,
            "longest_gap_s": round(longest_gap(out_a, good["t0"], (bad or good)["t1"]), 3), "load": summary(out_a)}
        u = report["untouched"]
        for key in ("throughput_during_apply_tok_s", "throughput_during_bad_tok_s"):
            if u[key] is None:
                continue
            u[key.replace("_tok_s", "_over_before")] = round(u[key] / before, 3) if before else None
        report["applied"] = {
            "apply": {k: v for k, v in good.items() if k not in ("t0", "t1")},
            "bad": {k: v for k, v in bad.items() if k not in ("t0", "t1")} if bad else None,
            "longest_gap_apply_s": round(longest_gap(out_b, good["t0"], good["t1"]), 3),
            "longest_gap_bad_s": round(longest_gap(out_b, bad["t0"], bad["t1"]), 3) if bad else None,
            "load": summary(out_b)}
        engine.client.delete_deployment("demo-b", confirm="demo-b")
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (a.out / "deployments.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: report[k] for k in ("untouched", "applied")}, indent=1))

