"""Hostile input, as an outside probe sent it (issue 11): each finding, the class it stands for, and what must
hold — a 4xx naming the field or the reason, nothing changed, the audit still readable, the service up.

On a real database (SQLite, or PostgreSQL on make test's second pass) with vLLM not started (autostart off); the
/v1 findings that need vLLM itself (dot-segments reaching vLLM's own routes) are in tests/system/test_engine.py.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.exc import IntegrityError

from engine.app import create_app
from engine.config import AppConfig
from engine.vllm.logs import ChildLog
from tests.testkit.db import dialect, sql
from tests.testkit.engine import ADMIN_PASSWORD


def deep(n: int) -> str:
    return "[" * n + "1" + "]" * n


@pytest.fixture
def app(data_dir: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               gateway_keys="on"))
    auth = app.state.services.auth
    admin = {"authorization": f"Bearer {auth.create_token('t-admin', 'admin')[0]}"}
    prompter = {"authorization": f"Bearer {auth.create_token('t-prompter', 'prompter')[0]}"}
    with TestClient(app) as client:
        yield client, {"admin": admin["authorization"], "prompter": prompter["authorization"]}


def client_db_is_sqlite(app: tuple[TestClient, dict[str, str]]) -> bool:
    return dialect(app[0].app.state.services.db) == "sqlite"  # type: ignore[attr-defined]


def h(tokens: dict[str, str], role: str) -> dict[str, str]:
    return {"authorization": tokens[role]}


def raw(client: TestClient, method: str, path: str, body: bytes, headers: dict[str, str] | None = None) -> Any:
    return client.request(method, path, content=body, headers={"content-type": "application/json",
                                                               **(headers or {})})


def audit_rows(client: TestClient, tokens: dict[str, str]) -> list[dict[str, Any]]:
    resp = client.get("/api/audit", params={"limit": 1000}, headers=h(tokens, "admin"))
    assert resp.status_code == 200, resp.text
    rows: list[dict[str, Any]] = resp.json()
    return rows


# --- high: one unauthenticated request broke the audit listing for good ---------------------------------------

@pytest.mark.parametrize("depth", [300, 700, 100_000])
def test_a_deeply_nested_login_is_refused_and_the_audit_stays_readable(
        app: tuple[TestClient, dict[str, str]], depth: int) -> None:
    client, tokens = app
    body = '{"username": "x", "password": "y", "pad": ' + deep(depth) + "}"
    resp = raw(client, "POST", "/api/auth/login", body.encode())
    assert resp.status_code in (413, 422)  # past 16 KB the auth routes take no body at all
    if resp.status_code == 422:
        assert "nested deeper than 64" in resp.json()["detail"][0]["msg"]
    audit_rows(client, tokens)  # still readable
    counted = client.get("/api/audit/tallies", params={"action": "auth.login"}, headers=h(tokens, "admin")).json()
    assert [(t["result"], t["count"]) for t in counted] == [(resp.status_code, 1)]  # refused: counted (issue 17)


def test_an_audit_row_written_before_records_were_bounded_is_still_listed(
        app: tuple[TestClient, dict[str, str]], data_dir: Path) -> None:
    client, tokens = app
    sql(client.app.state.services.db,  # type: ignore[attr-defined]
        "INSERT INTO audit (ts, actor, role, action, target, before, after, source, result, detail) "
        "VALUES (:ts, 'x', '', 'auth.login', '', NULL, :after, '', 401, '')",
        {"ts": time.time(), "after": json.dumps({"pad": json.loads(deep(300))})})
    rows = audit_rows(client, tokens)
    assert any(r["action"] == "auth.login" and "nested deeper" in json.dumps(r["after"]) for r in rows)
    assert client.get("/api/audit/export", params={"format": "json"}, headers=h(tokens, "admin")).status_code == 200


# --- medium: requests that left no audit row, unauthenticated audit growth -------------------------------------

def test_every_sign_in_leaves_one_small_row_or_count_whatever_it_sent(app: tuple[TestClient, dict[str, str]],
                                                                      data_dir: Path) -> None:
    """A sign-in is one small row; a failed one is counted (issue 17: refused anonymous requests are tallied)."""
    client, tokens = app
    pad = "x" * 15_000  # under the auth routes' 16 KB limit
    for password in ("wrong-password", ADMIN_PASSWORD):
        resp = client.post("/api/auth/login", json={"username": "admin", "password": password, "pad": pad})
        assert resp.status_code in (200, 401, 422)
    for _ in range(30):
        client.post("/api/auth/login", json={"username": "nobody", "password": "p", "pad": pad})
    rows = [r for r in audit_rows(client, tokens) if r["action"] == "auth.login"]
    counted = client.get("/api/audit/tallies", params={"action": "auth.login"}, headers=h(tokens, "admin")).json()
    assert [(r["actor"], r["result"]) for r in rows] == [("admin", 200)]
    assert sum(t["count"] for t in counted) == 31
    assert all(len(json.dumps(r)) < 2000 for r in rows + counted)  # what happened, not what was sent
    assert pad not in json.dumps(rows + counted)


def test_a_prompt_with_a_deep_body_is_refused_and_recorded(app: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app
    body = '{"name": "p", "prompt": "hi", "params": {"stop": ' + deep(700) + "}}"
    resp = raw(client, "POST", "/api/prompts", body.encode(), h(tokens, "prompter"))
    assert resp.status_code == 422
    assert client.get("/api/prompts", headers=h(tokens, "prompter")).json() == []
    assert any(r["action"].startswith("prompts") and r["result"] == 422 for r in audit_rows(client, tokens))


# --- medium: no body limit, 422 echoing its input ----------------------------------------------------------------

@pytest.mark.parametrize(("path", "role"), [("/api/auth/login", None), ("/api/settings", "admin"),
                                            ("/api/prompts", "prompter"), ("/api/tokens", "admin")])
def test_a_body_past_the_route_limit_is_413_and_never_read(app: tuple[TestClient, dict[str, str]], path: str,
                                                          role: str | None) -> None:
    client, tokens = app
    method = "PUT" if path == "/api/settings" else "POST"
    resp = raw(client, method, path, b'{"name": "' + b"a" * (2 << 20) + b'"}', h(tokens, role) if role else None)
    assert resp.status_code == 413 and "at most" in resp.json()["detail"]
    assert len(resp.content) < 500


def test_a_422_never_echoes_a_large_input(app: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app
    resp = client.put("/api/settings", json={"base_revision": 1, "values": {"served_model_name": "n" * 900_000}},
                      headers=h(tokens, "admin"))
    assert resp.status_code == 422 and len(resp.content) < 2000


def test_generate_refuses_an_unkeyed_caller_before_reading_its_body(app: tuple[TestClient, dict[str, str]]) -> None:
    client, _ = app
    t0 = time.monotonic()
    resp = raw(client, "POST", "/v1/generate", b'{"prompt": "' + b"a" * (30 << 20) + b'"}')
    assert resp.status_code == 401 and time.monotonic() - t0 < 30


# --- low: 500s on bad input ----------------------------------------------------------------------------------

BAD_BODIES = [b'{"x": 1e999999}', b'{"x": NaN}', b'{"x": -Infinity}', b'{"name": "\xff\xfe"}',
              b'{"name": "\\udc00"}', deep(100_000).encode()]
ROUTES = [("POST", "/api/auth/login", None), ("PUT", "/api/settings", "admin"), ("POST", "/api/prompts", "prompter"),
          ("POST", "/api/tokens", "admin"), ("POST", "/v1/generate", "prompter"),
          ("POST", "/v1/completions", "prompter")]


# every bad body on one app per route (an app each was 72 engines built for 72 requests that change nothing)
@pytest.mark.parametrize(("method", "path", "role"), ROUTES, ids=[p for _, p, _ in ROUTES])
def test_bodies_that_once_gave_500_get_a_4xx_with_the_reason(app: tuple[TestClient, dict[str, str]],
                                                            method: str, path: str, role: str | None) -> None:
    client, tokens = app
    for body in BAD_BODIES:
        resp = raw(client, method, path, body, h(tokens, role) if role else None)
        assert 400 <= resp.status_code < 500, (body[:40], resp.text)
        text = resp.text
        assert any(w in text for w in ("NaN", "Infinity", "too large", "UTF-8", "surrogate", "nested", "at most")), \
            (body[:40], text)


def test_a_model_path_part_too_long_is_a_422_not_a_500(app: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app
    for model in ("a" * 300, "/" + "b" * 300, "models/" + "c" * 400 + "/x"):
        resp = client.get("/api/capacity", params={"model": model}, headers=h(tokens, "admin"))
        assert resp.status_code == 422 and "longer than 255" in resp.text, resp.text


def test_capacity_does_not_tell_what_exists_outside_the_roots(app: tuple[TestClient, dict[str, str]],
                                                            tmp_path: Path) -> None:
    client, tokens = app
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "config.json").write_text("{}")
    there = client.get("/api/capacity", params={"model": str(tmp_path / "there")}, headers=h(tokens, "admin"))
    absent = client.get("/api/capacity", params={"model": str(tmp_path / "absent")}, headers=h(tokens, "admin"))
    assert there.status_code == absent.status_code == 422
    assert there.text.replace("there", "X") == absent.text.replace("absent", "X")


# --- low: names ----------------------------------------------------------------------------------------------

def test_a_user_name_with_a_newline_cannot_sit_beside_its_twin(app: tuple[TestClient, dict[str, str]]) -> None:
    client, tokens = app
    for name in ("admin\n", "admin\r", "-admin", "ad\x00min"):
        resp = client.post("/api/users", json={"username": name, "password": "long-enough-pw", "role": "admin"},
                           headers=h(tokens, "admin"))
        assert 400 <= resp.status_code < 500 and "username" in resp.text, (name, resp.text)
    assert [u["username"] for u in client.get("/api/users", headers=h(tokens, "admin")).json()] == ["admin"]


@pytest.mark.parametrize(("field", "value"), [("served_model_name", "demo\n"), ("served_model_name", "--x"),
                                              ("model", "org/name\n"), ("model", "--trust-remote-code")])
def test_settings_names_vllm_would_misread_are_refused(app: tuple[TestClient, dict[str, str]], field: str,
                                                      value: str) -> None:
    client, tokens = app
    resp = client.put("/api/settings", json={"base_revision": 1, "values": {field: value}},
                      headers=h(tokens, "admin"))
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"][-1] == field
    assert client.get("/api/settings", headers=h(tokens, "admin")).json()["revision"] == 1


# --- low: the benchmark's environment, the audit's REPLACE, file modes -----------------------------------------

def test_the_benchmark_gets_none_of_the_engine_secrets() -> None:
    from engine.benchmarks.runs import bench_env

    env = bench_env({"PATH": "/bin", "HOME": "/root", "LLMOPS_ADMIN_PASSWORD": "p", "LLMOPS_HF_TOKEN": "hf",
                     "LLMOPS_TOKEN": "t", "AWS_SECRET_ACCESS_KEY": "s", "HF_HOME": "/hf"})
    assert env["PATH"] == "/bin" and env["HF_HOME"] == "/hf"
    assert not any(k.startswith("LLMOPS_") or k.startswith("AWS_") for k in env)
    assert bench_env({}, hf_token="hf_x")["HF_TOKEN"] == "hf_x"  # a hub tokenizer needs it, as vLLM does


def test_insert_or_replace_cannot_overwrite_an_audit_row(app: tuple[TestClient, dict[str, str]],
                                                         data_dir: Path) -> None:
    client, tokens = app
    client.post("/api/engine/stop", headers=h(tokens, "admin"))
    db = client.app.state.services.db  # type: ignore[attr-defined]
    first = sql(db, "SELECT id, actor FROM audit ORDER BY id LIMIT 1")[0]
    # SQLite's REPLACE deletes the row without firing DELETE triggers; PostgreSQL's upsert is an UPDATE
    replace = ("INSERT OR REPLACE INTO audit (id, ts, actor, role, action, target, source, result, detail) "
               "VALUES (:id, 0, 'mallory', '', 'x', '', '', 200, '')") if dialect(db) == "sqlite" else (
               "INSERT INTO audit (id, ts, actor, role, action, target, source, result, detail) "
               "VALUES (:id, 0, 'mallory', '', 'x', '', '', 200, '') ON CONFLICT (id) DO UPDATE SET actor = 'mallory'")
    with pytest.raises(IntegrityError, match="append-only"):
        sql(db, replace, {"id": first[0]})
    assert sql(db, "SELECT actor FROM audit WHERE id = :id", {"id": first[0]}) == [(first[1],)]


def test_the_data_dir_is_the_engine_users_alone(app: tuple[TestClient, dict[str, str]], data_dir: Path) -> None:
    assert stat.S_IMODE(os.stat(data_dir).st_mode) == 0o700
    on_sqlite = client_db_is_sqlite(app)
    for path in [*([data_dir / "llmops.db"] if on_sqlite else []), *data_dir.glob("llmops.db-*"),
                 *(data_dir / "logs").iterdir()]:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path


# --- low: a full disk -------------------------------------------------------------------------------------------

def test_a_change_the_database_could_not_record_is_refused_before_it_is_made(data_dir: Path) -> None:
    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                       min_free_disk_bytes=1 << 60)  # no disk is this free: as if it were full
    app = create_app(config)
    admin = {"authorization": f"Bearer {app.state.services.auth.create_token('t', 'admin')[0]}"}
    with TestClient(app) as client:
        resp = client.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 3}}, headers=admin)
        assert resp.status_code == 507 and "nothing was done" in resp.json()["detail"]
        assert "free some space" in resp.json()["detail"]
        assert client.post("/api/engine/start", headers=admin).status_code == 507
        status = client.get("/api/status", headers=admin).json()
        assert status["desired_revision"] == 1 and status["state"] == "stopped" and not status["enabled"]


# --- low: a deleted vllm.log, slow clients, secrets in logs, user enumeration -----------------------------------

def test_a_deleted_vllm_log_is_written_again(tmp_path: Path) -> None:
    log = ChildLog(tmp_path / "vllm.log", 1_000_000, 2)
    log.write("before")
    (tmp_path / "vllm.log").unlink()
    log.write("after")
    assert (tmp_path / "vllm.log").read_text() == "after\n"
    log.close()


def test_tokens_in_logged_lines_are_redacted() -> None:
    from engine.vllm.logs import redact_secrets

    line = 'INFO: 127.0.0.1:5 - "GET /v1/models?api_key=llmops_AAAAAAAAAAAAAAAAAAAAAAAA&x=1 HTTP/1.1" 200 OK'
    assert "llmops_AAAA" not in redact_secrets(line) and "x=1" in redact_secrets(line)
    assert redact_secrets("Authorization: Bearer sk-abc") == "Authorization: Bearer [redacted]"
    assert redact_secrets("max_num_seqs=16 tokens") == "max_num_seqs=16 tokens"


def test_uvicorns_access_log_leaves_out_a_key_sent_in_the_url() -> None:
    import logging

    from engine.app import RedactSecrets

    record = logging.LogRecord("uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5", "GET", "/v1/models?token=llmops_BBBBBBBBBBBBBBBBBBBBBBBB", "1.1", 200),
                               None)
    assert RedactSecrets().filter(record) and "llmops_BBBB" not in record.getMessage()


@pytest.fixture
def served(data_dir: Path) -> Iterator[int]:
    """The engine's app behind a real uvicorn, with the engine's own HTTP protocol (header timeout 1 s)."""
    from engine.edge import edge_protocol, head_limits
    from tests.testkit.served import serving

    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD, body_timeout_s=1.0,
                       header_timeout_s=1.0)
    with serving(create_app(config), edge_protocol(head_limits(config))) as port:
        yield port


def _closed_within(sock: socket.socket, seconds: float) -> bytes:
    """What the server sent before closing the connection, or AssertionError if it is still open."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
    except TimeoutError:
        raise AssertionError(f"the connection was still open after {seconds} s (got {got[:100]!r})") from None
    return got


