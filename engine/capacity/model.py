"""Capacity model: from a model's config.json, a settings revision and the device's memory, predict what vLLM
will do with memory before it is started.

vLLM's KV-cache budget on a GPU is ``utilization × total − weights − peak activation − non-torch memory`` (the
profiler's peak activation includes CUDA-graph memory when vLLM estimates it into the budget). Each term is
logged at every start; ``engine/calibration.py`` reads them back, and a prediction for the same model on the
same host uses the measured terms instead of the estimates below, so the second prediction beats the first.
On the CPU build the KV cache is sized explicitly (``cpu_kv_cache_gib``).

How the budget becomes blocks and the logged "KV cache size: N tokens" (sliding windows, hybrid groups, MLA) is
``engine/capacity/kv.py``; the model's structure and exact parameter count is ``engine/capacity/shape.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.capacity.kv import KvLayout, layout
from engine.capacity.shape import (
    DTYPE_BYTES,
    GIB,
    ModelShape,
    buffer_bytes,
    load_shape,
    parameter_breakdown,
    per_weight_bytes,
    stage_layers,
)
from engine.revisions import EngineSettings
from engine.schemas import ModelCard

DEFAULT_BATCHED_TOKENS = {"cuda": 8192, "cpu": 4096}
BLOCK_SIZE = {"cuda": 16, "cpu": 128}
# MLA's block on a GPU: vLLM 0.26 picks FLASH_ATTN_MLA on Hopper (blocks of 16); elsewhere, or with an fp8 KV
# cache (which FLASH_ATTN_MLA does not take), FlashMLA / FlashInfer-MLA with blocks of 64.
MLA_BLOCK_SIZE = {"hopper": 16, "other": 64}
HOPPER = ("H100", "H200", "H800", "H20", "GH200")
SAMPLER_BYTES_PER_LOGIT = 14  # profiling's dummy sampler: bf16 logits, then float32 logits, probabilities, noise

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_BATCHED_TOKENS",
    "DTYPE_BYTES",
    "GIB",
    "Calibration",
    "Device",
    "ModelShape",
    "Prediction",
    "batched_tokens",
    "dtype_bytes",
    "estimate_activation",
    "extra_flags",
    "kv_bytes_per_token",
    "kv_layout",
    "load_shape",
    "lora_bytes",
    "model_card",
    "model_limit",
    "predict",
    "utilization_for",
    "weight_bytes",
]


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
    usable_tokens: int  # tokens of max_model_len requests that fit beside vLLM's null block
    max_model_len: int
    tokens_per_request: int
    max_concurrency: float
    fits_one_request: bool
    calibrated: bool
    block_size: int
    notes: list[str] = field(default_factory=list)
    kv_blocks: int = 0
    request_kv_bytes: int = 0  # what vLLM's start-up check needs for one request of max_model_len tokens
    longest_request: int = 0  # the longest request that fits (at most the model's limit)
    kv_layout: str = ""  # which layers, in how many groups (engine/capacity/kv.py)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kv_gib"] = round(self.kv_bytes / GIB, 3)
        out["weight_gib"] = round(self.weight_bytes / GIB, 3)
        return out


def dtype_bytes(setting: str, shape: ModelShape) -> int:
    """Bytes per weight for ``dtype``; auto takes the model's own (float32 checkpoints run in 16 bits)."""
    return per_weight_bytes(setting, shape)


def _kv_dtype_bytes(shape: ModelShape, settings: EngineSettings) -> int:
    if settings.kv_cache_dtype == "auto":
        return dtype_bytes(settings.dtype, shape)
    return DTYPE_BYTES[settings.kv_cache_dtype]


def vllm_max_num_seqs(settings: EngineSettings) -> int:
    """What vLLM is started with: the ceiling when one is set (engine/vllm/command.py)."""
    return max(settings.max_num_seqs, settings.max_num_seqs_ceiling or 0)


