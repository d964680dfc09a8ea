"""Shared fixtures: a data dir with a demo-model stand-in (config.json only) for API and unit tests, and the
session's one real engine for the integration, console and browser tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.data import make_data_dir
from tests.support.engine import COLD_START_S, EngineHandle, running_engine

# The apps the tests build answer the Host that Starlette's TestClient and schemathesis send ("testserver"), beside
# their own names (engine/edge.py's Host check); tests/api/test_edge.py sets its own allowed_hosts.
os.environ.setdefault("LLMOPS_ALLOWED_HOSTS", '["testserver"]')


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return make_data_dir(tmp_path)


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    """The session's real engine, ready: shared by the integration, console and browser tests."""
    with running_engine(tmp_path_factory.mktemp("engine")) as handle:
        handle.client.wait_for({"ready"}, COLD_START_S)
        yield handle
