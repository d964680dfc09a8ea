"""Build the embedded demo model: a tiny Llama trained briefly, offline, on the docstrings of Python's stdlib.

The model is real enough for the real vLLM to serve it (safetensors weights, a byte-level BPE tokenizer with a
chat template) and small enough to train in about a minute on two cores. Its shape respects the CPU attention
kernels of vLLM, which need head_dim 64: hidden 256, 4 heads, 2 KV heads, 2 layers.

Output is deterministic given the seed on one machine (fixed corpus order, fixed step count, seeded torch).
"""

from __future__ import annotations

import ast
import json
import logging
import math
import os
import random
import re
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("llmops.demo_model")

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"

# A ChatML-style template: what vLLM's /v1/chat/completions renders before generating.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Stdlib folders whose docstrings are not prose (tests, generated tables) or that drag in odd text.
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "encodings", "pydoc_data"}


@dataclass(frozen=True)
class DemoModelSpec:
    """Shape and training recipe of the demo model; recorded in the model folder."""

    seed: int = 1234
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 128
    batch_size: int = 24
    steps: int = 260
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    corpus_chars: int = 3_000_000


def stdlib_docstrings(limit_chars: int) -> str:
    """English prose from the docstrings of Python's standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    parts: list[str] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS.intersection(path.relative_to(root).parts):
            continue
        for doc in _docstrings(path):
            text = _clean(doc)
            if len(text) < 80 or text in seen:
                continue
            seen.add(text)
            parts.append(text)
            total += len(text) + 2
            if total >= limit_chars:
                return "\n\n".join(parts)
    return "\n\n".join(parts)


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc


def _clean(doc: str) -> str:
    # Keep prose paragraphs; drop doctest lines and code-ish lines.
    lines = [ln for ln in doc.splitlines() if not ln.lstrip().startswith((">>>", "...", "$ "))]
    text = " ".join(ln.strip() for ln in lines if ln.strip())
    return re.sub(r"\s+", " ", text).strip()


def _train_tokenizer(corpus: str, vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, IM_START, IM_END, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = corpus.split("\n\n")
    tok.train_from_iterator(paragraphs, trainer=trainer, length=len(paragraphs))
    return tok


def build_demo_model(out_dir: Path, spec: DemoModelSpec | None = None, log_path: Path | None = None) -> Path:
    """Train the demo model and write it to ``out_dir``; returns ``out_dir``.

    Writes config.json, model.safetensors, tokenizer files with the chat template, generation_config.json and
    training.json (the spec, the corpus size and the loss curve). The loss curve also goes to ``log_path``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    spec = spec or DemoModelSpec()
    out_dir.mkdir(parents=True, exist_ok=True)
    handler: logging.Handler | None = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log_path, mode="w", encoding="utf-8")
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        t0 = time.monotonic()
        random.seed(spec.seed)
        torch.manual_seed(spec.seed)
        torch.set_num_threads(max(1, os.cpu_count() or 1))

        corpus = stdlib_docstrings(spec.corpus_chars)
        log.info("corpus: %d characters of stdlib docstrings", len(corpus))
        raw_tok = _train_tokenizer(corpus, spec.vocab_size)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=raw_tok,
            bos_token=BOS,
            eos_token=EOS,
            pad_token=PAD,
            chat_template=CHAT_TEMPLATE,
            model_max_length=spec.max_position_embeddings,
        )
        eos_id = raw_tok.token_to_id(EOS)
        ids = raw_tok.encode_batch(corpus.split("\n\n"))
        stream: list[int] = []
        for enc in ids:
            stream.extend(enc.ids)
            stream.append(eos_id)
        data = torch.tensor(stream, dtype=torch.long)
        log.info("tokens: %d (vocab %d), tokenizer built in %.1f s", len(data), raw_tok.get_vocab_size(),
                 time.monotonic() - t0)

        config = LlamaConfig(
            vocab_size=raw_tok.get_vocab_size(),
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_hidden_layers,
            num_attention_heads=spec.num_attention_heads,
            num_key_value_heads=spec.num_key_value_heads,
            head_dim=spec.hidden_size // spec.num_attention_heads,
            max_position_embeddings=spec.max_position_embeddings,
            tie_word_embeddings=True,
            bos_token_id=raw_tok.token_to_id(BOS),
            eos_token_id=[eos_id, raw_tok.token_to_id(IM_END)],
            pad_token_id=raw_tok.token_to_id(PAD),
        )
        model = LlamaForCausalLM(config)
        model.train()
        params = sum(p.numel() for p in model.parameters())
        log.info("model: %d parameters, %d layers, hidden %d, head_dim %d", params, config.num_hidden_layers,
                 config.hidden_size, config.head_dim)

        curve = _train(model, data, spec)
        model.eval()
        model = model.to(torch.bfloat16)  # type: ignore[arg-type]
        model.save_pretrained(out_dir, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
        elapsed = time.monotonic() - t0
        (out_dir / "training.json").write_text(
            json.dumps(
                {"spec": asdict(spec), "corpus_chars": len(corpus), "tokens": len(data), "parameters": params,
                 "seconds": round(elapsed, 1), "loss_curve": curve},
                indent=1,
            )
        )
        log.info("demo model written to %s in %.1f s", out_dir, elapsed)
        return out_dir
    finally:
        if handler is not None:
            log.removeHandler(handler)
            handler.close()


def _train(model, data, spec: DemoModelSpec) -> list[dict[str, float]]:  # type: ignore[no-untyped-def]
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01, betas=(0.9, 0.95))
    curve: list[dict[str, float]] = []
    start = time.monotonic()
    n = len(data) - spec.seq_len - 1
    for step in range(1, spec.steps + 1):
        lr = _lr(step, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, n, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[o : o + spec.seq_len + 1] for o in offsets.tolist()])
        out = model(input_ids=batch, labels=batch)  # the model shifts labels itself
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 1 or step % 20 == 0 or step == spec.steps:
            loss = float(out.loss.item())
            curve.append({"step": step, "loss": round(loss, 4), "lr": round(lr, 6)})
            log.info("step %4d/%d  loss %.3f  lr %.2e  %.1f s", step, spec.steps, loss, lr,
                     time.monotonic() - start)
    return curve


def _lr(step: int, spec: DemoModelSpec) -> float:
    return warmup_cosine(step, spec.learning_rate, spec.warmup_steps, spec.steps)


def warmup_cosine(step: int, peak: float, warmup: int, steps: int) -> float:
    """A linear warm-up to ``peak``, then a cosine down to a tenth of it (the model's and its adapter's schedule)."""
    if step <= warmup:
        return peak * step / max(1, warmup)
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
