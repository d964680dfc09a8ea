"""Capacity model: from a model's config.json, a settings revision and the device's memory, predict what vLLM
will do with memory before it is started.

vLLM's KV-cache budget on a GPU is ``utilization × total − weights − peak activation − non-torch memory`` (the
profiler's peak activation includes CUDA-graph memory when vLLM estimates it into the budget). Each term is
logged at every start; ``engine/calibration.py`` reads them back, and a prediction for the same model on the
same host uses the measured terms instead of the estimates below, so the second prediction beats the first.
On the CPU build the KV cache is sized explicitly (``cpu_kv_cache_gib``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from engine.revisions import EngineSettings
from engine.schemas import ModelCard

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}
DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 4096}
BLOCK_SIZE = {"cuda": 16, "cpu": 128}


@dataclass(frozen=True)
class ModelShape:
    path: str
    architectures: tuple[str, ...]
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype: str
    max_position_embeddings: int
    sliding_window: int | None
    mla_kv_dim: int | None  # kv_lora_rank + qk_rope_head_dim for multi-head latent attention (DeepSeek)
    tie_word_embeddings: bool
    experts: int
    expert_intermediate: int
    checkpoint_bytes: int | None  # size of the safetensors files, when the weights are local

    def parameters(self) -> int:
        """Parameter count from the shape (used when no checkpoint is local, e.g. load_format=dummy)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        if self.experts > 1:
            mlp = self.experts * 3 * self.hidden * self.expert_intermediate + self.hidden * self.experts
        else:
            mlp = 3 * self.hidden * self.intermediate
        per_layer = q + kv + o + mlp + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tie_word_embeddings else 2)
        return self.layers * per_layer + embed + self.hidden


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    inner = cfg.get("text_config") or cfg.get("llm_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


@lru_cache(maxsize=64)
def _load_shape(path: str, _mtime: float) -> ModelShape:
    folder = Path(path)
    cfg = _text_config(json.loads((folder / "config.json").read_text()))
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_lora = cfg.get("kv_lora_rank")
    files = list(folder.glob("*.safetensors"))
    return ModelShape(
        path=path,
        architectures=tuple(cfg.get("architectures") or ()),
        layers=int(cfg["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        hidden=hidden,
        intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
        vocab=int(cfg.get("vocab_size") or 32000),
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
        max_position_embeddings=_max_positions(cfg),
        sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") else None,
        mla_kv_dim=int(kv_lora) + int(cfg.get("qk_rope_head_dim") or 0) if kv_lora else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        experts=int(cfg.get("num_local_experts") or cfg.get("n_routed_experts") or cfg.get("num_experts") or 1),
        expert_intermediate=int(cfg.get("moe_intermediate_size") or cfg.get("intermediate_size") or 0),
        checkpoint_bytes=sum(f.stat().st_size for f in files) if files else None,
    )


def _max_positions(cfg: dict[str, Any]) -> int:
    """The longest context vLLM derives from the config: the smallest position limit, times a RoPE scaling
    factor for the scaling kinds that extend it."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    limits = [int(cfg[k]) for k in keys if isinstance(cfg.get(k), int)]
    base = min(limits) if limits else 2048
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("factor"):
        kind = scaling.get("rope_type") or scaling.get("type")
        if kind in ("linear", "dynamic", "yarn"):
            base = int(base * float(scaling["factor"]))
    return base


def load_shape(model_dir: Path) -> ModelShape:
    cfg = model_dir / "config.json"
    return _load_shape(str(model_dir.resolve()), cfg.stat().st_mtime)


@dataclass(frozen=True)
class Device:
    """The memory vLLM sizes itself against: one GPU (vLLM's view of its total) or the host (CPU build)."""

    kind: str  # "cuda" | "cpu"
    total_bytes: int
    free_bytes: int
    count: int = 1
    name: str = ""
    indices: tuple[int, ...] = ()  # which GPUs (a tensor-parallel group) the figures are of


@dataclass(frozen=True)
class Calibration:
    """What recent successful starts on this host measured (bytes), for one model, TP size and dtype.

    Weights, non-torch memory and vLLM's view of the device total are stable and taken from the newest start.
    Peak activation varies from start to start (0.45 to 1.10 GiB for identical settings were seen on an H200), so
    it is kept as the median ratio of measured to estimated activation over recent starts, and applied to the
    estimate for the new settings."""

    weights: int
    non_torch: int
    device_total: int | None
    activation_factor: float
    tensor_parallel_size: int
    dtype: str
    starts: int = 1


@dataclass
class Prediction:
    device: str
    weight_bytes: int
    kv_bytes_per_token: int
    budget_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    kv_bytes: int
    kv_tokens: int  # as vLLM logs "KV cache size: N tokens" (all blocks)
    usable_tokens: int  # one block is vLLM's null block: the longest single request that fits
    max_model_len: int
    tokens_per_request: int
    max_concurrency: float
    fits_one_request: bool
    calibrated: bool
    block_size: int
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kv_gib"] = round(self.kv_bytes / GIB, 3)
        out["weight_gib"] = round(self.weight_bytes / GIB, 3)
        return out


def dtype_bytes(setting: str, shape: ModelShape) -> int:
    """Bytes per weight for ``dtype``; auto takes the model's own (float32 checkpoints run in 16 bits)."""
    if setting != "auto":
        return DTYPE_BYTES[setting]
    return min(2, DTYPE_BYTES.get(shape.dtype, 2))


def kv_bytes_per_token(shape: ModelShape, settings: EngineSettings) -> int:
    """2 × layers × KV heads per rank × head_dim × bytes (MLA: layers × latent dim × bytes, not split by TP)."""
    kv_dtype = dtype_bytes(settings.dtype, shape) if settings.kv_cache_dtype == "auto" else DTYPE_BYTES[
        settings.kv_cache_dtype]
    layers = math.ceil(shape.layers / max(1, settings.pipeline_parallel_size))  # a stage's share of the layers
    if shape.mla_kv_dim:
        return layers * shape.mla_kv_dim * kv_dtype
    heads_per_rank = max(1, math.ceil(shape.kv_heads / settings.tensor_parallel_size))
    return 2 * layers * heads_per_rank * shape.head_dim * kv_dtype


def weight_bytes(shape: ModelShape, settings: EngineSettings) -> int:
    """Weights per rank: the checkpoint's size when local and in the served dtype, else parameters × bytes."""
    per_weight = dtype_bytes(settings.dtype, shape)
    if shape.checkpoint_bytes and settings.load_format != "dummy":
        stored = DTYPE_BYTES.get(shape.dtype, 2)
        total = shape.checkpoint_bytes * per_weight // stored
    else:
        total = shape.parameters() * per_weight
    return total // (settings.tensor_parallel_size * max(1, settings.pipeline_parallel_size))


def batched_tokens(settings: EngineSettings, shape: ModelShape, kind: str) -> int:
    """max_num_batched_tokens as vLLM will choose it when the revision leaves it empty (chunked prefill)."""
    if settings.max_num_batched_tokens:
        return settings.max_num_batched_tokens
    max_len = settings.max_model_len or shape.max_position_embeddings
    return min(DEFAULT_BATCHED_TOKENS[kind], max_len * settings.max_num_seqs)


def estimate_activation(shape: ModelShape, settings: EngineSettings, tokens: int) -> int:
    """Peak activation of vLLM's profiling run, a forward pass over ``tokens`` (max_num_batched_tokens): the
    MLP's gate/up intermediate and the hidden states of every token.

    Fitted to vLLM 0.26 on an H200 (Llama-3-8B shape): eager is 1.22 x tokens x (2 x intermediate + 4 x hidden) x
    dtype bytes + 40 MiB (0.88 GiB at 8,192 tokens, 1.72 GiB at 16,384); torch.compile's is a quarter larger at
    8,192 tokens and above (1.10 GiB) and shrinks little below it (1.04 GiB at 4,096). Calibration corrects the
    fit for other models and GPUs."""
    width = 2 * (shape.expert_intermediate if shape.experts > 1 else shape.intermediate) + 4 * shape.hidden
    per_token = width * dtype_bytes(settings.dtype, shape) / settings.tensor_parallel_size

    def eager(t: int) -> float:
        return 1.22 * t * per_token + 40 * (1 << 20)

    if settings.enforce_eager:
        return int(eager(tokens))
    if tokens >= 8192:
        return int(1.25 * eager(tokens))
    return int(1.25 * eager(8192) * (0.89 + 0.11 * tokens / 8192))


def predict(shape: ModelShape, settings: EngineSettings, device: Device,
            calibration: Calibration | None = None) -> Prediction:
    per_token = kv_bytes_per_token(shape, settings)
    block = BLOCK_SIZE[device.kind]
    max_len = settings.max_model_len or shape.max_position_embeddings
    per_request = min(max_len, shape.sliding_window) if shape.sliding_window else max_len
    notes: list[str] = []
    weights = weight_bytes(shape, settings)
    batched = batched_tokens(settings, shape, device.kind)
    usable_calibration = calibration is not None and calibration.tensor_parallel_size == \
        settings.tensor_parallel_size and calibration.dtype == settings.dtype
    if device.kind == "cpu":
        budget = kv = int(settings.cpu_kv_cache_gib * GIB)
        activation = non_torch = 0
    else:
        total = device.total_bytes
        if usable_calibration:
            assert calibration is not None
            weights = calibration.weights
            non_torch = calibration.non_torch
            total = calibration.device_total or total
            activation = int(estimate_activation(shape, settings, batched) * calibration.activation_factor)
            notes.append(f"calibrated from {calibration.starts} start(s) on this host")
        else:
            activation = estimate_activation(shape, settings, batched)
            non_torch = int(0.25 * GIB) + (int(0.3 * GIB) if settings.tensor_parallel_size > 1 else 0)
            notes.append("uncalibrated: activation and non-torch memory estimated; the first start calibrates them")
        budget = int(settings.gpu_memory_utilization * total)
        kv = budget - weights - activation - non_torch
    blocks = max(0, kv) // (per_token * block)
    tokens = blocks * block
    usable = max(0, blocks - 1) * block
    return Prediction(
        device=device.kind, weight_bytes=weights, kv_bytes_per_token=per_token, budget_bytes=budget,
        activation_bytes=activation, non_torch_bytes=non_torch, kv_bytes=kv, kv_tokens=tokens,
        usable_tokens=usable, max_model_len=max_len, tokens_per_request=per_request,
        max_concurrency=round(tokens / per_request, 2) if per_request else 0.0,
        fits_one_request=usable >= per_request, calibrated=usable_calibration and device.kind != "cpu",
        block_size=block, notes=notes,
    )


def utilization_for(shape: ModelShape, settings: EngineSettings, device: Device, calibration: Calibration | None,
                    tokens_needed: int) -> float | None:
    """The smallest gpu_memory_utilization (2 decimals) whose KV cache holds ``tokens_needed`` tokens."""
    if device.kind != "cuda":
        return None
    for hundredths in range(1, 101):
        util = hundredths / 100
        pred = predict(shape, settings.model_copy(update={"gpu_memory_utilization": util}), device, calibration)
        if pred.usable_tokens >= tokens_needed:
            return util
    return None


def model_card(shape: ModelShape, settings: EngineSettings) -> ModelCard:
    """What a client wants to know of the served model."""
    return ModelCard(architecture=", ".join(shape.architectures) or "unknown", parameters=shape.parameters(),
                     context_length=int(settings.max_model_len or shape.max_position_embeddings),
                     model_max_length=shape.max_position_embeddings, dtype=shape.dtype,
                     kv_bytes_per_token=kv_bytes_per_token(shape, settings), layers=shape.layers)
