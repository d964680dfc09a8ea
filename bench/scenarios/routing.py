"""Routing among replicas: the gateway's ``prefix`` policy against ``least_outstanding`` on the same two replicas,
alternated in one run (the policy is a soft change: no restart between runs), on a shared-prefix load and on a load
with no shared prefix.

    python -m bench routing --out DIR                                            # CPU: the demo model
    python -m bench routing --profile h200                                       # 2 x 0.42 of an H200, the 8B shape

The shared-prefix load is vLLM's ``prefix_repetition`` dataset: ``--prefixes`` system prompts of ``--prefix-len``
tokens (together more than one replica's KV cache holds, on the H200), each request one of them and a fresh
``--suffix-len``-token question, ``--output-len`` tokens out; the other load is vLLM's ``random`` dataset. Fresh
prompts every run (a new seed: new prefixes, so no run finds the last one's cache). Each run records vLLM's figures,
each replica's prefix-cache hit rate over the run (its own /metrics), how the gateway routed (GET /api/status), and
the engine's CPU. Rounds run least_outstanding, prefix, prefix, least_outstanding so that drift favours neither.
Also measures the routing decision itself (keys and choice, in this process) on prompts of the load's size.
Writes ``routing.json`` and ``routing.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.base import REPO
from bench.scenarios.gateway_overhead import Engine, _cpu, cache_over, vllm_key
from engine.benchmarks.runs import fresh_seed

POLICIES = ("least_outstanding", "prefix", "prefix", "least_outstanding")


def replicas(engine: Engine) -> list[dict[str, Any]]:
    """The instances that serve: name, address, pid, the key to scrape them, and how the gateway routed to them."""
    st = engine.http.get("/api/status").json()
    out = []
    for inst in st.get("instances") or []:
        if inst.get("serving") and inst.get("address"):
            out.append({"name": inst["name"], "url": inst["address"].rstrip("/"), "pid": inst.get("pid"),
                        "key": vllm_key(int(inst["pid"])) if inst.get("pid") else None,
                        "routing": inst.get("routing")})
    return out


def scrape_one(rep: dict[str, Any]) -> str | None:
    try:
        resp = httpx.get(f"{rep['url']}/metrics", timeout=10,
                         headers={"authorization": f"Bearer {rep['key']}"} if rep.get("key") else None)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return resp.text


def set_policy(engine: Engine, policy: str) -> None:
    """The deployment's routing, as an operator changes it (a revision, applied without a restart)."""
    base = engine.http.get("/api/settings").json()
    if base["values"].get("routing") == policy:
        return
    r = engine.http.put("/api/settings", json={"base_revision": base["revision"], "values": {"routing": policy},
                                               "note": f"routing bench: {policy}"})
    r.raise_for_status()
    revision = r.json()["revision"]
    deadline = time.monotonic() + 60
    while engine.http.get("/api/status").json().get("running_revision") != revision:
        if time.monotonic() > deadline:
            raise SystemExit(f"routing {policy} was not applied within 60 s")
        time.sleep(0.2)


