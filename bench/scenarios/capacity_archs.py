"""Capacity on five architectures, on one GPU: Gemma 3 1B (interleaved sliding/global), Mistral-7B-v0.1 (sliding
window), DeepSeek-V2-Lite (MLA + MoE), Qwen3-30B-A3B (MoE) and Qwen3-4B (GQA, an explicit head_dim, a tied
embedding) — real configs, dummy weights, synthetic tokenizers. Each architecture starts twice: start 1 calibrates
(weights, non-torch memory, peak activation, vLLM's view of the device), start 2 is held out (another utilization
and max_model_len) and predicted from start 1's log only; vLLM is stopped as soon as it has logged its memory
report. Every start is eager (--enforce-eager, max_num_seqs 64: ~50-75 s a start instead of ~100-125 s).

    python -m bench capacity-archs --profile h200                                  # all five, within --budget-s
    python -m bench capacity-archs --profile h200 --only qwen3-4b qwen3-30b-a3b    # a subset, in this order

The starts are run by capacity_archs.sh beside this module (the vLLM processes, their logs, the wait for the GPU's
memory between them); this module is its helper (python -m bench.scenarios.capacity_archs list | prepare |
held-out | summary): the starts to run, the model folders, the engine's predictions for each start, and the table
of predicted against logged KV tokens. Under --out: <arch>-<n>.log, predictions.json, summary.json, starts.tsv,
run.log, versions.txt, gpu.txt, DONE. The configs are the real ones of tests/fixtures/model_configs; the tokenizer
is synthetic (a word-level vocabulary of the model's size, as ../shared/gpu/make_shape_model.py writes it), so
nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.base import REPO

CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
DRIVER = Path(__file__).with_name("capacity_archs.sh")
COMMON: dict[str, Any] = {"max_num_seqs": 64, "enforce_eager": True, "load_format": "dummy"}
# run order: the riskiest layouts first, so that a cut budget loses the least new
STARTS: list[tuple[str, list[dict[str, Any]]]] = [
    ("gemma-3-1b-it", [{"gpu_memory_utilization": 0.5, "max_model_len": 4096},
                       {"gpu_memory_utilization": 0.8, "max_model_len": 32768}]),
    ("mistral-7b-v0.1", [{"gpu_memory_utilization": 0.5, "max_model_len": 4096},
                         {"gpu_memory_utilization": 0.8, "max_model_len": 32768}]),
    ("deepseek-v2-lite", [{"gpu_memory_utilization": 0.5, "max_model_len": 4096},
                          {"gpu_memory_utilization": 0.8, "max_model_len": 8192}]),
    ("qwen3-30b-a3b", [{"gpu_memory_utilization": 0.5, "max_model_len": 4096},
                       {"gpu_memory_utilization": 0.8, "max_model_len": 8192}]),
    ("qwen3-4b", [{"gpu_memory_utilization": 0.5, "max_model_len": 4096},
                  {"gpu_memory_utilization": 0.8, "max_model_len": 8192}]),
]


def case_values(arch: str, n: int) -> dict[str, Any]:
    return {**COMMON, **dict(STARTS)[arch][n - 1]}


def write_model(arch: str, folder: Path) -> None:
    """config.json of the real model, and a synthetic tokenizer with its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    cfg = json.loads((CONFIGS / arch / "config.json").read_text())
    vocab_size = int((cfg.get("text_config") or cfg)["vocab_size"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": int(cfg.get("max_position_embeddings") or 1 << 20),
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))


def engine_settings(model: str, values: dict[str, Any]) -> Any:
    from engine.revisions import EngineSettings

    base = EngineSettings.model_construct(model=model).model_dump()
    return EngineSettings.model_construct(**{**base, "model": model, "served_model_name": "m", **values})


def cmd_list(_: argparse.Namespace) -> None:
    for arch, starts in STARTS:
        for n, values in enumerate(starts, 1):
            print(arch, n, values["gpu_memory_utilization"], values["max_model_len"])


