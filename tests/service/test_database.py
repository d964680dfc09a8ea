"""The database opened by URL: what a URL may name and how it is shown, the compare-and-set that waits for a writer
in flight on PostgreSQL as on SQLite, text PostgreSQL cannot hold, and the history loops that outlive a write the
database refused."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import make_url
from sqlmodel import col, select

from engine.access import AuditLog, AuditTallies, Auth, AuthError
from engine.app import create_app
from engine.config import AppConfig
from engine.db import SERVING_MINUTE, SERVING_RAW, Database, Revision, database_url, open_database, safe_url
from engine.errors import DatabaseUnavailableError, StaleRevisionError, UnsupportedDatabaseError
from engine.metrics import HISTORY_METRICS, SeriesStore, ServingMonitor
from engine.revisions import RevisionStore
from tests.testkit.db import dialect, sql
from tests.testkit.engine import ADMIN_PASSWORD, REPO
from tests.testkit.wait import wait_until

REAL_SCRAPE = (Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu-metrics.txt").read_text()


def test_a_url_names_sqlite_or_postgresql_and_is_shown_without_its_password(tmp_path: Path) -> None:
    assert database_url("postgres://u:pw@db.internal/llmops").drivername == "postgresql+psycopg"
    assert database_url("postgresql://u:pw@db.internal/llmops").drivername == "postgresql+psycopg"
    assert database_url(tmp_path / "x.db").render_as_string() == f"sqlite:///{tmp_path}/x.db"
    assert safe_url("postgresql://llmops:s3cret@db.internal:5432/llmops") == \
        "postgresql://llmops:***@db.internal:5432/llmops"
    assert "s3cret" not in safe_url("postgresql://llmops@db.internal/llmops?password=s3cret")
    for url in ("mysql://u:s3cret@db/x", "sqlite://", "sqlite:///:memory:", "not a url"):
        with pytest.raises(UnsupportedDatabaseError) as refused:
            database_url(url)
        assert "s3cret" not in str(refused.value) and "sqlite:///PATH" in str(refused.value)
    assert "s3cret" not in repr(AppConfig(database_url="postgresql://u:s3cret@h/d"))


def test_a_server_that_cannot_be_reached_is_said_so_without_the_password(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with pytest.raises(DatabaseUnavailableError) as refused:
        open_database("postgresql://llmops:s3cret@127.0.0.1:1/llmops?connect_timeout=2")
    message = str(refused.value)
    assert "cannot be reached" in message and "127.0.0.1:1" in message and "LLMOPS_DATABASE_URL" in message
    assert "s3cret" not in message and "s3cret" not in caplog.text
    for command in ("current", "upgrade"):
        cli = subprocess.run([sys.executable, "-m", "engine.cli", "db", command], capture_output=True, text=True,
                             cwd=REPO, timeout=120, env={"PATH": "/usr/bin:/bin", "LLMOPS_DATABASE_URL":
                                                         "postgresql://llmops:s3cret@127.0.0.1:1/llmops"})
        assert cli.returncode == 1 and "cannot be reached" in cli.stderr, cli.stderr
        assert "s3cret" not in cli.stderr + cli.stdout and "Traceback" not in cli.stderr


@pytest.mark.store
def test_the_engine_says_which_database_it_opened_and_never_its_password(data_dir: Path,
                                                                         database: str | None) -> None:
    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD)
    app = create_app(config)
    with TestClient(app):
        started = [e for e in app.state.services.events.events() if e.kind == "engine_started"]
    shown = started[-1].data["database"]
    if database is None:
        assert shown == str(data_dir / "llmops.db")
    else:
        assert shown == safe_url(database) and "postgresql" in shown


@pytest.mark.postgres
@pytest.mark.parametrize("server_default", ["read committed", "repeatable read"])
def test_a_compare_and_set_waits_for_a_transaction_in_flight_on_postgresql(pg_url: str, server_default: str) -> None:
    """What BEGIN IMMEDIATE does on SQLite: a writer that read the desired revision holds the others off until it
    commits; the one that waited finds its base stale instead of writing beside it. Whatever isolation the server
    defaults to (a snapshot taken before the lock is granted would miss the first writer's row)."""
    sql(pg_url, f'ALTER DATABASE "{make_url(pg_url).database}" SET default_transaction_isolation = '
                f"'{server_default}'")
    db = open_database(pg_url)
    store = RevisionStore(db)
    store.ensure_initial({"max_num_seqs": 16})
    outcome: dict[str, Any] = {}

    def second_writer() -> None:
        try:
            outcome["rev"] = store.create_revision({"max_num_seqs": 2}, base_revision=1, author="b")
        except StaleRevisionError as exc:
            outcome["stale"] = exc

    with db.session() as first:
        # the first writer's read of the desired revision (its transaction, and so its lock, begins with it)
        assert first.exec(select(Revision.id).order_by(col(Revision.id).desc())).first() == 1
        thread = threading.Thread(target=second_writer)
        thread.start()
        wait_until(lambda: "rev" in outcome or sql(pg_url, "SELECT count(*) FROM pg_locks WHERE locktype = "
                                                            "'advisory' AND NOT granted")[0][0] >= 1,
                   10, what="the second writer done or waiting for the lock")
        first.add(Revision(values={"max_num_seqs": 4}, author="a", parent_id=1))
    thread.join(timeout=30)
    assert "stale" in outcome, f"the second writer wrote beside the first: {outcome}"
    assert outcome["stale"].current == 2
    assert sql(pg_url, "SELECT count(*) FROM revision WHERE parent_id = 1") == [(1,)]
    db.close()


@pytest.mark.store
def test_a_nul_in_a_name_is_refused_or_kept_and_found_on_either_database(db_target: Path | str) -> None:
    """A token's name with a NUL is refused (names are printed and shown); what anonymous requests name (an
    action, a target) is kept as sent where the database can hold it and found again."""
    db = open_database(db_target)
    auth, audit = Auth(db), AuditLog(db)
    with pytest.raises(AuthError, match="control or invisible character"):
        auth.create_token("ci\x00bot", "viewer")
    assert auth.tokens() == []
    audit.record(actor="anonymous", action="post /api/x\x00y", target="token\x00")
    found = audit.query(action="post /api/x\x00y")
    assert len(found) == 1 and found[0].target.startswith("token")
    # every filter, the free-text one too (a LIKE over casts binds plain text: a NUL there was a 500 on PostgreSQL)
    assert [r.target[:5] for r in audit.query(text_="token\x00")] == ["token"]
    assert audit.query(actor="anon\x00", target="\x00", text_="\x00x") == []
    AuditTallies(db, 10, 100).query(source="\x00", action="\x00", target="\x00")
    db.close()


@pytest.mark.store
def test_audit_filters_ignore_case_on_either_database(db_target: Path | str) -> None:
    db = open_database(db_target)
    audit = AuditLog(db)
    audit.record(actor="ana", action="settings.write", target="revision 7", detail="Smaller Batches")
    assert [r.target for r in audit.query(target="REVISION 7")] == ["revision 7"]
    assert [r.target for r in audit.query(action="SETTINGS.")] == ["revision 7"]
    assert [r.target for r in audit.query(text_="smaller batches")] == ["revision 7"]
    assert audit.query(text_="%") == [] and audit.query(target="revision_7") == []  # no wildcards
    db.close()


def _series(db: Database, raw_retention_s: float = 3600) -> SeriesStore:
    store = SeriesStore(db, SERVING_RAW, SERVING_MINUTE, "revision", HISTORY_METRICS, raw_retention_s, 86400)
    store._last_rollup = 1_800_000_000.0
    return store


def _refuse_deletes(db: Database, table: str) -> None:
    """A trigger that fails every DELETE of the table's rows: a write that breaks after its roll-up was made."""
    if dialect(db) == "sqlite":
        sql(db, f"CREATE TRIGGER refuse BEFORE DELETE ON {table} BEGIN SELECT RAISE(ABORT, 'disk full'); END")
    else:
        sql(db, "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'disk full'; "
                "END $$")
        sql(db, f"CREATE TRIGGER refuse BEFORE DELETE ON {table} FOR EACH ROW EXECUTE FUNCTION refuse()")


@pytest.mark.store
def test_a_minute_whose_roll_up_the_database_refused_is_rolled_up_with_the_next_write(db_target: Path | str) -> None:
    db = open_database(db_target)
    store = _series(db, raw_retention_s=30)
    t0 = store._last_rollup
    for s in range(0, 60, 5):
        store.write(t0 + s, [{"revision": 1, "requests_running": float(s)}])
    _refuse_deletes(db, "serving_raw")  # the next write rolls up the minute, then its pruning fails
    with pytest.raises(Exception, match="disk full"):
        store.write(t0 + 61, [{"revision": 1, "requests_running": 1.0}])
    sql(db, "DROP TRIGGER refuse" + ("" if dialect(db) == "sqlite" else " ON serving_raw"))
    store.write(t0 + 62, [{"revision": 1, "requests_running": 2.0}])
    assert sql(db, "SELECT ts, n, requests_running_max FROM serving_minute") == [(t0, 12, 55.0)]
    db.close()


@pytest.mark.store
def test_the_serving_history_outlives_a_write_the_database_refused(db_target: Path | str) -> None:
    db = open_database(db_target)
    store = _series(db)
    monitor = ServingMonitor(5.0, lambda: "http://vllm", lambda: 1, store)
    transport = httpx.MockTransport(lambda _: httpx.Response(200, text=REAL_SCRAPE))

    async def scrape_three_times() -> list[str | None]:
        errors = []
        async with httpx.AsyncClient(transport=transport) as client:
            await monitor.scrape_once(client)  # the first scrape is the baseline of the rates: nothing written
            sql(db, "DROP TABLE serving_raw")
            await monitor.scrape_once(client)
            errors.append(monitor.error)
            SERVING_RAW.create(db.engine)
            await monitor.scrape_once(client)
            errors.append(monitor.error)
        return errors

    errors = asyncio.run(scrape_three_times())
    assert errors[0] is not None and "serving history" in errors[0] and errors[1] is None
    assert monitor.latest is not None
    assert sql(db, "SELECT count(*) FROM serving_raw") == [(1,)]
    db.close()