def batched_tokens(settings: EngineSettings, shape: ModelShape, kind: str) -> int:
    """max_num_batched_tokens as vLLM will choose it when the revision leaves it empty (chunked prefill)."""
    if settings.max_num_batched_tokens:
        return settings.max_num_batched_tokens
    max_len = settings.max_model_len or model_limit(shape, settings)
    return min(DEFAULT_BATCHED_TOKENS[kind], max_len * vllm_max_num_seqs(settings))


def extra_flags(settings: EngineSettings) -> dict[str, str]:
    """The revision's pass-through vLLM flags (``extra_args``) as {flag: value} ("" for a switch)."""
    out: dict[str, str] = {}
    for arg in settings.extra_args or []:
        flag, _, value = str(arg).partition("=")
        out[flag] = value
    return out


def model_limit(shape: ModelShape, settings: EngineSettings) -> int:
    """The longest max_model_len vLLM accepts: the config's, or the sliding window with --disable-sliding-window
    (config/model.py _get_and_verify_max_len)."""
    window = shape.sliding_window
    if "--disable-sliding-window" in extra_flags(settings) and window and window < shape.max_position_embeddings:
        return window
    return shape.max_position_embeddings


def kv_layout(shape: ModelShape, settings: EngineSettings, device_kind: str = "cuda", device_name: str = "",
              batched: int | None = None) -> KvLayout:
    """The KV layout vLLM builds for ``settings`` on a device of ``device_kind`` (engine/capacity/kv.py), with
    the flags that change it: --block-size, --disable-sliding-window, --no-async-scheduling."""
    kv_dtype = _kv_dtype_bytes(shape, settings)
    flags = extra_flags(settings)
    hopper = any(h in device_name for h in HOPPER) or not device_name
    if device_kind == "cpu":  # vLLM 0.32's CPU platform: blocks of 128, the reference MLA kernel's of 16
        block, mla_block = BLOCK_SIZE["cpu"], 16
    else:
        block, mla_block = BLOCK_SIZE["cuda"], MLA_BLOCK_SIZE["hopper" if hopper and kv_dtype >= 2 else "other"]
    if flags.get("--block-size", "").isdigit():
        block = mla_block = int(flags["--block-size"])
    if "--disable-sliding-window" in flags:
        shape = replace(shape, layer_windows=(None,) * shape.layers)
    return layout(shape, kv_dtype_bytes=kv_dtype, tensor_parallel_size=settings.tensor_parallel_size,
                  pipeline_parallel_size=settings.pipeline_parallel_size, block_size=block, mla_block_size=mla_block,
                  hybrid_allocator=True, async_scheduling="--no-async-scheduling" not in flags,
                  batched_tokens=batched if batched is not None else batched_tokens(settings, shape, device_kind))


def kv_bytes_per_token(shape: ModelShape, settings: EngineSettings) -> int:
    """One token in every layer of a stage on one rank: 2 × layers × KV heads per rank × head_dim × bytes (MLA:
    layers × latent × bytes, not split by TP). A sliding-window layer holds only its window of a long request."""
    return kv_layout(shape, settings).per_token_bytes


def weight_bytes(shape: ModelShape, settings: EngineSettings) -> int:
    """Weights per rank: the checkpoint's size when local and in the served dtype, else the parameters vLLM
    allocates on one tensor-parallel rank of the largest pipeline stage, and its rotary caches."""
    per_weight = dtype_bytes(settings.dtype, shape)
    tp, pp = settings.tensor_parallel_size, max(1, settings.pipeline_parallel_size)
    if shape.checkpoint_bytes and settings.load_format != "dummy":
        stored = DTYPE_BYTES.get(shape.dtype, 2)
        return shape.checkpoint_bytes * per_weight // stored // (tp * pp)
    parts = parameter_breakdown(shape, tp)
    if pp > 1:  # a stage holds its layers and one vocabulary matrix (the embedding first, the head last)
        layers = parts["attention"] + parts["mlp"] + parts["norms"]
        params = layers * stage_layers(shape, pp) // shape.layers + max(parts["embedding"], parts.get("lm_head", 0))
    else:
        params = sum(parts.values())
    return params * per_weight + buffer_bytes(shape, per_weight)


