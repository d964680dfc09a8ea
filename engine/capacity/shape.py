"""A model's shape as vLLM builds it, read from its config.json: the attention kind of every layer, the experts
and latent attention where there are any, and the parameters vLLM allocates (exactly, for the architectures in
``MODELLED``: what ``--load-format dummy`` puts on the GPU).

What a config asks for that this module does not model is listed in ``ModelShape.unmodelled``, each with what it
does to the prediction; pre-flight shows each as a ``capacity_approximate`` warning, so a guess is never silent.

Read against vLLM 0.26.0's model files (llama.py, mistral.py, qwen2.py, qwen3.py, qwen3_moe.py, qwen2_moe.py,
mixtral.py, gemma3.py, deepseek_v2.py) and layers (VocabParallelEmbedding pads the vocabulary to 64 rows;
QKVParallelLinear keeps one KV head per rank when there are fewer than ranks; FusedMoE holds w13 [E, 2I, H] and
w2 [E, H, I]; the MoE router and MLA's kv_a projection are replicated; rotary caches are buffers of
positions x rotary dim in the model's dtype, one per distinct rope).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "fp8_e4m3": 1,
               "fp8_e5m2": 1}

# Architectures whose parameters, layer kinds and KV cache are modelled from vLLM 0.26's own code.
MODELLED = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM",
    "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
})
# Multimodal wrappers whose language model is one of those (their encoders are named as not modelled).
MODELLED_LANGUAGE = frozenset({"Gemma3ForConditionalGeneration"})
# The MoE architectures vLLM 0.26 runs on its V2 model runner (config/vllm.py DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES);
# every other MoE runs on the V1 runner, every dense model on V2.
V2_RUNNER_MOE = frozenset({"DeepseekV2ForCausalLM", "GraniteMoeForCausalLM", "Qwen2MoeForCausalLM"})

_QWEN_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Unmodelled:
    """A feature of the config that the capacity model does not model, and what it does to the prediction."""

    feature: str
    effect: str
    bytes: int | None = None  # how far the KV cache may be off because of it, where that can be estimated
    plural: bool = False  # "layer types ... are not modelled"


@dataclass(frozen=True)
class MlaDims:
    """Multi-head latent attention (DeepSeek): the KV cache holds one latent of kv_lora_rank + qk_rope_head_dim
    per token and layer, shared by all heads (not split by tensor parallel)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def latent(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoeDims:
    experts: int
    experts_per_token: int
    intermediate: int  # of one routed expert
    shared_intermediate: int  # of the shared expert(s) together; 0 when none
    shared_expert_gate: bool  # Qwen-MoE's gate on the shared expert (hidden x 1)
    router_bias: bool  # DeepSeek-V3's e_score_correction_bias (noaux_tc), float32
    layers: tuple[bool, ...]  # which decoder layers are MoE (the others have a dense MLP)


@dataclass(frozen=True)
class ModelShape:
    path: str
    architectures: tuple[str, ...]
    model_type: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    dtype: str
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    mla: MlaDims | None
    moe: MoeDims | None
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool  # RMSNorm of head_dim on q and k (Qwen3, Gemma 3)
    norms_per_layer: int
    rope_caches: tuple[tuple[int, int], ...]  # (positions, rotary dim) of each rotary cache vLLM builds
    quantization: str | None
    unmodelled: tuple[Unmodelled, ...]
    checkpoint_bytes: int | None  # size of the safetensors files, when the weights are local

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding-window layers (None when every layer attends to the whole context)."""
        return next((w for w in self.layer_windows if w), None)

    @property
    def mla_kv_dim(self) -> int | None:
        return self.mla.latent if self.mla else None

    @property
    def experts(self) -> int:
        return self.moe.experts if self.moe else 1

    @property
    def expert_intermediate(self) -> int:
        return self.moe.intermediate if self.moe else 0

    @property
    def modelled(self) -> bool:
        return any(a in MODELLED for a in self.architectures)

    def parameters(self) -> int:
        """Parameters vLLM allocates (embedding padded to 64 rows), e.g. with load_format=dummy."""
        return sum(parameter_breakdown(self).values())


def _pad(n: int, to: int) -> int:
    return -(-n // to) * to


def _kv_heads_per_rank(shape: ModelShape, tp: int) -> int:
    return max(1, shape.kv_heads // tp) if tp <= shape.kv_heads else 1


def _attention_parameters(shape: ModelShape, tp: int) -> int:
    hidden = shape.hidden
    if shape.mla:
        m = shape.mla
        heads = shape.heads // tp
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:  # fused_qkv_a_proj and q_a_layernorm are replicated; q_b_proj is split
            q = hidden * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * heads * qk_head
            kv_a = hidden * m.latent  # inside fused_qkv_a_proj
        else:
            q = hidden * heads * qk_head
            kv_a = hidden * m.latent  # kv_a_proj_with_mqa (replicated)
        kv_b = m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv_a + m.kv_lora_rank + kv_b + heads * m.v_head_dim * hidden
    q_width = shape.heads // tp * shape.head_dim
    kv_width = _kv_heads_per_rank(shape, tp) * shape.head_dim
    qkv = hidden * (q_width + 2 * kv_width) + ((q_width + 2 * kv_width) if shape.attention_bias else 0)
    return qkv + q_width * hidden + (2 * shape.head_dim if shape.qk_norm else 0)


def _mlp_parameters(shape: ModelShape, layer: int, tp: int) -> int:
    hidden = shape.hidden
    moe = shape.moe
    if moe is None or not moe.layers[layer]:
        return 3 * hidden * shape.intermediate // tp
    routed = moe.experts * 3 * hidden * moe.intermediate // tp + moe.experts * hidden  # experts split, router not
    shared = 3 * hidden * moe.shared_intermediate // tp + (hidden if moe.shared_expert_gate else 0)
    return routed + shared + (2 * moe.experts if moe.router_bias else 0)  # fp32 bias: two 16-bit weights' bytes


def parameter_breakdown(shape: ModelShape, tensor_parallel_size: int = 1) -> dict[str, int]:
    """Parameters one tensor-parallel rank holds, by part (tensor_parallel_size 1: the whole model)."""
    tp = max(1, tensor_parallel_size)
    rows = -(-_pad(shape.vocab, VOCAB_PADDING) // tp)
    out = {"embedding": rows * shape.hidden}
    if not shape.tie_word_embeddings:
        out["lm_head"] = rows * shape.hidden
    out["attention"] = shape.layers * _attention_parameters(shape, tp)
    out["mlp"] = sum(_mlp_parameters(shape, i, tp) for i in range(shape.layers))
    out["norms"] = shape.layers * shape.norms_per_layer * shape.hidden + shape.hidden
    return out


def buffer_bytes(shape: ModelShape, per_weight: int) -> int:
    """The rotary caches vLLM allocates beside the weights (positions x rotary dim, in the model's dtype)."""
    return sum(positions * dim * per_weight for positions, dim in shape.rope_caches)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    inner = cfg.get("text_config") or cfg.get("llm_config")
    return {**cfg, **inner} if isinstance(inner, dict) else cfg


def _int(cfg: dict[str, Any], key: str, default: int) -> int:
    value = cfg.get(key)
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def _rope_parameters(cfg: dict[str, Any]) -> dict[str, Any] | None:
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    return rope if isinstance(rope, dict) else None


def max_positions(cfg: dict[str, Any]) -> int:
    """The longest context vLLM derives from the config (config/model.py _get_and_verify_max_len): the smallest
    position limit; times the RoPE factor for scaling kinds that extend it (from original_max_position_embeddings
    for yarn); Gemma 3's limit is already scaled."""
    keys = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
    limits = [int(cfg[k]) for k in keys if isinstance(cfg.get(k), int)]
    base = min(limits) if limits else 2048
    rope = _rope_parameters(cfg)
    if rope and rope.get("factor") and "gemma3" not in str(cfg.get("model_type", "")):
        kind = rope.get("rope_type") or rope.get("type")
        if kind not in ("su", "longrope", "llama3", "default", None):
            if kind == "yarn" and isinstance(rope.get("original_max_position_embeddings"), int):
                base = int(rope["original_max_position_embeddings"])
            base = int(base * float(rope["factor"]))
    return base


def _layer_windows(cfg: dict[str, Any], model_type: str, layers: int,
                   notes: list[Unmodelled]) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers builds the config's layer_types and vLLM reads them: a model
    with one kind of layer takes the config's window everywhere (vLLM's cache_config.sliding_window)."""
    window = cfg.get("sliding_window") or None
    if model_type in _QWEN_TYPES and not cfg.get("use_sliding_window", False):
        window = None  # transformers drops the window unless use_sliding_window
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        other = sorted({str(t) for t in types if t not in _ATTENTION_LAYER_TYPES})
        if other:
            notes.append(Unmodelled(f"layer type{'s' if len(other) > 1 else ''} {', '.join(other)}", "those "
                                    "layers are counted as full attention and their own state memory (recurrent or "
                                    "linear-attention state) is not: the KV tokens may be off by a large factor",
                                    plural=len(other) > 1))
        return tuple(window if t == "sliding_attention" else None for t in types)
    if window is None:
        return (None,) * layers
    if model_type in ("gemma3", "gemma3_text"):
        pattern = _int(cfg, "sliding_window_pattern", 6)
        return tuple(window if (i + 1) % pattern else None for i in range(layers))
    if model_type == "gemma2":
        return tuple(window if (i + 1) % 2 else None for i in range(layers))
    if model_type in _QWEN_TYPES:
        first = _int(cfg, "max_window_layers", layers)
        return tuple(window if i >= first else None for i in range(layers))
    return (window,) * layers


def _moe(cfg: dict[str, Any], model_type: str, layers: int) -> MoeDims | None:
    experts = _int(cfg, "num_local_experts", 0) or _int(cfg, "n_routed_experts", 0) or _int(cfg, "num_experts", 0)
    if experts <= 1:
        return None
    if model_type.startswith("deepseek") or "n_routed_experts" in cfg:
        first, freq = _int(cfg, "first_k_dense_replace", 0), max(1, _int(cfg, "moe_layer_freq", 1))
        which = tuple(i >= first and i % freq == 0 for i in range(layers))
        shared = _int(cfg, "n_shared_experts", 0) * _int(cfg, "moe_intermediate_size", 0)
        gate, bias = False, cfg.get("topk_method") == "noaux_tc"
    elif model_type in _QWEN_TYPES:
        dense = {int(i) for i in cfg.get("mlp_only_layers") or []}
        step = max(1, _int(cfg, "decoder_sparse_step", 1))
        which = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
        shared = _int(cfg, "shared_expert_intermediate_size", 0)
        gate, bias = shared > 0, False
    else:
        which, shared, gate, bias = (True,) * layers, 0, False, False
    per_expert = _int(cfg, "moe_intermediate_size", 0) or _int(cfg, "intermediate_size", 0)
    return MoeDims(experts=experts, experts_per_token=_int(cfg, "num_experts_per_tok", 2), intermediate=per_expert,
                   shared_intermediate=shared, shared_expert_gate=gate, router_bias=bias, layers=which)


def _rope_caches(cfg: dict[str, Any], model_type: str, head_dim: int, mla: MlaDims | None,
                 windows: tuple[int | None, ...]) -> tuple[tuple[int, int], ...]:
    positions = _int(cfg, "max_position_embeddings", 2048)
    if mla:
        rope = _rope_parameters(cfg) or {}
        if rope.get("factor") and isinstance(rope.get("original_max_position_embeddings"), int):
            positions = int(rope["original_max_position_embeddings"] * float(rope["factor"]))
        return ((positions, mla.qk_rope_head_dim),)
    dim = int(head_dim * float(cfg.get("partial_rotary_factor") or 1.0))
    if model_type in ("gemma3", "gemma3_text") and any(windows) and not all(windows):
        return ((positions, dim), (positions, dim))  # a local rope (rope_local_base_freq) and a global one
    return ((positions, dim),)


def _unmodelled(cfg: dict[str, Any], raw: dict[str, Any], architectures: tuple[str, ...],
                head_dim: int, notes: list[Unmodelled]) -> None:
    if not any(a in MODELLED or a in MODELLED_LANGUAGE for a in architectures):
        name = ", ".join(architectures) or "an architecture the config does not name"
        notes.append(Unmodelled(f"architecture {name}", "weights and KV cache are estimated as those of a "
                                "Llama-like decoder of the same dimensions: the prediction may be off by several "
                                "percent or more"))
    vision = raw.get("vision_config") or cfg.get("vision_config")
    if isinstance(vision, dict):
        width = _int(vision, "hidden_size", 0) or _int(vision, "width", 0) or _int(vision, "embed_dim", 0)
        depth = _int(vision, "num_hidden_layers", 0) or _int(vision, "depth", 0) or _int(vision, "layers", 0)
        guess = 12 * width * width * depth * 2 if width and depth else None
        notes.append(Unmodelled("the vision encoder (vision_config)", "its weights and the memory of profiling "
                                "it are not counted: the KV cache will be smaller than predicted"
                                + (f", by about {guess / GIB:.2f} GiB or more" if guess else ""), guess))
    for key in ("audio_config", "speech_config"):
        if isinstance(raw.get(key), dict):
            notes.append(Unmodelled(f"the audio encoder ({key})", "its weights and profiling memory are not "
                                    "counted: the KV cache will be smaller than predicted"))
    if cfg.get("attention_chunk_size"):
        notes.append(Unmodelled("chunked local attention (attention_chunk_size)", "vLLM turns its hybrid KV cache "
                                "manager off for it and those layers are counted as full attention, which is what "
                                "vLLM then does; the rest of the architecture is approximate"))
    if cfg.get("index_topk"):
        notes.append(Unmodelled("the sparse-attention indexer (index_topk)", "its key cache and FlashMLA-sparse "
                                "layout are not modelled: the KV tokens may be off by several percent"))
    if head_dim > 256 and not cfg.get("kv_lora_rank"):
        notes.append(Unmodelled(f"head_dim {head_dim} (above FlashAttention's 256)", "vLLM picks another attention "
                                "backend, whose block size may differ from the 16 tokens assumed"))


def _quantization(cfg: dict[str, Any]) -> str | None:
    q = cfg.get("quantization_config") or cfg.get("compression_config")
    if isinstance(q, dict):
        return str(q.get("quant_method") or q.get("format") or "quantized")
    return None


def shape_from_config(raw: dict[str, Any], path: str = "", checkpoint_bytes: int | None = None) -> ModelShape:
    cfg = text_config(raw)
    model_type = str(cfg.get("model_type") or raw.get("model_type") or "")
    architectures = tuple(str(a) for a in raw.get("architectures") or cfg.get("architectures") or ())
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    layers = int(cfg["num_hidden_layers"])
    head_dim = _int(cfg, "head_dim", 0) or hidden // heads
    notes: list[Unmodelled] = []
    windows = _layer_windows(cfg, model_type, layers, notes)
    kv_lora = cfg.get("kv_lora_rank")
    mla = MlaDims(q_lora_rank=_int(cfg, "q_lora_rank", 0) or None, kv_lora_rank=int(kv_lora),
                  qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", 0), qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", 0),
                  v_head_dim=_int(cfg, "v_head_dim", head_dim)) if kv_lora else None
    gemma = model_type in _GEMMA_TYPES
    tie = cfg.get("tie_word_embeddings")
    _unmodelled(cfg, raw, architectures, head_dim, notes)
    return ModelShape(
        path=path, architectures=architectures, model_type=model_type, layers=layers, heads=heads,
        kv_heads=_int(cfg, "num_key_value_heads", 0) or heads, head_dim=head_dim, hidden=hidden,
        intermediate=_int(cfg, "intermediate_size", 4 * hidden), vocab=_int(cfg, "vocab_size", 32000),
        dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        max_position_embeddings=max_positions(cfg), layer_windows=windows, mla=mla,
        moe=_moe(cfg, model_type, layers), tie_word_embeddings=bool(tie) if tie is not None else gemma,
        attention_bias=model_type in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
        norms_per_layer=4 if model_type in ("gemma2", "gemma3", "gemma3_text") else 2,
        rope_caches=_rope_caches(cfg, model_type, head_dim, mla, windows), quantization=_quantization(cfg),
        unmodelled=tuple(notes), checkpoint_bytes=checkpoint_bytes,
    )


@lru_cache(maxsize=64)
def _load_shape(path: str, _mtime: float) -> ModelShape:
    folder = Path(path)
    files = list(folder.glob("*.safetensors"))
    return shape_from_config(json.loads((folder / "config.json").read_text()), path,
                             sum(f.stat().st_size for f in files) if files else None)


def load_shape(model_dir: Path) -> ModelShape:
    cfg = model_dir / "config.json"
    return _load_shape(str(model_dir.resolve()), cfg.stat().st_mtime)


def per_weight_bytes(setting: str, shape: ModelShape) -> int:
    """Bytes per weight for ``dtype``; auto takes the model's own (float32 checkpoints run in 16 bits)."""
    if setting != "auto":
        return DTYPE_BYTES[setting]
    return min(2, DTYPE_BYTES.get(shape.dtype, 2))


def stage_layers(shape: ModelShape, pipeline_parallel_size: int) -> int:
    """Layers of the largest pipeline stage."""
    return math.ceil(shape.layers / max(1, pipeline_parallel_size))
