"""Shared fixtures: a demo-model stand-in folder (config.json only; vLLM never sees it) for API and unit tests,
and the session's one real engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine_process import COLD_START_S, EngineHandle, start_engine, stop_engine

REPO = Path(__file__).resolve().parent.parent


# The demo model's config.json (engine/demo_model.py), without its weights.
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


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return make_data_dir(tmp_path)


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    """The session's real engine, ready: shared by the integration, console and browser tests."""
    handle = start_engine(tmp_path_factory.mktemp("engine"))
    try:
        handle.client.wait_for({"ready"}, COLD_START_S)
        yield handle
    finally:
        stop_engine(handle)