def run_once(engine: Engine, a: argparse.Namespace, load: str, policy: str, workdir: Path, tag: str
             ) -> dict[str, Any]:
    out = workdir / f"{tag}.json"
    seed = fresh_seed()
    prompts = a.prompts if load == "shared" else (a.random_prompts or a.prompts)
    tokenizer = a.model or str(REPO / "data" / "models" / "demo")
    if load == "shared":
        dataset = ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(a.prefix_len),
                   "--prefix-repetition-suffix-len", str(a.suffix_len), "--prefix-repetition-num-prefixes",
                   str(a.prefixes), "--prefix-repetition-output-len", str(a.output_len)]
    else:
        dataset = ["--dataset-name", "random", "--random-input-len", str(a.prefix_len + a.suffix_len),
                   "--random-output-len", str(a.output_len)]
    argv = ["--backend", "openai", "--base-url", engine.url, "--endpoint", "/v1/completions", "--model", "bench",
            "--tokenizer", tokenizer, *dataset, "--ignore-eos", "--num-prompts", str(prompts),
            "--max-concurrency", str(a.clients), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--result-dir", str(workdir),
            "--result-filename", f"{tag}-detail.json"]
    reps = replicas(engine)
    before_metrics = {r["name"]: scrape_one(r) for r in reps}
    before_routes = {r["name"]: r.get("routing") or {} for r in reps}
    cpu0, t0 = _cpu(engine.proc.pid), time.monotonic()
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "bench.scenarios.gateway_overhead", "--vllm-bench", str(out), "--",
                           *argv], cwd=REPO, capture_output=True, text=True, check=False, env=env)
    cpu1, t1 = _cpu(engine.proc.pid), time.monotonic()
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vLLM's benchmark failed ({tag}):\n{done.stderr[-3000:]}")
    r = json.loads(out.read_text())
    (workdir / f"{tag}-detail.json").unlink(missing_ok=True)
    after = {x["name"]: x for x in replicas(engine)}
    per: dict[str, Any] = {}
    queries = hits = 0.0
    for rep in reps:
        use = cache_over(before_metrics[rep["name"]], scrape_one(rep))
        routes_after = (after.get(rep["name"]) or {}).get("routing") or {}
        routed = {k: int(routes_after.get(k) or 0) - int(before_routes[rep["name"]].get(k) or 0)
                  for k in ("prefix", "home", "load")}
        per[rep["name"]] = {"hit_pct": use.hit_pct if use else None, "routed": routed}
        if use is not None:
            queries, hits = queries + use.queries, hits + use.hits
    wall = float(r.get("duration") or (t1 - t0))
    out_tok_s = r.get("output_throughput")
    return {"tag": tag, "load": load, "policy": policy, "seed": seed, "prompts": prompts,
            "completed": r.get("completed"), "failed": prompts - int(r.get("completed") or 0),
            "request_s": r.get("request_throughput"), "output_tok_s": out_tok_s,
            "ttft_p50_ms": r.get("median_ttft_ms"), "ttft_p99_ms": r.get("p99_ttft_ms"),
            "e2el_p95_ms": r.get("p95_e2el_ms"), "itl_p50_ms": r.get("median_itl_ms"), "wall_s": round(wall, 1),
            "hit_pct": round(100 * hits / queries, 1) if queries else None, "replicas": per,
            "engine_cpu_pct": round(100 * (cpu1 - cpu0) / wall, 1),
            "engine_cpu_pct_per_1k_tok_s": round(100 * (cpu1 - cpu0) / wall / (out_tok_s / 1000), 2)
            if out_tok_s else None}


