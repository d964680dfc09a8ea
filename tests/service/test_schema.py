"""The schema's migrations: a data dir written by release 1e3340b (the last before Alembic) upgrades in place with
nothing lost and keeps serving; a database from a newer engine is refused untouched; the tables in
engine/db/tables.py and the migrations agree on both dialects; a new migration is one command."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import Column, String, Table
from sqlalchemy.exc import IntegrityError
from sqlmodel import SQLModel

from engine.app import create_app
from engine.config import AppConfig
from engine.db import open_database, schema
from engine.db.tables import INTEGER
from engine.errors import DatabaseError, SchemaTooNewError
from engine.gateway import Ledger
from tests.testkit.data import make_data_dir
from tests.testkit.db import dialect, sql
from tests.testkit.engine import REPO

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "data-1e3340b"
MADE = json.loads((FIXTURE / "fixture.json").read_text())  # what tests/fixtures/make_1e3340b_data_dir.py wrote


def legacy_data_dir(tmp_path: Path) -> Path:
    """A data dir as release 1e3340b left it: its database, and a demo-model stand-in for settings validation. A
    copy: even a read-only open of the fixture itself (WAL mode) would leave -shm and -wal files beside it."""
    data = tmp_path / "data"
    if not data.exists():
        make_data_dir(data)
    shutil.copy(FIXTURE / "llmops.db", data / "llmops.db")
    return data


def table_columns(db_file: Path) -> dict[str, list[str]]:
    conn = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        tables = [t for (t,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                  if t != "alembic_version"]
        return {t: [c for (_, c, *_) in conn.execute(f'PRAGMA table_info("{t}")')] for t in tables}
    finally:
        conn.close()


def contents(db_file: Path, only: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """Every table's rows (audit's with each value's storage class), read with sqlite3 in read-only mode; ``only``:
    the tables and columns of an earlier schema (a later revision adds columns and tables beside them)."""
    conn = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        known = table_columns(db_file)
        tables = list(only) if only is not None else list(known)
        out: dict[str, Any] = {}
        for t in tables:
            names = ", ".join(f'"{c}"' for c in (only or known)[t])
            out[t] = conn.execute(f'SELECT {names} FROM "{t}" ORDER BY rowid').fetchall()
        columns = (only or known)["audit"]
        out["audit bytes"] = conn.execute(
            "SELECT " + ", ".join(f'typeof("{c}"), hex(CAST("{c}" AS BLOB))' for c in columns)
            + " FROM audit ORDER BY id").fetchall()
        return out
    finally:
        conn.close()


def schema_sql(db_file: Path) -> dict[str, str]:
    conn = sqlite3.connect(f"file:{db_file}?mode=ro", uri=True)
    try:
        return {name: sql_ for name, sql_ in conn.execute("SELECT name, sql FROM sqlite_master WHERE sql IS NOT NULL")
                if "alembic_version" not in name}
    finally:
        conn.close()


def file_state(data_dir: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(data_dir.glob("llmops.db*"))}


def llmops(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}  # no LLMOPS_DATABASE_URL: the data dir's own file
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=120)


def test_a_data_dir_from_release_1e3340b_upgrades_in_place_with_nothing_lost(tmp_path: Path) -> None:
    data = legacy_data_dir(tmp_path)
    before = contents(data / "llmops.db")
    assert {t: len(rows) for t, rows in before.items() if t != "audit bytes"} == MADE["rows"]
    columns = table_columns(data / "llmops.db")
    db = open_database(data / "llmops.db")
    db.close()
    assert db.applied == schema.pending([]) and db.applied[0] == "0001"
    after = contents(data / "llmops.db", columns)  # the tables and columns it had: byte for byte the same
    assert {t: len(rows) for t, rows in after.items() if t != "audit bytes"} == MADE["rows"]
    for table in before:
        assert after[table] == before[table], f"{table} changed in the upgrade"
    # and all of it is the default deployment's, named after the model it served
    assert sql(data / "llmops.db", "SELECT id, name FROM deployment") == [(1, "demo")]
    assert sql(data / "llmops.db", "SELECT DISTINCT deployment_id FROM revision") == [(1,)]
    assert sql(data / "llmops.db", "SELECT DISTINCT deployment_id FROM benchmark_run") == [(1,)]
    assert sql(data / "llmops.db", "SELECT version_num FROM alembic_version") == [(schema.head(),)]
    assert not open_database(data / "llmops.db").applied  # a second open finds nothing to do


def test_the_upgraded_data_dir_signs_in_its_users_and_tokens_and_takes_writes(tmp_path: Path) -> None:
    data = legacy_data_dir(tmp_path)
    app = create_app(AppConfig(data_dir=data, database_url=None, autostart=False))
    admin = {"authorization": f"Bearer {MADE['admin_token']}"}  # a token release 1e3340b made
    with TestClient(app) as client:
        login = client.post("/api/auth/login", json={"username": "admin", "password": MADE["admin_password"]})
        assert login.status_code == 200
        history = client.get("/api/settings/history", headers=admin).json()
        assert [r["revision"] for r in history] == [5, 4, 3, 2, 1]
        assert history[1]["note"] == "päivitys ✓ — unicode note" and history[1]["status"] == "rejected"
        users = {u["username"]: u for u in client.get("/api/users", headers=admin).json()}
        assert set(users) == {"admin", "ana", "bo", "cleo"} and users["bo"]["disabled"]
        assert [p["name"] for p in client.get("/api/prompts", headers=admin).json()] == ["complete", "haiku"]
        audit = client.get("/api/audit", params={"limit": 1000}, headers=admin).json()
        assert [r["action"] for r in audit][-3:] == ["settings.write", "settings.write", "users.create"]
        gateway = app.state.services.auth.authenticate(MADE["gateway_key"])
        assert gateway is not None and gateway.kind == "gateway" and gateway.rate_limit_per_min == 600
        assert len(app.state.services.ledger.rows(0)) == MADE["rows"]["request_log"]
        kpis = {k["revision"]: k for k in Ledger(app.state.services.db).kpis(10**9)}
        assert kpis[4]["oom_failures"] == 1 and kpis[2]["requests"] == 200  # revision 4's diagnosis
        put = client.put("/api/settings", headers=admin, json={
            "base_revision": 5, "note": "after the upgrade",
            "values": {"model": str((data / "models" / "demo").resolve()), "max_num_seqs": 6}})
        assert put.status_code == 201, put.text
        assert put.json()["revision"] == 6 and put.json()["parent_revision"] == 5
    with pytest.raises(IntegrityError, match="append-only"):
        sql(data / "llmops.db", "UPDATE audit SET actor = 'mallory' WHERE id = 1")


def test_a_database_from_before_some_columns_existed_gains_them_and_keeps_its_rows(tmp_path: Path) -> None:
    db = tmp_path / "old.db"
    conn = sqlite3.connect(db)
    conn.executescript("""
        CREATE TABLE revision (id INTEGER PRIMARY KEY, "values" JSON NOT NULL, author VARCHAR DEFAULT 'unknown',
            note VARCHAR DEFAULT '', created_at FLOAT, parent_id INTEGER, status VARCHAR DEFAULT 'pending',
            status_reason VARCHAR DEFAULT '', status_at FLOAT, forced BOOLEAN DEFAULT 0);
        INSERT INTO revision ("values", author, created_at) VALUES ('{"max_num_seqs": 4}', 'old', 1.0);
        CREATE TABLE calibration (id INTEGER PRIMARY KEY, ts FLOAT, host VARCHAR, model VARCHAR, revision_id INTEGER,
            tensor_parallel_size INTEGER, dtype VARCHAR, enforce_eager BOOLEAN, batched_tokens INTEGER,
            max_num_seqs INTEGER, weights INTEGER, activation INTEGER, non_torch INTEGER, device_total INTEGER,
            kv_bytes INTEGER, kv_tokens INTEGER);
    """)
    conn.commit()
    conn.close()
    from engine.capacity import CalibrationStore
    from engine.revisions import RevisionStore

    opened = open_database(db)
    rev = RevisionStore(opened).desired_revision()
    assert rev is not None and rev.values == {"max_num_seqs": 4} and rev.warnings == []
    assert CalibrationStore(opened).latest("m", 1, "auto") is None
    assert "activation_estimate" in {r[1] for r in sqlite3.connect(db).execute("PRAGMA table_info(calibration)")}
    assert {"audit", "user", "telemetry_minute"} <= {t for (t,) in sql(db, "SELECT name FROM sqlite_master")}


def test_a_new_database_has_exactly_the_schema_an_upgraded_one_has(tmp_path: Path) -> None:
    """A fresh database (the tables created at the head) and one of release 1e3340b brought to the head by the
    migrations: the same tables, columns, indexes and triggers."""
    open_database(tmp_path / "new.db").close()
    legacy = legacy_data_dir(tmp_path) / "llmops.db"
    open_database(legacy).close()
    assert schema_sql(tmp_path / "new.db") == schema_sql(legacy)


def test_a_database_from_a_newer_engine_is_refused_and_left_byte_identical(tmp_path: Path) -> None:
    data = legacy_data_dir(tmp_path)
    open_database(data / "llmops.db").close()
    sql(data / "llmops.db", "UPDATE alembic_version SET version_num = '9999'")
    before = file_state(data)
    with pytest.raises(SchemaTooNewError) as refused:
        create_app(AppConfig(data_dir=data, database_url=None, autostart=False))
    message = str(refused.value)
    assert "9999" in message and f"the newest it knows is {schema.head()}" in message
    assert "Nothing was changed" in message
    assert file_state(data) == before
    upgrade = llmops("db", "upgrade", "--data-dir", str(data))
    assert upgrade.returncode == 1 and "revision 9999" in upgrade.stderr and "Traceback" not in upgrade.stderr
    current = llmops("db", "current", "--data-dir", str(data))
    assert current.returncode == 0 and "newer than this engine" in current.stdout
    assert file_state(data) == before


def test_the_command_line_upgrades_and_reports_the_revision(tmp_path: Path) -> None:
    data = legacy_data_dir(tmp_path)
    before = llmops("db", "current", "--check", "--data-dir", str(data))
    assert before.returncode == 1 and "not stamped" in before.stdout
    upgrade = llmops("db", "upgrade", "--data-dir", str(data))
    assert upgrade.returncode == 0 and f"at revision {schema.head()} (upgraded through 0001" in upgrade.stdout
    after = llmops("db", "current", "--check", "--data-dir", str(data))
    assert after.returncode == 0 and "up to date" in after.stdout


@pytest.mark.postgres
def test_a_postgresql_database_from_a_newer_engine_is_refused_untouched(pg_url: str) -> None:
    sql(pg_url, "UPDATE alembic_version SET version_num = '9999'")
    sql(pg_url, "INSERT INTO saved_prompt (name, mode, system, prompt, params, author, created_at) "
                "VALUES ('kept', 'chat', '', 'hi', '{}', 'x', 0)")

    def state() -> list[tuple[Any, ...]]:
        return sql(pg_url, "SELECT (SELECT string_agg(version_num, ',') FROM alembic_version), "
                           "(SELECT count(*) FROM saved_prompt), (SELECT count(*) FROM pg_trigger), "
                           "(SELECT count(*) FROM pg_tables WHERE schemaname = 'public')")

    before = state()
    with pytest.raises(SchemaTooNewError, match="revision 9999"):
        open_database(pg_url)
    assert state() == before


@pytest.mark.store
def test_the_tables_and_the_migrations_agree(db_target: Path | str) -> None:
    """A change to engine/db/tables.py without its migration fails here (on PostgreSQL too, on the second pass)."""
    db = open_database(db_target)
    try:
        with db.engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), SQLModel.metadata)
    finally:
        db.close()
    assert diff == [], "engine/db/tables.py differs from the migrations: `llmops db revision -m '...'` writes one"


@pytest.mark.postgres
def test_every_integer_column_holds_64_bits_on_postgresql(pg_url: str) -> None:
    narrow = sql(pg_url, "SELECT table_name, column_name FROM information_schema.columns "
                         "WHERE table_schema = 'public' AND data_type IN ('integer', 'smallint')")
    assert narrow == []


@pytest.fixture
def migrations_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The migrations folder copied to tmp_path: a new revision is written there, not into the package."""
    folder = tmp_path / "migrations"
    shutil.copytree(schema.MIGRATIONS, folder, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(schema, "MIGRATIONS", folder)
    schema.scripts.cache_clear()
    try:
        yield folder
    finally:
        schema.scripts.cache_clear()


@pytest.fixture
def scratch_migrations(migrations_copy: Path) -> Iterator[Path]:
    """The copy, and a table added to the engine's metadata for the length of the test."""
    table = Table("token_owner", SQLModel.metadata, Column("id", INTEGER, primary_key=True),
                  Column("token_id", INTEGER, nullable=False, index=True), Column("owner", String, nullable=False),
                  Column("since", INTEGER))
    try:
        yield migrations_copy
    finally:
        SQLModel.metadata.remove(table)


def test_a_revision_with_nothing_to_migrate_is_not_written(migrations_copy: Path) -> None:
    there = sorted(p.name for p in (migrations_copy / "versions").glob("v*.py"))
    assert schema.new_revision("nothing") is None
    assert sorted(p.name for p in (migrations_copy / "versions").glob("v*.py")) == there


@pytest.mark.store
def test_a_new_migration_is_one_command_and_runs_on_the_database(scratch_migrations: Path,
                                                                 db_target: Path | str) -> None:
    was = schema.head()
    nxt = f"{int(was) + 1:04d}"
    path = schema.new_revision("token owners")
    assert path is not None and path.parent == scratch_migrations / "versions"
    assert path.name == f"v{nxt}_token_owners.py"
    text = path.read_text()
    assert "op.create_table('token_owner'" in text and "sqlmodel" not in text and "sa.String()" in text
    assert f"down_revision: str | None = '{was}'" in text
    db = open_database(db_target)  # a database at the head before (the template on PostgreSQL) gets the new one
    try:
        assert db.applied[-1:] == [nxt]
        assert dialect(db) != "postgresql" or sql(db, "SELECT data_type FROM information_schema.columns "
                                                      "WHERE table_name = 'token_owner' AND column_name = 'since'"
                                                  ) == [("bigint",)]
        sql(db, "INSERT INTO token_owner (token_id, owner, since) VALUES (1, 'ana', :big)", {"big": 2**40})
        assert sql(db, "SELECT owner, since FROM token_owner") == [("ana", 2**40)]
    finally:
        db.close()


def test_the_installed_package_carries_its_migrations(tmp_path: Path) -> None:
    """No alembic.ini beside a checkout: what `pip install` puts in site-packages is all an engine has."""
    import zipfile

    src = tmp_path / "src"  # built from a copy: a build in the checkout leaves a build/ folder behind
    for name in ("engine", "console", "pages"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    names = set(zipfile.ZipFile(next(tmp_path.glob("*.whl"))).namelist())
    shipped = {str(p.relative_to(REPO)) for p in schema.MIGRATIONS.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert {"engine/db/migrations/script.py.mako", "engine/db/migrations/versions/v0001_baseline.py"} <= shipped
    assert shipped | {"engine/db/schema.py", "engine/db/tables.py"} <= names, \
        f"missing from the wheel: {sorted(shipped - names)}"


def test_two_revisions_on_one_parent_are_refused_with_how_to_order_them(scratch_migrations: Path,
                                                                        tmp_path: Path) -> None:
    """Two branches that each added the next revision: the engine says so instead of migrating one of them."""
    head = schema.head()
    for rev in (f"{int(head) + 1:04d}", f"{int(head) + 2:04d}"):
        (scratch_migrations / "versions" / f"v{rev}_branch.py").write_text(
            f'revision = "{rev}"\ndown_revision = "{head}"\nbranch_labels = None\ndepends_on = None\n\n\n'
            "def upgrade() -> None:\n    pass\n\n\ndef downgrade() -> None:\n    pass\n")
    schema.scripts.cache_clear()
    with pytest.raises(DatabaseError, match="migrations have 2 heads") as refused:
        open_database(tmp_path / "x.db")
    assert "down_revision" in str(refused.value)
    assert not (tmp_path / "x.db").exists() or sql(tmp_path / "x.db", "SELECT name FROM sqlite_master") == []
