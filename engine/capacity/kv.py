"""The KV cache as vLLM 0.26 lays it out and reports it (vllm/v1/core/kv_cache_utils.py, kv_cache_interface.py).

Each attention layer has a spec: full attention, sliding window, or MLA (one latent per token). A page is one
block of one layer: ``block_size x per-token bytes`` (full and sliding: 2 x KV heads per rank x head_dim x dtype
bytes; MLA: latent x dtype bytes). Layers of one kind form one group when every layer is the same; a model that
mixes kinds (Gemma 3: 5 sliding to 1 full) is split by the hybrid allocator into groups of ``group_size`` layers
(the count of the rarer kind, or of the commoner when it is under 1.5 times the rarer), the last group of a kind
padded. ``group_size`` tensors are each shared by one layer of every group, so::

    num_blocks = available // page // group_size

A request of ``max_model_len`` tokens takes, in every group, ``cdiv(L, block)`` blocks (full, MLA) or
``cdiv(min(window - 1 + in_flight, L), block) + 1`` (sliding: what stays in the window plus the tokens of the
batches in flight, ``in_flight = concurrent batches x max_num_batched_tokens``). vLLM logs::

    GPU KV cache size: int(num_blocks / blocks_per_request x L) tokens
    Maximum concurrency for L tokens per request: num_blocks / blocks_per_request

so for a hybrid or sliding model the logged tokens are the tokens of ``max_model_len`` requests that fit, not
``num_blocks x block``. A start passes vLLM's check when ``group_size x page x blocks_per_request(L)`` fits.

vLLM 0.32 (the CPU build here) computes the same: its concurrency sums ``cdiv(max memory, page)`` per group, its
CPU platform keeps the hybrid allocator (``support_hybrid_kv_cache``), and a sliding layer takes the primary
layers' block (128 there; in 0.26 on CUDA the backend's smallest, 16, which is the primary's too). Without the
hybrid allocator (``--disable-hybrid-kv-cache-manager``, some KV connectors) sliding layers beside full ones count
as full attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.capacity.shape import V2_RUNNER_MOE, ModelShape

Kind = str  # "full" | "sliding" | "mla"


@dataclass(frozen=True)
class KvGroup:
    kind: Kind
    window: int | None
    block_size: int
    layers: int  # real layers (at most the layout's group_size; the rest are padding)

    def blocks_for(self, length: int, in_flight: int) -> int:
        """Blocks one request of ``length`` tokens holds in this group at most."""
        if self.kind == "sliding" and self.window:
            return math.ceil(min(self.window - 1 + in_flight, length) / self.block_size) + 1
        return math.ceil(length / self.block_size)


@dataclass(frozen=True)
class KvLayout:
    groups: tuple[KvGroup, ...]
    group_size: int
    page_bytes: int  # one block of one layer, the same in every group
    per_token_bytes: int  # one token in every layer of the stage (each layer's share at its own page)
    in_flight: int  # tokens scheduled but not settled: what a sliding layer holds beyond its window
    padding_layers: int = 0

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size if self.groups else 1

    @property
    def hybrid(self) -> bool:
        return len({(g.kind, g.window) for g in self.groups}) > 1

    def blocks(self, kv_bytes: int) -> int:
        return max(0, kv_bytes) // self.page_bytes // self.group_size if self.groups else 0

    def blocks_per_request(self, length: int) -> int:
        return sum(g.blocks_for(length, self.in_flight) for g in self.groups)

    def need_bytes(self, length: int) -> int:
        """What vLLM's start-up check needs for one request of ``length`` tokens."""
        return self.group_size * self.page_bytes * self.blocks_per_request(length)

    def concurrency(self, blocks: int, length: int) -> float:
        per_request = self.blocks_per_request(length)
        return blocks / per_request if per_request else 0.0

    def logged_tokens(self, blocks: int, length: int) -> int:
        """vLLM's "GPU KV cache size: N tokens" for ``blocks`` blocks and max_model_len ``length``."""
        return int(self.concurrency(blocks, length) * length)

    def longest_request(self, kv_bytes: int, limit: int) -> int:
        """The longest request (at most ``limit`` tokens) that fits beside vLLM's null block."""
        room = kv_bytes - self.group_size * self.page_bytes
        if not self.groups or room < self.need_bytes(1):
            return 0
        lo, hi = 1, max(1, limit)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.need_bytes(mid) <= room else (lo, mid - 1)
        return lo

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for g in self.groups:
            name = f"sliding window {g.window}" if g.kind == "sliding" else ("MLA" if g.kind == "mla" else "full")
            kinds[name] = kinds.get(name, 0) + g.layers
        parts = ", ".join(f"{n} {k}" for k, n in kinds.items())
        return (f"{parts} layers in {len(self.groups)} group(s) of {self.group_size}, blocks of {self.block_size} "
                f"tokens" + (f" ({self.padding_layers} padding layers)" if self.padding_layers else ""))


