"""The product's own benchmarks on this host, through its API (what the console's Benchmarks page runs): the guided
search for max_num_seqs and a concurrency sweep, each level with fresh prompts and its prefix-cache hit rate; then
the same sweep with one seed at every level (how every run was made before: ``--seed 0``), to show what that did.

    flock /tmp/llmops-heavy.lock python -m bench builtin-benchmarks --out DIR [--fixtures tests/fixtures]

Writes ``builtin-benchmarks.json`` under ``--out`` as it goes. With ``--fixtures``, also vLLM's own /metrics before
and after one level of prompts it has already seen (``vllm-0.32-cpu-metrics-cache-{before,after}.txt``): the unit
test of the hit rate reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine.client import EngineClient
from engine.schemas import BenchmarkRunOut
from tests.testkit.engine import COLD_START_S, instance_headers, running_engine
from tests.testkit.wait import wait_until


def finished(client: EngineClient, run: BenchmarkRunOut, timeout: float = 3600) -> BenchmarkRunOut:
    def ended() -> BenchmarkRunOut | None:
        now = client.benchmark(run.id)
        return now if now.status != "running" else None

    done = wait_until(ended, timeout, every=2, what=f"the end of benchmark {run.id}")
    assert done.status == "done", done.error
    return done


def rows(run: BenchmarkRunOut) -> list[dict[str, Any]]:
    return [{"max_num_seqs": lv.max_num_seqs, "concurrency": lv.concurrency, "seed": lv.seed,
             "output_tok_s": lv.output_throughput, "p50_e2el_s": (lv.p50_e2el_ms or 0) / 1000,
             "p95_e2el_s": (lv.p95_e2el_ms or 0) / 1000, "p95_ttft_s": (lv.p95_ttft_ms or 0) / 1000,
             "prefix_cache_hit_pct": lv.prefix_cache_hit_pct, "warnings": lv.warnings, "completed": lv.completed}
            for lv in run.results]


def vllm_metrics(client: EngineClient) -> str:
    inst = next(i for i in client.status().instances if i.serving and i.address)
    return httpx.get(f"{inst.address}/metrics", headers=instance_headers(inst.pid), timeout=10).text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fixtures", type=Path)
    p.add_argument("--candidates", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--target", type=float, default=10.0)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--sweep-seqs", type=int, default=6)
    p.add_argument("--sweep", type=int, nargs="+", default=[1, 2, 4, 8, 16])


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)}}

    def save() -> None:
        (a.out / "builtin-benchmarks.json").write_text(json.dumps(report, indent=1, default=str))

    def loadavg() -> float:
        return round(os.getloadavg()[0], 2)

    work = Path(tempfile.mkdtemp(prefix="builtin-benchmarks-"))
    with running_engine(work / "data") as engine:
        client = engine.client
        client.wait_for({"ready"}, COLD_START_S)
        report["load_1m_before_search"] = loadavg()
        search = finished(client, client.start_search("short_chat", a.target, a.candidates, a.num_prompts))
        report["search"] = {"id": search.id, "levels": rows(search), "proposal": search.proposal,
                            "load_1m_after": loadavg()}
        save()
        client.wait_for({"ready"}, COLD_START_S)
        base = client.settings()
        rev = client.put_settings(base.revision, {"max_num_seqs": a.sweep_seqs}, "builtin benchmarks: the sweep")
        client.wait_for({"ready"}, COLD_START_S, revision=rev.revision)
        for label, seed in (("fresh", None), ("seed 0 at every level (as before)", 0)):
            report[f"load_1m_before_sweep_{seed}"] = loadavg()
            sweep = finished(client, client.start_sweep("short_chat", a.sweep, a.num_prompts, seed=seed))
            report.setdefault("sweeps", []).append({"label": label, "id": sweep.id, "levels": rows(sweep),
                                                    "load_1m_after": loadavg()})
            save()
        if a.fixtures is not None:  # one level of long prompts vLLM has seen: its /metrics before and after
            finished(client, client.start_sweep("rag", [2], 4, seed=99))
            before = vllm_metrics(client)
            again = finished(client, client.start_sweep("rag", [2], 4, seed=99))
            after = vllm_metrics(client)
            (a.fixtures / "vllm-0.32-cpu-metrics-cache-before.txt").write_text(before)
            (a.fixtures / "vllm-0.32-cpu-metrics-cache-after.txt").write_text(after)
            report["fixture_level"] = rows(again)
        report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        save()
    for run in [report["search"], *report["sweeps"]]:
        print(run.get("label", "search"))
        for r in run["levels"]:
            print(f"  seqs {r['max_num_seqs']} c{r['concurrency']}: {r['output_tok_s']:.0f} tok/s, P50 "
                  f"{r['p50_e2el_s']:.2f} s, P95 {r['p95_e2el_s']:.2f} s, TTFT P95 {r['p95_ttft_s']:.2f} s, "
                  f"cache hits {r['prefix_cache_hit_pct']} %, seed {r['seed']}")

