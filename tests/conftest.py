"""Shared fixtures: a data dir with a demo-model stand-in (config.json only) for API and unit tests, the session's
one real engine for the integration, console and browser tests, and the database the stores run on.

The store's tests (every test under tests/api but those marked ``postgres``, and those marked ``store``) run on
SQLite by default, and on PostgreSQL with ``LLMOPS_TEST_DATABASE=postgres`` (``make test`` runs them both ways): a
throwaway server
(tests/support/postgres.py) starts before collection, and each test gets a fresh database through
LLMOPS_DATABASE_URL, which every AppConfig, CLI and engine process of the test reads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.data import make_data_dir
from tests.support.engine import COLD_START_S, EngineHandle, running_engine
from tests.support.postgres import PostgresServer, bindir_or_skip, find_bindir, fresh_database, required

ON_POSTGRES = os.environ.get("LLMOPS_TEST_DATABASE", "sqlite") == "postgres"
_SERVER = pytest.StashKey[PostgresServer]()


def pytest_configure(config: pytest.Config) -> None:
    if not ON_POSTGRES:
        return
    bindir = find_bindir()
    if bindir is None:
        if required():
            raise pytest.UsageError("LLMOPS_REQUIRE_POSTGRES=1 and LLMOPS_TEST_DATABASE=postgres, but there are no "
                                    "PostgreSQL server binaries (initdb, pg_ctl): `apt-get install postgresql`, or "
                                    "set LLMOPS_TEST_POSTGRES_BIN")
        return  # each test of the pass skips, saying why (bindir_or_skip)
    server = PostgresServer(bindir)
    server.start()
    config.stash[_SERVER] = server
    # what a module builds at import (the fuzzer's app) runs on PostgreSQL too: a database for the session
    os.environ["LLMOPS_DATABASE_URL"] = fresh_database(server, "session")[1]


def pytest_unconfigure(config: pytest.Config) -> None:
    server = config.stash.get(_SERVER, None)
    if server is not None:
        server.remove()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    api = Path(__file__).parent / "api"
    for item in items:  # those marked postgres run on a server of their own, in the first pass
        if item.path.is_relative_to(api) and item.get_closest_marker("postgres") is None:
            item.add_marker(pytest.mark.store)
        if ON_POSTGRES and item.get_closest_marker("sqlite_file") is not None:
            item.add_marker(pytest.mark.skip(reason="about the data dir's SQLite file: the SQLite pass runs it"))


@pytest.fixture(scope="session")
def postgres(request: pytest.FixtureRequest) -> Iterator[PostgresServer]:
    """The session's PostgreSQL server (skipped where there is none, failed under CI)."""
    shared = request.config.stash.get(_SERVER, None)
    if shared is not None:
        yield shared
        return
    server = PostgresServer(bindir_or_skip())
    try:
        server.start()
        yield server
    finally:
        server.remove()


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """A fresh PostgreSQL database at the schema's head, dropped after the test."""
    name, url = fresh_database(postgres)
    yield url
    postgres.drop_database(name)


@pytest.fixture(autouse=True)
def _store_database(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """On the PostgreSQL pass: this test's own database, for everything that reads LLMOPS_DATABASE_URL."""
    if not ON_POSTGRES:
        return None
    if _SERVER not in request.config.stash:
        bindir_or_skip()
    url: str = request.getfixturevalue("pg_url")
    monkeypatch.setenv("LLMOPS_DATABASE_URL", url)
    return url


@pytest.fixture
def db_target(tmp_path: Path, _store_database: str | None) -> Path | str:
    """Where a store test opens its database: a SQLite file, or on the PostgreSQL pass the test's database."""
    return _store_database or tmp_path / "store.db"

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