def decision_cost(prefix_bytes: int, suffix_bytes: int, prefixes: int, n: int = 20_000) -> dict[str, float]:
    """The routing decision in this process: prompt keys and the choice among two upstreams with warm indices, for
    prompts of the load's size (µs per request at P50, P99)."""
    import asyncio
    import random

    from engine.gateway import Admission
    from engine.gateway.routing import prefix_keys

    rng = random.Random(1)
    systems = [rng.randbytes(prefix_bytes) for _ in range(prefixes)]

    async def go() -> list[float]:
        gate = Admission(queue_size=8, queue_timeout_s=5)
        await gate.open("http://a", 1, instance="a")
        await gate.open("http://b", 1, instance="b")
        times = []
        held = []
        for _ in range(n):
            prompt = rng.choice(systems) + rng.randbytes(suffix_bytes)
            t0 = time.perf_counter()
            up = await gate.acquire(time.monotonic() + 5, prefix_keys(prompt))
            times.append(time.perf_counter() - t0)
            held.append(up)
            if len(held) > 32:  # about 32 in flight
                await gate.release(held.pop(0))
        return times

    times = sorted(asyncio.run(go()))
    return {"p50_us": round(1e6 * times[len(times) // 2], 1), "p99_us": round(1e6 * times[int(0.99 * len(times))], 1),
            "prompt_bytes": prefix_bytes + suffix_bytes}


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for load in ("shared", "random"):
        by = {p: [r for r in runs if r["load"] == load and r["policy"] == p] for p in ("least_outstanding", "prefix")}
        if not all(by.values()):
            continue

        def mean(rs: list[dict[str, Any]], k: str) -> float | None:
            vals = [r[k] for r in rs if r.get(k) is not None]
            return round(statistics.fmean(vals), 2) if vals else None

        lo, px = by["least_outstanding"], by["prefix"]
        lo_rps, px_rps = mean(lo, "request_s"), mean(px, "request_s")
        lo_ttft, px_ttft = mean(lo, "ttft_p50_ms"), mean(px, "ttft_p50_ms")
        rows.append({"load": load, "runs": len(lo) + len(px),
                     "req_s": (lo_rps, px_rps), "throughput_ratio": round(px_rps / lo_rps, 3) if lo_rps and px_rps
                     else None, "ttft_p50_ms": (lo_ttft, px_ttft),
                     "ttft_p50_ratio": round(px_ttft / lo_ttft, 3) if lo_ttft and px_ttft else None,
                     "ttft_p99_ms": (mean(lo, "ttft_p99_ms"), mean(px, "ttft_p99_ms")),
                     "hit_pct": (mean(lo, "hit_pct"), mean(px, "hit_pct")),
                     "engine_cpu_per_1k_tok_s": (mean(lo, "engine_cpu_pct_per_1k_tok_s"),
                                                 mean(px, "engine_cpu_pct_per_1k_tok_s")),
                     "failed": sum(int(r["failed"]) for r in lo + px)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def pair(p: tuple[Any, Any], fmt: str = "{:.1f}") -> str:
        return " → ".join("–" if v is None else fmt.format(v) for v in p)

    lines = ["| load | runs | req/s (least outstanding → prefix) | ratio | TTFT P50 ms | ratio | TTFT P99 ms "
             "| prefix-cache hits % | engine CPU % per 1k tok/s | failed |",
             "| --- | ---: | --- | ---: | --- | ---: | --- | --- | --- | ---: |"]
    for r in rows:
        lines.append(f"| {r['load']} | {r['runs']} | {pair(r['req_s'])} | **{r['throughput_ratio']}** "
                     f"| {pair(r['ttft_p50_ms'])} | **{r['ttft_p50_ratio']}** | {pair(r['ttft_p99_ms'])} "
                     f"| {pair(r['hit_pct'])} | {pair(r['engine_cpu_per_1k_tok_s'], '{:.2f}')} | {r['failed']} |")
    return "\n".join(lines)


def replica_and_load_options(p: argparse.ArgumentParser) -> None:
    """The two replicas and the shared-prefix load: the options this scenario and ``routing-events`` share."""
    p.add_argument("--model", help="a model folder (default: the demo model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--utilization", type=float, default=0.42, help="each replica's gpu_memory_utilization (GPU)")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=0.05,
                   help="each replica's KV cache on the CPU build (the demo model's KV takes about 1 KiB a "
                   "token: 0.005 GiB holds 5,120 tokens)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--prefixes", type=int, default=24, help="system prompts of the shared-prefix load")
    p.add_argument("--prefix-len", type=int, default=256, help="tokens of each system prompt")
    p.add_argument("--suffix-len", type=int, default=16, help="tokens of each request's own question")
    p.add_argument("--output-len", type=int, default=8)


def add_arguments(p: argparse.ArgumentParser) -> None:
    replica_and_load_options(p)
    p.add_argument("--prompts", type=int, default=240, help="requests per run of the shared-prefix load (≥ 30 s of "
                   "it on a GPU)")
    p.add_argument("--random-prompts", type=int, help="requests per run of the load with no shared prefix (default: "
                   "--prompts; each is a whole prefill, so fewer last as long)")
    p.add_argument("--rounds", type=int, default=1, help="least_outstanding, prefix, prefix, least_outstanding each")
    p.add_argument("--loads", nargs="+", default=["shared", "random"], choices=("shared", "random"))


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "runs": []}
    chars_per_token = 4
    report["decision"] = decision_cost(a.prefix_len * chars_per_token, a.suffix_len * chars_per_token, a.prefixes)
    print(f"routing decision: {report['decision']}", flush=True)

    def save() -> None:
        report["summary"] = summary(report["runs"])
        (a.out / "routing.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "routing.md").write_text(table(report["summary"]) + "\n")

    engine_args = argparse.Namespace(model=a.model, utilization=a.utilization, max_model_len=a.max_model_len,
                                     load_format=a.load_format, max_num_seqs=a.max_num_seqs, cap_vs_restart=False,
                                     engine_nice=None, out=a.out)
    with tempfile.TemporaryDirectory(prefix="llmops-routing-") as tmp:
        workdir = Path(tmp)
        engine = Engine(REPO, "this", engine_args, workdir)
        try:
            base = engine.http.get("/api/settings").json()
            values: dict[str, Any] = {"max_num_seqs": a.max_num_seqs, "served_model_name": "bench", "replicas": 2,
                                      "routing": "least_outstanding"}
            if a.model:
                values.update(model=str(Path(a.model).resolve()), gpu_memory_utilization=a.utilization,
                              max_model_len=a.max_model_len, load_format=a.load_format)
            else:
                values.update(model=str(engine.data_dir / "models" / "demo"), cpu_kv_cache_gib=a.cpu_kv_cache_gib)
            r = engine.http.put("/api/settings", json={"base_revision": base["revision"], "values": values,
                                                       "note": "routing bench", "force": True})
            r.raise_for_status()
            engine.http.post("/api/engine/start")
            deadline = time.monotonic() + 1800
            while len(replicas(engine)) < 2:
                st = engine.http.get("/api/status").json()
                if time.monotonic() > deadline or st["state"] == "failed":
                    raise SystemExit(f"two replicas did not come up: {st['reason']}")
                time.sleep(1)
            report["replicas"] = [{k: v for k, v in x.items() if k != "key"} for x in replicas(engine)]
            n = 0
            for _ in range(a.rounds):
                for load in a.loads:
                    for policy in POLICIES:
                        set_policy(engine, policy)
                        n += 1
                        row = run_once(engine, a, load, policy, workdir, f"{n:02d}-{load}-{policy}")
                        report["runs"].append(row)
                        print(json.dumps(row), flush=True)
                        save()
        finally:
            engine.stop()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(table(report["summary"]))
