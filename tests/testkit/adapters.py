"""LoRA adapter folders for tests that check or register one without training it: PEFT's layout (adapter_config.json
and adapter_model.safetensors) with zero weights of the right shapes, and base-model weights of the demo model's
shape for the checks that compare them (sparse files: only their headers are read)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

# the demo model's linear modules (out, in): engine/demo_model, hidden 256, 4 heads and 2 KV heads of 64, MLP 768
DEMO_MODULES: dict[str, tuple[int, int]] = {
    "self_attn.q_proj": (256, 256), "self_attn.k_proj": (128, 256), "self_attn.v_proj": (128, 256),
    "self_attn.o_proj": (256, 256), "mlp.gate_proj": (768, 256), "mlp.up_proj": (768, 256),
    "mlp.down_proj": (256, 768)}
DEMO_LAYERS = 2


def write_safetensors(path: Path, shapes: dict[str, list[int]], dtype: str = "BF16") -> None:
    """A safetensors file of zero tensors of ``shapes`` (sparse: the data is a hole)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in shapes.items():
        size = 2
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def give_demo_weights(model_dir: Path) -> None:
    """A model.safetensors of the demo model's shape beside its config.json (tests/testkit/data.py)."""
    shapes = {f"model.layers.{i}.{m}.weight": list(oi) for i in range(DEMO_LAYERS) for m, oi in DEMO_MODULES.items()}
    shapes["model.embed_tokens.weight"] = [2048, 256]
    write_safetensors(model_dir / "model.safetensors", shapes)


def make_adapter(folder: Path, *, rank: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"),
                 modules: dict[str, tuple[int, int]] | None = None, **config: Any) -> Path:
    """A LoRA adapter of ``rank`` on ``targets`` for the demo model (``modules``: other (out, in) shapes)."""
    folder.mkdir(parents=True, exist_ok=True)
    shapes_of = modules or DEMO_MODULES
    tensors: dict[str, list[int]] = {}
    for i in range(DEMO_LAYERS):
        for module, (out, inp) in shapes_of.items():
            if module.rsplit(".", 1)[-1] in targets:
                prefix = f"base_model.model.model.layers.{i}.{module}"
                tensors[f"{prefix}.lora_A.weight"] = [rank, inp]
                tensors[f"{prefix}.lora_B.weight"] = [out, rank]
    write_safetensors(folder / "adapter_model.safetensors", tensors)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "base_model_name_or_path": "demo", **config}))
    return folder
