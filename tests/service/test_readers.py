"""What the console and on-call read while a write holds the database: every transaction of the engine waits for
the one that holds it (SQLite's write lock, PostgreSQL's advisory lock), up to LOCK_TIMEOUT_S, then fails with a 503.
The API's reads take no lock (Database.read()): a page answers during an apply's writes, a burst of the ledger's
or a slow migration's, instead of waiting behind them and then failing."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.exc import InternalError
from sqlmodel import select

from engine.access.auth import Auth
from engine.app import create_app
from engine.config import AppConfig
from engine.db import DEFAULT_DEPLOYMENT, ApiToken, Database, open_database
from engine.db.tables import Team
from engine.gateway.ledger import Record
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.wait import wait_until

# What the console's pages and an on-call engineer's scripts read (the default deployment is named after its
# model: "demo").
READS = [
    "/api/status", "/api/settings", "/api/settings/history", "/api/settings/1", "/api/capacity", "/api/events",
    "/api/deployments", "/api/deployments/demo", "/api/deployments/demo/deletion", "/api/fleet",
    "/api/models", "/api/deployments/demo/adapters", "/api/teams", "/api/usage", "/api/auth/me", "/api/users",
    "/api/tokens", "/api/gpu", "/api/gpu/history", "/api/gateway", "/metrics", "/api/prompts", "/api/serving",
    "/api/serving/history", "/api/serving/instances/history", "/api/serving/scaling/history", "/api/kpis",
    "/api/audit", "/api/audit/tallies", "/api/benchmarks", "/api/alerts/channels", "/api/alerts/rules",
    "/api/alerts/fired",
]


class HeldWrite:
    """A transaction of the engine's database held open (a write in it) until ``release``."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.holding, self.released = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._hold)

    def _hold(self) -> None:
        with self.db.session() as s:
            s.add(Team(name="held"))
            s.flush()
            self.holding.set()
            self.released.wait(120)

    def __enter__(self) -> HeldWrite:
        self.thread.start()
        assert self.holding.wait(10)
        return self

    @property
    def held(self) -> bool:
        return self.thread.is_alive() and not self.released.is_set()

    def __exit__(self, *_: object) -> None:
        self.released.set()
        self.thread.join(30)


@pytest.fixture
def engine_app(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> FastAPI:
    monkeypatch.setattr("engine.db.database.LOCK_TIMEOUT_S", 2)  # what waits for the lock fails in 2 s, not 10
    return create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))


def test_the_console_s_reads_answer_while_a_write_holds_the_database(engine_app: FastAPI) -> None:
    services = engine_app.state.services
    admin = {"authorization": f"Bearer {services.auth.create_token('ops', 'admin')[0]}"}
    with TestClient(engine_app, raise_server_exceptions=False) as client:
        assert client.post("/api/prompts", headers=admin, json={"name": "p", "prompt": "hello"}).status_code == 201
        before = {path: client.get(path, headers=admin) for path in READS}
        assert {p: r.status_code for p, r in before.items() if r.status_code != 200} == {}
        with HeldWrite(services.db) as write:
            during = {path: client.get(path, headers=admin) for path in READS}
            assert write.held  # every read answered while the write was held, not after it
        refused = sorted(p for p, r in during.items() if r.status_code != 200)
        assert refused == [], ", ".join(refused)
        assert during["/api/prompts"].json()[0]["name"] == "p"  # what they read is what was committed
        with services.db.read() as s:  # the write went on after them
            assert [t.name for t in s.exec(select(Team)).all()] == ["held"]


def test_a_token_first_used_while_a_write_holds_the_database_answers_and_its_use_is_recorded_after(
        engine_app: FastAPI) -> None:
    """A token's last use is written at most once a minute: that write waited for the lock on the request's path."""
    services = engine_app.state.services
    admin = {"authorization": f"Bearer {services.auth.create_token('ops', 'admin')[0]}"}
    fresh, row = services.auth.create_token("on-call", "viewer")
    with TestClient(engine_app, raise_server_exceptions=False) as client:
        with HeldWrite(services.db) as write:
            answer = client.get("/api/status", headers={"authorization": f"Bearer {fresh}"})
            assert write.held
        assert answer.status_code == 200, answer.text

        def last_used() -> float | None:
            tokens = client.get("/api/tokens", headers=admin).json()
            return cast(float | None, next(t["last_used_at"] for t in tokens if t["id"] == row.id))

        wait_until(lambda: last_used() is not None, 10, what="the token's use recorded once the write ended")
        assert abs(cast(float, last_used()) - time.time()) < 60


def test_the_engine_s_stop_waits_for_a_token_s_last_use_still_being_written(engine_app: FastAPI) -> None:
    """The last use is written by a thread of its own (a daemon): an engine stopped while it waited for the database
    lost it. The stop now waits for it (Auth.flush_uses, up to 5 s), and says when it could not."""
    services = engine_app.state.services
    fresh, row = services.auth.create_token("on-call", "viewer")
    with HeldWrite(services.db):
        assert services.auth.authenticate(fresh) is not None
        assert not services.auth.flush_uses(0.2)  # its writer waits for the lock the held write has
    assert services.auth.flush_uses(10)
    with services.db.read() as s:
        used = s.get(ApiToken, row.id)
        assert used is not None and used.last_used_at is not None and abs(used.last_used_at - time.time()) < 60