def test_unfinished_headers_are_timed_out(served: int) -> None:
    with socket.create_connection(("127.0.0.1", served)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and then one header line now and then
        sock.sendall(b"X-a: 1\r\n")
        _closed_within(sock, 10)


def test_a_trickling_body_is_timed_out(served: int) -> None:
    with socket.create_connection(("127.0.0.1", served)) as sock:
        sock.sendall(b"POST /api/auth/login HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"user")
        got = _closed_within(sock, 10)
        assert b" 408 " in got.split(b"\r\n", 1)[0]


def test_a_raw_dot_segment_path_is_refused_before_vllm(served: int) -> None:
    with socket.create_connection(("127.0.0.1", served)) as sock:
        sock.sendall(b"GET /v1/../metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        got = _closed_within(sock, 10)
        assert got.split(b"\r\n", 1)[0].split(b" ")[1] in (b"400", b"404"), got[:200]


def test_unknown_locked_and_real_users_cost_the_same_work_and_get_the_same_answers(data_dir: Path) -> None:
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               login_max_failures=3, login_lockout_s=60))
    auth = app.state.services.auth
    verified: list[str] = []
    original = auth._verify

    def counting(hash_: str, password: str) -> bool:
        verified.append(hash_)
        return bool(original(hash_, password))

    auth._verify = counting
    with TestClient(app) as client:
        def attempt(name: str) -> tuple[int, str]:
            r = client.post("/api/auth/login", json={"username": name, "password": "wrong-password"})
            return r.status_code, r.json()["detail"].split(":")[0]

        answers = {name: [attempt(name) for _ in range(4)] for name in ("admin", "nobody")}
    assert answers["admin"] == answers["nobody"]  # 401, 401, 401, then locked: for a user and a non-user alike
    assert answers["admin"][-1][0] == 423
    assert len(verified) == 8  # one argon2 verification per attempt, locked or not, user or not
