"""Fixtures the unit tier's files share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_capacity import LLAMA3_8B


@pytest.fixture
def m8b(tmp_path: Path) -> Path:
    """A folder with the Llama-3-8B shape's config.json (what pre-flight reads of a model)."""
    folder = tmp_path / "m8b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B))
    return folder
