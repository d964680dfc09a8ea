"""Bad input, generated: schemathesis against the engine's own OpenAPI schema (vLLM not started, a real database:
SQLite, then PostgreSQL). Bounded for CI. No 500, no unhandled exception, answers that
match the schema, and no state change when a request is refused. The engine's background loops are not started:
the routes and their validation are."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from pydantic import SecretStr
from schemathesis import checks

from engine.app import create_app
from engine.config import AppConfig
from tests.testkit.data import make_data_dir
from tests.testkit.db import RowCounter
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.postgres import bindir_or_skip, fresh_database, shared_server

# a folder per xdist worker (make test's two): each collects this module and makes its own apps
DATA = (Path(__file__).resolve().parent.parent / "artifacts" / "fuzz-data"
        / os.environ.get("PYTEST_XDIST_WORKER", "main"))
COUNTED = ("revision", "user", "api_token", "saved_prompt", "benchmark_run")


def _app(database_url: str | None) -> FastAPI:
    """The engine's app (its background loops not started) on a fresh data dir, with an admin token for the
    fuzzer."""
    import shutil

    folder = DATA / ("postgresql" if database_url else "sqlite")
    shutil.rmtree(folder, ignore_errors=True)
    app = create_app(AppConfig(data_dir=make_data_dir(folder), autostart=False, admin_password=ADMIN_PASSWORD,
                               queue_timeout_s=0.1, database_url=SecretStr(database_url) if database_url else None))
    app.state.fuzz_token = app.state.services.auth.create_token("fuzz", "admin")[0]
    return app


def _schema(app: FastAPI) -> Any:
    schema = schemathesis.openapi.from_asgi("/openapi.json", app,  # a signed-in route: the schema is not public
                                            headers={"authorization": f"Bearer {app.state.fuzz_token}"})
    # Actions that start or stop vLLM or a benchmark would run real processes: their refusals are covered elsewhere.
    # /readyz answers 503 by design while vLLM is down, and has no input to fuzz. Signing out and revoking tokens
    # could revoke the fuzzer's own token and make every later case a vacuous 401.
    return schema.exclude(path_regex=r"^/api/(engine|benchmarks)").exclude(path_regex=r"^/v1/").exclude(
        path_regex=r"^/readyz$").exclude(path_regex=r"^/api/auth/logout$").exclude(
        path_regex=r"^/api/tokens/", method="DELETE")


# schemathesis builds its cases when the module is collected: the apps are made then, one on each database (the
# PostgreSQL one on the test process's server, started now; where there is none its test skips, saying why)
SQLITE_APP = _app(None)
_server = shared_server()
PG_APP = _app(fresh_database(_server, "fuzz")[1]) if _server is not None else None
sqlite_schema = _schema(SQLITE_APP)
pg_schema = _schema(PG_APP) if PG_APP is not None else _schema(SQLITE_APP)


# each app's rows counted on a connection of the test's own, open for the module (opened on first use)
_COUNTERS: dict[int, RowCounter] = {}


@pytest.fixture(scope="module", autouse=True)
def _counters_closed() -> Iterator[None]:
    yield
    for counter in _COUNTERS.values():
        counter.close()
    _COUNTERS.clear()


def counts(app: FastAPI) -> dict[str, int]:
    counter = _COUNTERS.get(id(app))
    if counter is None:
        counter = _COUNTERS[id(app)] = RowCounter(app.state.services.db, list(COUNTED))
    return counter()


def survives(case: Any, app: FastAPI) -> None:
    before = counts(app)
    response = case.call(headers={"authorization": f"Bearer {app.state.fuzz_token}"})
    # No server error, and answers (status, content type, body, headers) as the schema documents them. Not
    # checked: JSON Schema's exact notion of valid input (1.0 is an integer there; the engine's bodies are strict).
    case.validate_response(response, checks=[checks.not_a_server_error, checks.status_code_conformance,
                                             checks.content_type_conformance, checks.response_schema_conformance,
                                             checks.response_headers_conformance])
    if case.path != "/api/auth/login":
        assert response.status_code != 401, "the fuzzer's admin token stopped working"
    if response.status_code >= 400:
        assert counts(app) == before, \
            f"{case.method} {case.path} was refused ({response.status_code}) yet changed state"


# CI runs 25 cases per operation on SQLite, where the routes' validation is what is fuzzed, and 8 on PostgreSQL, where
# what differs is the store (text it refuses, its errors): together they were half the service tier's time.
# LLMOPS_FUZZ_EXAMPLES=400 digs deeper before a release, on both.
EXAMPLES = int(os.environ.get("LLMOPS_FUZZ_EXAMPLES", "25"))
PG_EXAMPLES = int(os.environ.get("LLMOPS_FUZZ_EXAMPLES", "8"))


@pytest.mark.own_database
@sqlite_schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_survives_generated_input_on_sqlite(case: Any) -> None:
    survives(case, SQLITE_APP)


@pytest.mark.own_database
@pg_schema.parametrize()
@settings(max_examples=PG_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_survives_generated_input_on_postgresql(case: Any) -> None:
    if PG_APP is None:
        bindir_or_skip()
    assert PG_APP is not None
    survives(case, PG_APP)
