"""Shared fixtures: a demo-model stand-in folder for validation tests (no weights; vLLM never sees it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A data dir whose models/demo holds a config.json, enough for settings validation."""
    model = tmp_path / "models" / "demo"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return tmp_path
