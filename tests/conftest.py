"""One harness for every tier (tests/testkit), the tiers a folder each, cheapest first:

- **unit**: functions and small objects, no database;
- **service**: the API and the store, each test on SQLite *and* on PostgreSQL (one parameter, ``database``: a
  throwaway server from Debian's postgresql, tests/testkit/postgres.py, a fresh database per test copied from a
  template migrated once);
- **serving**: the controller's scenarios over fake vLLM children and a clock the test moves (tests/testkit/serving.py);
- **console**: every page through AppTest against the engine app in this process, fake vLLM beneath it;
- **system**: the real engine with real vLLM (the CPU build here), PostgreSQL and a Ray cluster: a handful of journeys;
- **browser**: the console's journeys in Chromium against the system tier's engine;
- **gpu**: the real engine on an NVIDIA GPU (skipped where NVML finds none).

Each test is marked with its tier (``pytest -m "unit or service"``); the end of a run says what each tier took.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.vllm import command, free_port
from tests.testkit.data import make_data_dir
from tests.testkit.engine import COLD_START_S, EngineHandle, running_engine
from tests.testkit.postgres import PostgresServer, bindir_or_skip, fresh_database, shared_server

TESTS = Path(__file__).parent
TIERS = ("unit", "service", "serving", "console", "system", "browser", "gpu")

# The apps the tests build answer the Host that Starlette's TestClient and schemathesis send ("testserver"), beside
# their own names (engine/edge.py's Host check); tests/service/test_edge.py sets its own allowed_hosts.
os.environ.setdefault("LLMOPS_ALLOWED_HOSTS", '["testserver"]')
# The engines the tests build have no gateway workers unless a test asks (by cores, a machine of 4 or more would
# start them on port + 1 in every one); the session engine and tests/service/test_gateway_workers.py have theirs.
os.environ.setdefault("LLMOPS_GATEWAY_WORKERS", "0")


@pytest.fixture(autouse=True)
def _no_socket_folder_left() -> Iterator[None]:
    """What an engine's end does (engine/vllm/command.py, remove_ipc_folder) for the short folders a test's own
    process gave vLLM's sockets (a deep data dir: nearly every test's): they go with the test."""
    given = set(command._IPC_GIVEN)
    yield
    for folder in command._IPC_GIVEN - given:
        command._IPC_GIVEN.discard(folder)
        if not os.path.islink(folder):
            shutil.rmtree(folder, ignore_errors=True)


def tier_of(path: Path) -> str | None:
    try:
        part = path.relative_to(TESTS).parts[0]
    except ValueError:
        return None
    return part if part in TIERS else None


# The modules of the tiers with a real vLLM whose tests start engines of their own rather than the session's.
OWN_ENGINES = frozenset({"tests/system/test_fleet.py", "tests/system/test_postgres_engine.py",
                         "tests/system/test_up.py"})


def xdist_scope(nodeid: str) -> str:
    """What one worker of ``pytest -n N`` (make test's two) runs in a row, from a test's id: every test of the
    session's real engine, one scope (the engine starts once, and its journeys follow each other as written); a
    module of OWN_ENGINES, one scope (its module-scoped cluster starts once); any other test, itself. A module that
    starts its own engine but is not listed runs with the session's, as before: correct, only less parallel."""
    path = nodeid.split("::", 1)[0]
    if tier_of(TESTS.parent / path) not in ("system", "browser", "gpu"):
        return nodeid
    return path if path in OWN_ENGINES else "engine"


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """xdist's load-by-scope scheduling, the largest scope first, with the scopes of ``xdist_scope`` (xdist's own
    ``xdist_group`` marks do not reach its scheduler under pytest 9.2: the worker suffixes a field the id no longer
    reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):  # type: ignore[misc]  # (xdist has no types)
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    return TierScheduling(config, log)


def _own_id(item: pytest.Item) -> None:
    """schemathesis names each API operation's item (``test_x[GET /path]``) after pytest has made the item's id from
    the function's name; under pytest 9.2 the id no longer follows the name, and every operation's item shared its
    function's id: xdist, which schedules by id, ran one of each function's 90. The id of its own name again."""
    node_id = getattr(item, "_id", None)
    if node_id is None or item.parent is None or item.nodeid.endswith("::" + item.name):
        return
    item._id = item.parent.id.child(item.name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        _own_id(item)
        tier = tier_of(item.path)
        if tier is not None:
            item.add_marker(getattr(pytest.mark, tier))
    # the cheapest tiers first, whatever order the paths were given in
    items.sort(key=lambda item: TIERS.index(tier_of(item.path) or "gpu"))


def _on_both(definition: pytest.Function) -> bool:
    """A test of the store: every service test, and those marked ``store`` elsewhere; but not those about the SQLite
    file itself (``sqlite_file``), nor those that use a PostgreSQL server of their own (``postgres``) or choose their
    databases themselves (``own_database``), nor those of what does not depend on the store (``one_database``)."""
    if any(definition.get_closest_marker(m) for m in ("sqlite_file", "postgres", "own_database", "one_database")):
        return False
    return tier_of(definition.path) == "service" or definition.get_closest_marker("store") is not None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "database" in metafunc.fixturenames and _on_both(metafunc.definition):
        metafunc.parametrize("database", ["sqlite", "postgres"], indirect=True)


_TIER_TIMES: dict[str, list[float]] = {}  # tier → [seconds of its tests' setup, call and teardown, tests]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = tier_of(TESTS.parent / report.nodeid.split("::", 1)[0])  # (schemathesis's items are located in its own code)
    if tier is not None:
        spans = _TIER_TIMES.setdefault(tier, [0.0, 0.0])
        spans[0] += report.duration
        spans[1] += report.when == "call"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    times = _TIER_TIMES
    if not times:
        return
    terminalreporter.section("time per tier")
    workers = getattr(config.option, "numprocesses", None)
    if workers:
        terminalreporter.write_line(f"(the tests' own times: on {workers} workers side by side they add up to more "
                                    "than the run's)")
    for tier in TIERS:
        if tier in times:
            seconds, count = times[tier]
            terminalreporter.write_line(f"{tier:8} {int(count):4d} tests {seconds:8.1f} s ({seconds / 60:.1f} min)")


# --- the database a test runs on -----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def postgres() -> PostgresServer:
    """The test process's PostgreSQL server, started on first use (skipped where there is none, failed under CI)."""
    bindir_or_skip()
    server = shared_server()
    assert server is not None
    return server


@pytest.fixture
def pg_url(postgres: PostgresServer) -> Iterator[str]:
    """A fresh PostgreSQL database at the schema's head, dropped after the test."""
    name, url = fresh_database(postgres)
    yield url
    postgres.drop_database(name)


@pytest.fixture(autouse=True)
def database(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """Where the test's engine keeps its state: SQLite in its data dir (None), or, for a store test's
    ``postgres`` parameter, a database of its own on the session's server, named in LLMOPS_DATABASE_URL (which
    every AppConfig, CLI and engine process of the test reads)."""
    if getattr(request, "param", "sqlite") != "postgres":
        return None
    url: str = request.getfixturevalue("pg_url")
    monkeypatch.setenv("LLMOPS_DATABASE_URL", url)
    return url


@pytest.fixture
def db_target(tmp_path: Path, database: str | None) -> Path | str:
    """Where a store test opens its database: a SQLite file, or on the PostgreSQL parameter the test's database."""
    return database or tmp_path / "store.db"


# --- cheap password hashes -----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _cheap_password_hashes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """argon2 at its lowest cost for the engines the tests build in process (tests only: the engine's own is
    argon2's recommended 64 MiB, 3 passes, 4 lanes); a hash made at any cost is still verified by its own. The tests
    of the hashing pool's bounds (``real_hashes``) keep the real cost."""
    if request.node.get_closest_marker("real_hashes"):
        return
    from argon2 import PasswordHasher

    monkeypatch.setattr("engine.access.auth.PasswordHasher",
                        functools.partial(PasswordHasher, time_cost=1, memory_cost=64, parallelism=1))


# --- data dirs and the real engine --------------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return make_data_dir(tmp_path)


@pytest.fixture(autouse=True)
def _no_leftover_load() -> Iterator[None]:
    """A test's streaming clients end with it, even when it failed before stopping them (tests/testkit/load.py)."""
    yield
    from tests.testkit.load import stop_leftovers

    stop_leftovers()


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineHandle]:
    """The session's real engine (real vLLM), ready: shared by the system and browser tiers. Its vLLM runs eager
    (no torch.compile): each of the tiers' restarts is about 15 s shorter on two cores, and what they prove (plans,
    phases, the gateway, the console's journeys) does not depend on it; the engines of test_fleet, test_postgres_engine
    and test_up start vLLM as the product's defaults do, compile included. It serves LoRA adapters (enable_lora)."""
    data_dir = tmp_path_factory.mktemp("engine")
    with running_engine(data_dir, {"LLMOPS_AUTOSTART": "false"}) as first:  # the revision written, nothing started
        rev = first.client.settings().revision
        # LoRA on from the start (two slots of rank 8): the adapters' journeys register one live, no restart
        first.client.put_settings(rev, {"enforce_eager": True, "enable_lora": True, "max_loras": 2,
                                        "max_lora_rank": 8}, "tests: eager vLLM, shorter restarts; LoRA")
    # as the product runs: autostart on (a new deployment starts at once), with a gateway worker on a data port
    with running_engine(data_dir, {"LLMOPS_GATEWAY_WORKERS": "1", "LLMOPS_GATEWAY_PORT": str(free_port())}) as handle:
        handle.client.wait_for({"ready"}, COLD_START_S)
        yield handle