def lora_bytes(shape: ModelShape, settings: EngineSettings) -> int:
    """The GPU memory vLLM's LoRA buffers take when ``enable_lora`` (0 otherwise): for each of ``max_loras`` slots,
    A (rank x in) and B (out x rank) of every linear layer it wraps — q, k, v (one slice each), o, gate and up
    (two), down — at ``max_lora_rank``, in the model's dtype, per tensor-parallel rank. vLLM allocates them with
    the model (its "Model loading took" includes them), before the KV cache is sized from what is left."""
    if not settings.enable_lora:
        return 0
    rank, hidden, inter = settings.max_lora_rank, shape.hidden, shape.intermediate
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = rank * (3 * hidden + q + 2 * kv)  # q, k, v: A and B
    per_layer += rank * (q + hidden)  # o
    per_layer += rank * (2 * hidden + 2 * inter)  # gate and up
    per_layer += rank * (inter + hidden)  # down
    elements = per_layer * shape.layers * settings.max_loras
    return elements * dtype_bytes(settings.dtype, shape) // settings.tensor_parallel_size


def activation_width(shape: ModelShape) -> int:
    """Elements per token the profiling pass holds at its peak: the widest intermediate of a layer (the dense
    MLP's gate and up, the fused-MoE kernel's workspaces for the routed experts, or the attention projections)
    plus four hidden states."""
    hidden = shape.hidden
    widths = []
    moe = shape.moe
    if moe is None or not all(moe.layers):
        widths.append(2 * shape.intermediate)
    if moe is not None and any(moe.layers):
        widths.append(moe.experts_per_token * (max(2 * moe.intermediate, hidden) + moe.intermediate)
                      + 3 * moe.shared_intermediate)
    if shape.mla:
        m = shape.mla
        widths.append(shape.heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.qk_nope_head_dim
                                     + m.v_head_dim))
    else:
        widths.append((shape.heads + 2 * shape.kv_heads) * shape.head_dim)
    return max(widths) + 4 * hidden


def estimate_activation(shape: ModelShape, settings: EngineSettings, tokens: int) -> int:
    """Peak activation of vLLM's profiling run: a forward pass over ``tokens`` (max_num_batched_tokens), then
    the sampler over max_num_seqs dummy requests; the larger of the two.

    Fitted to vLLM 0.26 on an H200 (Llama-3-8B shape, where the width is 2 × intermediate + 4 × hidden): eager
    is 1.22 x tokens x width x dtype bytes + 40 MiB (0.88 GiB at 8,192 tokens, 1.72 GiB at 16,384);
    torch.compile's is a quarter larger at 8,192 tokens and above (1.10 GiB) and shrinks little below it (1.04
    GiB at 4,096). For mixture-of-experts and MLA layers the width is the kernels' (``activation_width``), not yet
    fitted; calibration corrects the estimate for every model and GPU."""
    per_token = activation_width(shape) * dtype_bytes(settings.dtype, shape) / settings.tensor_parallel_size
    sampler = vllm_max_num_seqs(settings) * shape.vocab * SAMPLER_BYTES_PER_LOGIT / settings.tensor_parallel_size

    def eager(t: int) -> float:
        return 1.22 * t * per_token + 40 * (1 << 20)

    if settings.enforce_eager:
        forward = eager(tokens)
    elif tokens >= 8192:
        forward = 1.25 * eager(tokens)
    else:
        forward = 1.25 * eager(8192) * (0.89 + 0.11 * tokens / 8192)
    return int(max(forward, sampler))