def test_the_kpis_and_the_audit_s_tallies_answer_while_a_write_holds_the_database_and_count_the_rest_after(
        engine_app: FastAPI) -> None:
    """Both write what they buffered (the ledger's requests, the refusals counted) before they read: that write
    waited for the lock on the page's path. It waits READ_FLUSH_WAIT_S now, and the page shows what is committed."""
    services = engine_app.state.services
    admin = {"authorization": f"Bearer {services.auth.create_token('ops', 'admin')[0]}"}
    with TestClient(engine_app, raise_server_exceptions=False) as client:
        assert client.get("/api/kpis", headers=admin).status_code == 200  # (its hourly prune done)
        with HeldWrite(services.db) as write:
            services.ledger.record(Record(ts=time.time(), revision_id=1, model="demo", endpoint="/v1/completions",
                                          stream=False, status=200, latency_s=0.1, client="held-up", input_tokens=3,
                                          output_tokens=5, deployment_id=DEFAULT_DEPLOYMENT))
            assert client.put("/api/settings", json={"values": {}}).status_code == 401  # tallied, not a row
            kpis = client.get("/api/kpis", headers=admin, params={"client": "held-up"})
            tallies = client.get("/api/audit/tallies", headers=admin)
            assert write.held
        assert (kpis.status_code, tallies.status_code) == (200, 200), (kpis.text, tallies.text)
        assert kpis.json()["revisions"] == []  # what was committed: the request waits for the next flush

        def counted() -> bool:
            rows = client.get("/api/kpis", headers=admin, params={"client": "held-up"}).json()["revisions"]
            refused = [t for t in client.get("/api/audit/tallies", headers=admin).json()
                       if t["action"] == "settings.write" and t["result"] == 401]
            return [r["requests"] for r in rows] == [1] and sum(t["count"] for t in refused) == 1

        wait_until(counted, 15, what="the request and the refusal counted once the write ended")


def test_a_token_s_use_the_database_refused_to_record_does_not_stop_later_uses_from_being_recorded(
        db_target: Path | str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread that writes tokens' last uses ends on any database error (a read-only server after a failover,
    a corrupt file), and the next use starts another: a writer that died unnoticed recorded none again."""
    db = open_database(db_target)
    auth = Auth(db, hash_workers=1)
    first, _ = auth.create_token("first", "viewer")
    second, row = auth.create_token("second", "viewer")
    real, refused = db.session, threading.Event()

    def read_only_once(wait_s: float | None = None) -> Any:
        if threading.current_thread().name == "llmops-token-uses" and not refused.is_set():
            refused.set()
            raise InternalError("UPDATE api_token", None, Exception("cannot execute UPDATE in a read-only "
                                                                     "transaction (a test's fault)"))
        return real(wait_s)

    monkeypatch.setattr(db, "session", read_only_once)

    def writers() -> int:
        return sum(t.name == "llmops-token-uses" for t in threading.enumerate())

    assert auth.authenticate(first) is not None
    wait_until(lambda: refused.is_set() and writers() == 0, 10, what="the first use's write refused, its writer ended")
    assert auth.authenticate(second) is not None

    def recorded() -> float | None:
        with db.read() as s:
            return cast(float | None, s.get(ApiToken, row.id).last_used_at)  # type: ignore[union-attr]

    wait_until(lambda: recorded() is not None, 10, what="the second token's use recorded")
    db.close()



def test_a_read_the_sqlite_file_fails_says_it_could_not_be_read_and_a_write_that_it_could_not_be_written(
        engine_app: FastAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GET whose read SQLite refused (an I/O error, a damaged file) said the database "could not be written" and
    "the change was not recorded": on-call went looking for a change and a full disk. Now a read says it could not
    be read; a write still says it could not be written, and what to do."""
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from engine.events import EventLog
    from engine.prompts import PromptStore

    def fails(*_: object, **__: object) -> None:
        raise OperationalError("SELECT", {}, sqlite3.OperationalError("disk I/O error"))

    services = engine_app.state.services
    admin = {"authorization": f"Bearer {services.auth.create_token('ops', 'admin')[0]}"}
    with TestClient(engine_app, raise_server_exceptions=False) as client:
        monkeypatch.setattr(EventLog, "events", fails)
        read = client.get("/api/events", headers=admin)
        assert read.status_code == 503 and read.headers["retry-after"] == "5"
        assert "could not be read (disk I/O error)" in read.json()["detail"]
        assert "written" not in read.json()["detail"] and "nothing was changed" in read.json()["detail"]
        monkeypatch.setattr(PromptStore, "save_prompt", fails)
        write = client.post("/api/prompts", headers=admin, json={"name": "p", "prompt": "hello"})
        assert write.status_code == 503 and "could not be written (disk I/O error)" in write.json()["detail"]
        monkeypatch.setattr(Auth, "authenticate", fails)  # the token's own check, before any route
        checked = client.get("/api/settings", headers=admin)
        assert checked.status_code == 503 and "could not be read (disk I/O error)" in checked.json()["detail"]
