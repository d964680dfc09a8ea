"""Data dirs for tests that need settings validation but not a real model: a config.json of the demo model's
shape (vLLM never sees it)."""

from __future__ import annotations

import json
from pathlib import Path

# The demo model's config.json (engine/demo_model), without its weights.
DEMO_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 2048, "tie_word_embeddings": True,
              "dtype": "bfloat16"}


def make_data_dir(path: Path) -> Path:
    """A data dir whose models/demo holds a config.json, enough for settings validation."""
    model = path / "models" / "demo"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(DEMO_SHAPE))
    return path