def predict(shape: ModelShape, settings: EngineSettings, device: Device,
            calibration: Calibration | None = None) -> Prediction:
    batched = batched_tokens(settings, shape, device.kind)
    lay = kv_layout(shape, settings, device.kind, device.name, batched)
    max_len = settings.max_model_len or model_limit(shape, settings)
    notes: list[str] = []
    lora = lora_bytes(shape, settings)
    weights = weight_bytes(shape, settings) + lora
    usable_calibration = calibration is not None and calibration.tensor_parallel_size == \
        settings.tensor_parallel_size and calibration.dtype == settings.dtype
    if device.kind == "cpu":
        budget = kv = int(settings.cpu_kv_cache_gib * GIB)
        activation = non_torch = 0
    else:
        total = device.total_bytes
        if usable_calibration:
            assert calibration is not None
            weights = calibration.weights + lora  # (a calibration keeps the weights without LoRA's buffers)
            non_torch = calibration.non_torch
            total = calibration.device_total or total
            activation = int(estimate_activation(shape, settings, batched) * calibration.activation_factor)
            notes.append(f"calibrated from {calibration.starts} start(s) on this host")
        else:
            activation = estimate_activation(shape, settings, batched)
            non_torch = int(0.25 * GIB) + (int(0.3 * GIB) if settings.tensor_parallel_size > 1 else 0)
            notes.append("uncalibrated: activation and non-torch memory estimated; the first start calibrates them")
        if lora:
            notes.append(f"LoRA: {lora / GIB:.2f} GiB of buffers for {settings.max_loras} adapters of rank "
                         f"{settings.max_lora_rank}")
        budget = int(settings.gpu_memory_utilization * total)
        kv = budget - weights - activation - non_torch
    blocks = lay.blocks(kv)
    null_block = lay.group_size * lay.page_bytes
    only_full = not lay.hybrid and lay.groups[0].kind != "sliding"
    usable = max(0, blocks - 1) * lay.block_size if only_full else \
        int(max(0, blocks - 1) / lay.blocks_per_request(max_len) * max_len)
    request_bytes = lay.need_bytes(max_len)
    if lay.hybrid or not only_full:
        notes.append(f"KV cache: {lay.describe()}")
    return Prediction(
        device=device.kind, weight_bytes=weights, kv_bytes_per_token=lay.per_token_bytes, budget_bytes=budget,
        activation_bytes=activation, non_torch_bytes=non_torch, kv_bytes=kv,
        kv_tokens=lay.logged_tokens(blocks, max_len), usable_tokens=usable, max_model_len=max_len,
        tokens_per_request=max_len, max_concurrency=round(lay.concurrency(blocks, max_len), 2),
        fits_one_request=kv > 0 and request_bytes <= kv - null_block,
        calibrated=usable_calibration and device.kind != "cpu", block_size=lay.block_size, notes=notes,
        kv_blocks=blocks, request_kv_bytes=request_bytes,
        longest_request=lay.longest_request(kv, max(max_len, model_limit(shape, settings))),
        kv_layout=lay.describe(),
    )


def utilization_for(shape: ModelShape, settings: EngineSettings, device: Device, calibration: Calibration | None,
                    tokens_needed: int) -> float | None:
    """The smallest gpu_memory_utilization (2 decimals) whose KV cache holds one request of ``tokens_needed``
    tokens (beside vLLM's null block)."""
    if device.kind != "cuda":
        return None
    lay = kv_layout(shape, settings, device.kind, device.name)
    need = lay.need_bytes(tokens_needed) + lay.group_size * lay.page_bytes
    for hundredths in range(1, 101):
        util = hundredths / 100
        pred = predict(shape, settings.model_copy(update={"gpu_memory_utilization": util}), device, calibration)
        if pred.kv_bytes >= need:
            return util
    return None


def model_card(shape: ModelShape, settings: EngineSettings) -> ModelCard:
    """What a client wants to know of the served model."""
    return ModelCard(architecture=", ".join(shape.architectures) or "unknown", parameters=shape.parameters(),
                     context_length=int(settings.max_model_len or shape.max_position_embeddings),
                     model_max_length=shape.max_position_embeddings, dtype=shape.dtype,
                     kv_bytes_per_token=kv_bytes_per_token(shape, settings), layers=shape.layers)