def concurrent_batches(shape: ModelShape, pipeline_parallel_size: int, async_scheduling: bool = True) -> int:
    """vLLM's max_concurrent_batches: with async scheduling (its default) the V2 model runner keeps pp + 1
    batches in flight, the V1 runner (MoE outside a short list) 2, or pp with pipeline parallel; without, pp."""
    pp = max(1, pipeline_parallel_size)
    if not async_scheduling:
        return pp
    v2 = shape.moe is None or any(a in V2_RUNNER_MOE for a in shape.architectures)
    return pp + 1 if v2 else (2 if pp <= 1 else pp)


def layer_kinds(shape: ModelShape) -> list[tuple[Kind, int | None]]:
    if shape.mla:
        return [("mla", None)] * shape.layers
    return [("sliding", w) if w else ("full", None) for w in shape.layer_windows]


def layout(shape: ModelShape, *, kv_dtype_bytes: int, tensor_parallel_size: int, pipeline_parallel_size: int,
           block_size: int, mla_block_size: int, hybrid_allocator: bool, batched_tokens: int,
           async_scheduling: bool = True) -> KvLayout:
    """The KV layout of the largest pipeline stage on one tensor-parallel rank."""
    tp, pp = max(1, tensor_parallel_size), max(1, pipeline_parallel_size)
    stage = math.ceil(shape.layers / pp)
    kinds = layer_kinds(shape)[:stage]
    if not hybrid_allocator and len(set(kinds)) > 1:  # without the hybrid allocator sliding layers count as full
        kinds = [("full", None) if k == "sliding" else (k, w) for k, w in kinds]
    if shape.mla:
        per_layer = shape.mla.latent * kv_dtype_bytes
        block = mla_block_size
    else:
        heads = max(1, shape.kv_heads // tp) if tp <= shape.kv_heads else 1
        per_layer = 2 * heads * shape.head_dim * kv_dtype_bytes
        block = block_size
    page = per_layer * block
    in_flight = concurrent_batches(shape, pp, async_scheduling) * batched_tokens
    counts: dict[tuple[Kind, int | None], int] = {}
    for k in kinds:
        counts[k] = counts.get(k, 0) + 1
    if len(counts) == 1:
        (kind, window), n = next(iter(counts.items()))
        return KvLayout((KvGroup(kind, window, block, n),), n, page, per_layer * stage, in_flight)
    fewest, most = min(counts.values()), max(counts.values())
    size = most if most < fewest * 1.5 else fewest
    groups: list[KvGroup] = []
    padding = 0
    for (kind, window), n in counts.items():
        split = math.ceil(n / size)
        padding += split * size - n
        groups += [KvGroup(kind, window, block, len(range(i, n, split))) for i in range(split)]
    return KvLayout(tuple(groups), size, page, per_layer * stage, in_flight, padding)