def cmd_prepare(a: argparse.Namespace) -> None:
    out, models = Path(a.out), Path(a.models)
    out.mkdir(parents=True, exist_ok=True)
    for arch, _ in STARTS:
        t0 = time.monotonic()
        write_model(arch, models / arch)
        print(f"model folder {models / arch} in {time.monotonic() - t0:.1f} s", flush=True)
    device: dict[str, Any] = {}
    try:
        import torch

        free, total = torch.cuda.mem_get_info()
        device = {"total_bytes": int(total), "free_bytes": int(free), "name": torch.cuda.get_device_name(0),
                  "torch": torch.__version__}
    except (ImportError, RuntimeError, AssertionError) as exc:
        device = {"error": f"{type(exc).__name__}: {exc}"}
        if a.assume_total_gib:  # a dry run without a GPU
            total = int(a.assume_total_gib * (1 << 30))
            device = {"total_bytes": total, "free_bytes": total, "name": "assumed", "dry_run": device["error"]}
    (out / "device.json").write_text(json.dumps(device, indent=1))
    rows: list[dict[str, Any]] = []
    for arch, starts in STARTS:
        for n in range(1, len(starts) + 1):
            rows.append({"arch": arch, "n": n, "values": case_values(arch, n), **predict_row(arch, n, models, device)})
    (out / "predictions.json").write_text(json.dumps(rows, indent=1))
    print(f"predictions for {len(rows)} starts in {out / 'predictions.json'}", flush=True)


def predict_row(arch: str, n: int, models: Path, device: dict[str, Any]) -> dict[str, Any]:
    """The engine's uncalibrated prediction for one start, on the device as torch sees it."""
    if "total_bytes" not in device:
        return {"predicted": None, "predicted_error": device.get("error", "no device")}
    try:
        from engine.capacity import Device, load_shape, predict

        shape = load_shape(models / arch)
        dev = Device("cuda", device["total_bytes"], device["free_bytes"], 1, device["name"])
        pred = predict(shape, engine_settings(str(models / arch), case_values(arch, n)), dev)
        return {"predicted": pred.as_dict(), "parameters": shape.parameters(),
                "unmodelled": [u.feature for u in shape.unmodelled]}
    except (ImportError, KeyError, ValueError, TypeError, OSError) as exc:  # the engine's imports on this host
        return {"predicted": None, "predicted_error": f"{type(exc).__name__}: {exc}"}


def calibrated(arch: str, log: Path, model: str, held_out: dict[str, Any]) -> dict[str, Any]:
    """The held-out start's prediction, calibrated from start 1's log alone (what the engine does on a host)."""
    from engine.capacity import (
        GIB,
        Device,
        batched_tokens,
        estimate_activation,
        load_shape,
        parse_start,
        predict,
        to_calibration,
    )
    from engine.db import CalibrationRow

    shape = load_shape(Path(model))
    first = engine_settings(model, case_values(arch, 1))
    r = parse_start(log.read_text(errors="replace").splitlines())
    if not (r.complete and r.requested_gib and r.utilization and r.activation_gib is not None):
        return {"calibrated": None, "calibrated_error": f"{log.name}: the start logged no complete memory report"}
    tokens = batched_tokens(first, shape, "cuda")
    row = CalibrationRow(host="h200", model=model, weights=round((r.weights_gib or 0) * GIB),
                         activation=round(r.activation_gib * GIB),
                         activation_estimate=estimate_activation(shape, first, tokens),
                         non_torch=round((r.non_torch_gib or 0) * GIB),
                         device_total=round(r.requested_gib / r.utilization * GIB), batched_tokens=tokens,
                         enforce_eager=first.enforce_eager, max_num_seqs=first.max_num_seqs, tensor_parallel_size=1,
                         dtype="auto")
    total = round(r.requested_gib / r.utilization * GIB)
    pred = predict(shape, engine_settings(model, held_out), Device("cuda", total, total), to_calibration([row]))
    return {"calibrated": pred.as_dict(), "calibrated_from": log.name}


