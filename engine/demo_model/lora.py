"""Build the demo LoRA adapter: the demo model taught, offline, to continue any text in UPPER CASE.

The adapter exists so the engine's LoRA paths (vLLM's --enable-lora, --lora-modules, runtime loading) have a real
adapter to serve on the CPU build. Its style is chosen so its effect is obvious at temperature 0: after an ordinary
prompt the base model goes on in ordinary prose, the adapter goes on in capitals.

It is written in PEFT's layout (adapter_config.json, adapter_model.safetensors with PEFT's key names) without
depending on PEFT: the LoRA is a few lines of torch (``LoraLinear``), the same arithmetic PEFT and vLLM apply,
``W x + (alpha / r) · B A x``. The base stays frozen; only A and B train, on q/k/v/o of every layer.

The training data are the base's own corpus (the stdlib's docstrings) with each paragraph cut at a random word: the
words before the cut stay as they are and are not scored, the rest is upper-cased and scored. The model thus learns
to switch to capitals after ordinary text, which is what a prompt looks like, not only to continue capitals.

Output is deterministic given the seed on one machine: fixed corpus, fixed step count, seeded torch, fixed threads.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.demo_model.train import EOS, PAD, stdlib_docstrings, warmup_cosine

log = logging.getLogger("llmops.demo_model")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's prefix for a causal LM: PeftModel.base_model (LoraModel) .model (LlamaForCausalLM) .model (LlamaModel).
PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class DemoLoraSpec:
    """Shape and training recipe of the demo adapter; recorded in its training.json."""

    seed: int = 4321
    rank: int = 8
    alpha: int = 16
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    seq_len: int = 64
    batch_size: int = 16
    steps: int = 200
    learning_rate: float = 1e-2
    warmup_steps: int = 10
    corpus_chars: int = 400_000
    max_prefix_words: int = 16
    # Fixed, not the machine's core count: the sums' order (and so the adapter's bytes) depends on the thread count.
    threads: int = 2


class LoraLinear(nn.Module):
    """A frozen ``nn.Linear`` plus PEFT's LoRA: ``base(x) + (x Aᵀ) Bᵀ · alpha / r``, no dropout.

    A starts as PEFT starts it (kaiming-uniform, like a Linear's weight) and B at zero, so before training the
    wrapped layer computes exactly what the base layer does.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.scaling = alpha / rank
        a = torch.empty(rank, base.in_features, dtype=base.weight.dtype)
        # nn.init.kaiming_uniform_(a, a=math.sqrt(5)), drawn from our generator: bound = 1 / sqrt(fan_in)
        bound = 1.0 / math.sqrt(base.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=base.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        return out + nn.functional.linear(nn.functional.linear(x, self.lora_A), self.lora_B) * self.scaling


def attach_lora(model: nn.Module, spec: DemoLoraSpec) -> dict[str, LoraLinear]:
    """Freeze ``model`` and wrap its target projections in every layer; returns them by PEFT's module name.

    The names are those PEFT gives (``base_model.model.model.layers.0.self_attn.q_proj``), so the weights file is
    the state of these modules under those names.
    """
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(spec.seed)
    wrapped: dict[str, LoraLinear] = {}
    for name, module in list(model.named_modules()):
        for target in spec.target_modules:
            child = getattr(module, target, None)
            if isinstance(child, nn.Linear):
                lora = LoraLinear(child, spec.rank, spec.alpha, gen)
                setattr(module, target, lora)
                wrapped[f"{PEFT_PREFIX}{name}.{target}"] = lora
    if not wrapped:
        raise ValueError(f"no module named {', '.join(spec.target_modules)} in the model")
    return wrapped


def adapter_tensors(wrapped: dict[str, LoraLinear], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter's weights under PEFT's keys: ``<module>.lora_A.weight`` [r, in], ``<module>.lora_B.weight``
    [out, r]."""
    tensors: dict[str, torch.Tensor] = {}
    for name, lora in wrapped.items():
        tensors[f"{name}.lora_A.weight"] = lora.lora_A.detach().to(dtype).contiguous()
        tensors[f"{name}.lora_B.weight"] = lora.lora_B.detach().to(dtype).contiguous()
    return tensors


def adapter_config(spec: DemoLoraSpec, base_name: str) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for a plain LoRA; vLLM reads r, lora_alpha, target_modules and rejects
    what it does not implement (DoRA, bias, modules_to_save, unusual inits), so those say so explicitly."""
    return {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_name,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": spec.alpha,
        "lora_bias": False,
        "lora_dropout": 0.0,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": spec.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": list(spec.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }


def build_demo_lora(base: Path, out: Path, log_path: Path | None = None, spec: DemoLoraSpec | None = None) -> None:
    """Train the upper-case adapter on the demo model at ``base`` and write it to ``out`` in PEFT's layout.

    Writes adapter_config.json, adapter_model.safetensors (in the base's dtype) and training.json (the spec, the
    time and the loss curve) into a temporary sibling folder, then renames it to ``out``: a build that fails or is
    killed leaves the previous adapter, or none, never half of one. The loss curve also goes to ``log_path``.
    """
    from transformers import LlamaForCausalLM

    spec = spec or DemoLoraSpec()
    handler: logging.Handler | None = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    threads = torch.get_num_threads()
    try:
        t0 = time.monotonic()
        torch.set_num_threads(spec.threads)
        torch.manual_seed(spec.seed)
        inputs, labels = _examples(base, spec)
        log.info("adapter corpus: %d upper-case examples of %d tokens", len(inputs), spec.seq_len)

        model = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        base_dtype = _saved_dtype(base)
        model.eval()  # no dropout anywhere; only the LoRA weights train
        wrapped = attach_lora(model, spec)
        trainable = sum(p.numel() for lora in wrapped.values() for p in (lora.lora_A, lora.lora_B))
        log.info("adapter: rank %d, alpha %d on %d modules, %d trainable parameters", spec.rank, spec.alpha,
                 len(wrapped), trainable)

        curve = _train(model, wrapped, inputs, labels, spec)
        elapsed = time.monotonic() - t0
        training = {"spec": asdict(spec), "examples": len(inputs), "trainable_parameters": trainable,
                    "seconds": round(elapsed, 1), "loss_curve": curve}
        _write(out, adapter_config(spec, Path(os.path.abspath(base)).name),
               adapter_tensors(wrapped, base_dtype), training)
        log.info("demo adapter written to %s in %.1f s", out, elapsed)
    finally:
        torch.set_num_threads(threads)
        if handler is not None:
            log.removeHandler(handler)
            handler.close()


def _saved_dtype(base: Path) -> torch.dtype:
    """The dtype the base's weights are stored in (its config's ``dtype``, ``torch_dtype`` before transformers 5):
    vLLM serves the adapter in the model's dtype, so it is written in it."""
    config = json.loads((base / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _examples(base: Path, spec: DemoLoraSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``seq_len`` tokens: a paragraph's first words as they are (labels -100: not scored), then the rest
    of it upper-cased and an end-of-text (scored), right-padded (not scored). Tokenized with the base's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    if eos is None or pad is None:
        raise ValueError(f"{base / 'tokenizer.json'} has no {EOS} or {PAD}: not the demo model's tokenizer")
    rng = random.Random(spec.seed)
    rows: list[list[int]] = []
    targets: list[list[int]] = []
    for paragraph in stdlib_docstrings(spec.corpus_chars).split("\n\n"):
        words = paragraph.split()
        if len(words) < 4:
            continue
        cut = rng.randint(1, min(spec.max_prefix_words, len(words) - 1))
        head = tok.encode(" ".join(words[:cut])).ids
        tail = [*tok.encode(" " + " ".join(words[cut:]).upper()).ids, eos]
        ids = (head + tail)[: spec.seq_len]
        scored = ([-100] * len(head) + tail)[: spec.seq_len]
        if len(head) >= spec.seq_len - 4:
            continue  # too little of the upper-cased part would fit
        fill = spec.seq_len - len(ids)
        rows.append(ids + [pad] * fill)
        targets.append(scored + [-100] * fill)
    if not rows:
        raise ValueError("no training examples: the corpus is empty")
    return torch.tensor(rows, dtype=torch.long), torch.tensor(targets, dtype=torch.long)


def _train(model: nn.Module, wrapped: dict[str, LoraLinear], inputs: torch.Tensor, labels: torch.Tensor,
           spec: DemoLoraSpec) -> list[dict[str, float]]:
    params = [p for lora in wrapped.values() for p in (lora.lora_A, lora.lora_B)]
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0, betas=(0.9, 0.99))
    curve: list[dict[str, float]] = []
    start = time.monotonic()
    for step in range(1, spec.steps + 1):
        lr = _lr(step, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, len(inputs), (spec.batch_size,), generator=gen)
        out = model(input_ids=inputs[rows], labels=labels[rows])  # the model shifts labels itself
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step == 1 or step % 10 == 0 or step == spec.steps:
            loss = float(out.loss.item())
            curve.append({"step": step, "loss": round(loss, 4), "lr": round(lr, 6)})
            log.info("adapter step %4d/%d  loss %.3f  lr %.2e  %.1f s", step, spec.steps, loss, lr,
                     time.monotonic() - start)
    return curve


def _lr(step: int, spec: DemoLoraSpec) -> float:
    return warmup_cosine(step, spec.learning_rate, spec.warmup_steps, spec.steps)


def _write(out: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], training: dict[str, Any]) -> None:
    """Write the adapter beside ``out`` and rename it into place; the previous one, if any, goes only then."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / "training.json").write_text(json.dumps(training, indent=1))
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not out.exists():
            old.rename(out)  # put the previous adapter back
        raise
    shutil.rmtree(old, ignore_errors=True)
