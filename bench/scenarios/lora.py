"""LoRA adapters through the engine (issue 35): how long from registering an adapter (POST
/api/deployments/{name}/adapters, while the deployment serves) to its first answer, and what serving several
adapters in one batch costs against the base model alone — vLLM's own serving benchmark through the gateway, the
base model and ``--adapters`` adapters chosen at random per request (its ``--lora-modules``), alternated base,
adapters, adapters, base on the same vLLM, fresh prompts every run.

The adapters are written for the model's shape (random A and B of ``--rank`` on q, k, v and o of every layer, in
PEFT's layout) beside the model, inside the engine's model roots; the deployment runs with ``enable_lora``,
``max_loras`` = ``--adapters`` and ``max_lora_rank`` = ``--rank``. Writes ``lora.json`` and ``lora.md``.

    python -m bench lora --out DIR                       # CPU: the demo model
    python -m bench lora --profile h200                  # the 8B shape on the H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.base import REPO
from bench.scenarios.gateway_overhead import Engine, run_once
from bench.scenarios.scale_to_zero import first_token, pct


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model folder (default: the demo model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--adapters", type=int, default=4, help="adapters in the mixed runs (max_loras)")
    p.add_argument("--rank", type=int, default=16, help="their rank (max_lora_rank)")
    p.add_argument("--registrations", type=int, default=10, help="register-to-first-answer measurements")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--prompts", type=int, default=2000, help="prompts of each throughput run (>= 30 s on a GPU)")
    p.add_argument("--rounds", type=int, default=1, help="base, adapters, adapters, base per round")


def write_adapters(model: Path, folder: Path, n: int, rank: int) -> list[Path]:
    """``n`` LoRA adapters of ``rank`` for the model at ``model`` (its config.json's shape), random weights."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
              "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim)}
    out = []
    for i in range(n):
        where = folder / f"lora-{i}"
        where.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(1000 + i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for module, (o, inp) in shapes.items():
                prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * 0.01).to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(o, rank, generator=g) * 0.01).to(torch.bfloat16)
        save_file(tensors, str(where / "adapter_model.safetensors"))
        (where / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": list(shapes), "bias": "none", "base_model_name_or_path": model.name}))
        out.append(where)
    return out


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "registrations": [], "runs": []}

    def save() -> None:
        report["summary"] = summary(report)
        (a.out / "lora.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "lora.md").write_text(table(report["summary"]) + "\n")

    model = Path(a.model).resolve() if a.model else (REPO / "data" / "models" / "demo").resolve()
    folder = model.parent / "bench-loras"  # inside the engine's model roots (the model's parent)
    paths = write_adapters(model, folder, a.adapters, a.rank)
    a.values = {"enable_lora": True, "max_loras": a.adapters, "max_lora_rank": a.rank}
    a.seed, a.prompts_per_client, a.min_prompts = None, 1, a.prompts  # run_once's: fresh prompts every run
    engine_args = argparse.Namespace(model=a.model, utilization=a.utilization, max_model_len=a.max_model_len,
                                     load_format=a.load_format, max_num_seqs=a.max_num_seqs, cap_vs_restart=False,
                                     engine_nice=None, out=a.out, values=a.values)
    with tempfile.TemporaryDirectory(prefix="llmops-lora-") as tmp:
        engine = Engine(REPO, "this", engine_args, Path(tmp))
        try:
            engine.serve()
            first_token(engine, 4)  # the first request after a start pays for warm-up
            # registering an adapter while it serves: the API's answer, then the adapter's first token
            for n in range(a.registrations):
                name = f"reg-{n}-{uuid.uuid4().hex[:6]}"
                t0 = time.monotonic()
                resp = engine.http.post("/api/deployments/demo/adapters",
                                        json={"name": name, "path": str(paths[n % len(paths)])}, timeout=600)
                registered = time.monotonic() - t0
                if resp.status_code != 201:
                    raise SystemExit(f"registering {name}: HTTP {resp.status_code} {resp.text[:300]}")
                ttft, _, ok = first_token(engine, 8, model=name)
                reg = {"n": n, "register_s": round(registered, 4), "first_answer_s": round(registered + ttft, 4),
                       "ok": ok}
                report["registrations"].append(reg)
                print(json.dumps(reg), flush=True)
                engine.http.delete(f"/api/deployments/demo/adapters/{name}").raise_for_status()
                save()
            names = []
            for i, path in enumerate(paths):
                name = f"mix-{i}"
                engine.http.post("/api/deployments/demo/adapters", json={"name": name, "path": str(path)},
                                 timeout=600).raise_for_status()
                names.append(name)
            work = Path(tmp) / "runs"
            work.mkdir()
            for r in range(a.rounds):
                for kind in ("base", "adapters", "adapters", "base"):
                    extra = ["--lora-modules", *names] if kind == "adapters" else []
                    tag = f"{kind}-{r}-{len(report['runs'])}"
                    row = run_once(engine, engine.url, a.concurrency, a, work, tag,
                                   prompts=a.prompts, extra=extra)
                    row["kind"] = kind
                    row.pop("itls", None)
                    report["runs"].append(row)
                    print(f"{kind}: {row['output_tok_s']:.0f} tok/s, TTFT P50 {row['ttft_p50_ms']:.0f} ms, "
                          f"{row['failed']} failed", flush=True)
                    save()
            report["adapters_listed"] = [a_["name"] for a_ in engine.http.get(
                "/api/deployments/demo/adapters").json()]
        finally:
            engine.stop()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(table(report["summary"]))


def summary(report: dict[str, Any]) -> dict[str, Any]:
    regs = [r for r in report["registrations"] if r["ok"]]
    out: dict[str, Any] = {"registrations": len(report["registrations"]),
                           "registrations_failed": len(report["registrations"]) - len(regs)}
    for key in ("register_s", "first_answer_s"):
        values = [r[key] for r in regs]
        out[key] = {"p50": pct(values, 0.5), "max": max(values) if values else None}
    for kind in ("base", "adapters"):
        runs = [r for r in report["runs"] if r["kind"] == kind]
        if runs:
            out[kind] = {k: round(statistics.fmean(r[k] for r in runs if r.get(k) is not None), 1)
                         for k in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms")
                         if any(r.get(k) is not None for r in runs)}
            out[kind]["failed"] = sum(int(r.get("failed") or 0) for r in runs)
            out[kind]["runs"] = len(runs)
    if "base" in out and "adapters" in out and out["base"].get("output_tok_s"):
        out["throughput_ratio"] = round(out["adapters"]["output_tok_s"] / out["base"]["output_tok_s"], 3)
    return out


def table(s: dict[str, Any]) -> str:
    def sec(v: float | None) -> str:
        return "–" if v is None else f"{v * 1000:.0f} ms"

    lines = [f"{s['registrations']} registrations, {s['registrations_failed']} failed: the API's answer "
             f"{sec(s['register_s']['p50'])} P50 ({sec(s['register_s']['max'])} max), the adapter's first answer "
             f"{sec(s['first_answer_s']['p50'])} P50 ({sec(s['first_answer_s']['max'])} max) after the request "
             "to register it", ""]
    if "base" in s and "adapters" in s:
        lines += ["| load | output tok/s | TTFT P50 ms | TTFT P99 ms | ITL P50 ms | failed |",
                  "|---|---:|---:|---:|---:|---:|"]
        for kind, label in (("base", "base model alone"), ("adapters", "adapters, one at random per request")):
            r = s[kind]
            lines.append(f"| {label} | {r.get('output_tok_s')} | {r.get('ttft_p50_ms')} | {r.get('ttft_p99_ms')} | "
                         f"{r.get('itl_p50_ms')} | {r['failed']} |")
        lines.append(f"\nadapters against the base: x{s.get('throughput_ratio')} the throughput")
    return "\n".join(lines)