def cmd_held_out(a: argparse.Namespace) -> None:
    out = Path(a.out)
    rows = json.loads((out / "predictions.json").read_text())
    for row in rows:
        if row["arch"] == a.arch and row["n"] == 2:
            try:
                row.update(calibrated(a.arch, out / f"{a.arch}-1.log", str(Path(a.models) / a.arch), row["values"]))
            except (ImportError, KeyError, ValueError, TypeError, OSError) as exc:
                row.update({"calibrated": None, "calibrated_error": f"{type(exc).__name__}: {exc}"})
            print(json.dumps({k: (v or {}).get("kv_tokens") if k == "calibrated" else v for k, v in row.items()
                              if k in ("arch", "n", "calibrated", "calibrated_error")}), flush=True)
    (out / "predictions.json").write_text(json.dumps(rows, indent=1))


def cmd_summary(a: argparse.Namespace) -> None:
    from engine.capacity import parse_start

    out = Path(a.out)
    rows = json.loads((out / "predictions.json").read_text())
    table = []
    for row in rows:
        log = out / f"{row['arch']}-{row['n']}.log"
        if not log.exists():
            table.append({**{k: row[k] for k in ("arch", "n", "values")}, "logged": None, "note": "not run"})
            continue
        r = parse_start(log.read_text(errors="replace").splitlines())
        item: dict[str, Any] = {k: row[k] for k in ("arch", "n", "values")}
        item.update({"logged": r.kv_tokens, "logged_terms": r.__dict__})
        for key in ("predicted", "calibrated"):
            pred = row.get(key)
            if pred and r.kv_tokens:
                item[key] = pred["kv_tokens"]
                item[f"{key}_error_pct"] = round(100 * (pred["kv_tokens"] - r.kv_tokens) / r.kv_tokens, 3)
                item[f"{key}_weight_gib"] = round(pred["weight_bytes"] / (1 << 30), 3)
        table.append(item)
        print(f"{row['arch']:18s} {row['n']} logged {r.kv_tokens}  predicted {item.get('predicted')} "
              f"({item.get('predicted_error_pct')} %)  calibrated {item.get('calibrated')} "
              f"({item.get('calibrated_error_pct')} %)  weights logged {r.weights_gib} GiB, predicted "
              f"{item.get('predicted_weight_gib')}", flush=True)
    (out / "summary.json").write_text(json.dumps(table, indent=1, default=str))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="/tmp/capacity-models", help="where the model folders are written")
    p.add_argument("--only", nargs="*", default=[], metavar="ARCH",
                   help=f"these architectures, in this order (of {', '.join(arch for arch, _ in STARTS)})")
    p.add_argument("--budget-s", type=int, default=780,
                   help="an architecture whose two starts would end past this many seconds from the start is skipped")
    p.add_argument("--pair-s", type=int, default=150, help="what two starts of an architecture are expected to take")
    p.add_argument("--start-timeout-s", type=int, default=300, help="the longest one start may take")


def run(a: argparse.Namespace) -> int:
    """The driver script, in a process of its own, with this interpreter for its Python steps."""
    env = {**os.environ, "OUT": str(a.out), "MODELS": str(a.models), "BUDGET_S": str(a.budget_s),
           "PAIR_S": str(a.pair_s), "START_TIMEOUT_S": str(a.start_timeout_s), "ONLY": " ".join(a.only),
           "PY": sys.executable}
    return subprocess.run(["bash", str(DRIVER)], cwd=REPO, env=env, check=False).returncode


def helper() -> None:
    """The driver's steps: list, prepare, held-out, summary."""
    p = argparse.ArgumentParser(prog="python -m bench.scenarios.capacity_archs")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list").set_defaults(fn=cmd_list)
    for name, fn in (("prepare", cmd_prepare), ("held-out", cmd_held_out), ("summary", cmd_summary)):
        s = sub.add_parser(name)
        s.add_argument("--out", required=True)
        s.add_argument("--models", default="/tmp/capacity-models")
        s.add_argument("--arch", default="")
        s.add_argument("--assume-total-gib", type=float, default=0.0, help="without a GPU (a dry run): its total")
        s.set_defaults(fn=fn)
    a = p.parse_args()
    a.fn(a)


if __name__ == "__main__":
    helper()
