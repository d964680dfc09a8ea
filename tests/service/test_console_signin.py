"""The console server's sign-in and sign-out (console/server.py) against a real engine behind uvicorn: the findings
of issue 17 about them. The console's routes run in Starlette's test client, as the browser's requests reach them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from console import drafts, server
from console.session import COOKIE
from engine.app import create_app
from engine.client import EngineClient, UnauthorizedError
from engine.config import AppConfig
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.served import serve

CONSOLE = "http://console.test"
SAME_SITE = {"origin": CONSOLE}
FORM = {"username": "admin", "password": ADMIN_PASSWORD, "next": "/"}


@pytest.fixture
def engine_url(data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """The engine served on a free port; the console is pointed at it and handed its console key, as `llmops up`
    does. Yields (the engine's URL, an admin token)."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))
    admin = app.state.services.auth.create_token("root", "admin")[0]
    with serve(app) as url:
        monkeypatch.setenv("LLMOPS_ENGINE_URL", url)
        monkeypatch.setenv("LLMOPS_CONSOLE_KEY_FILE", str(data_dir / "run" / "console.key"))
        yield url, admin


def console(address: str = "198.51.100.20") -> TestClient:
    return TestClient(Starlette(routes=server.ROUTES), base_url=CONSOLE, raise_server_exceptions=False,
                      follow_redirects=False, client=(address, 40000))


def sign_ins(engine: tuple[str, str]) -> list[Any]:
    with EngineClient(engine[0], token=engine[1]) as root:
        return [r for r in root.audit(action="auth.login")]


def test_a_sign_in_form_with_too_many_fields_is_a_page_not_a_500(engine_url: tuple[str, str]) -> None:
    body = "&".join(f"f{i}=x" for i in range(9)) + "&username=admin&password=x"
    resp = console().post("/signin", content=body, headers={**SAME_SITE, "content-type":
                                                              "application/x-www-form-urlencoded"})
    assert resp.status_code == 400 and "more fields than it has" in resp.text
    assert "Sign in" in resp.text  # the sign-in page again, with the reason


@pytest.mark.parametrize("headers", [{"origin": "https://evil.example"}, {"origin": "null"},
                                     {"referer": "https://evil.example/login.html"},
                                     {"sec-fetch-site": "cross-site", "origin": CONSOLE}, {}],
                         ids=["origin", "null-origin", "referer", "fetch-site", "neither"])
def test_a_sign_in_posted_from_another_site_is_refused(engine_url: tuple[str, str], headers: dict[str, str]) -> None:
    """Login CSRF: another site's form must not sign this browser in as the attacker's user."""
    resp = console().post("/signin", data=FORM, headers=headers)
    assert resp.status_code == 403 and "another site cannot sign you in" in resp.text
    assert COOKIE not in resp.cookies
    assert sign_ins(engine_url) == []  # the engine was never asked


def test_a_sign_in_from_the_console_page_works_and_the_audit_shows_the_browsers_address(
        engine_url: tuple[str, str]) -> None:
    resp = console("198.51.100.20").post("/signin", data=FORM, headers={"referer": f"{CONSOLE}/signin?next=%2F"})
    assert resp.status_code == 303 and (resp.cookies.get(COOKIE) or "").startswith("llmops_")
    assert [(r.actor, r.source) for r in sign_ins(engine_url)] == [("admin", "198.51.100.20")]


def test_only_the_console_can_tell_the_engine_a_browsers_address(engine_url: tuple[str, str]) -> None:
    url, _ = engine_url
    forged = {"x-llmops-client": "203.0.113.66", "x-llmops-console-key": "a guess"}
    with EngineClient(url, headers=forged) as anyone:
        anyone.login("admin", ADMIN_PASSWORD)
    assert [r.source for r in sign_ins(engine_url)] == ["127.0.0.1"]


def test_opening_the_sign_in_page_ends_the_old_session_at_the_engine(engine_url: tuple[str, str]) -> None:
    client = console()
    token = client.post("/signin", data=FORM, headers=SAME_SITE).cookies[COOKIE]
    client.cookies.set(COOKIE, token)
    page = client.get("/signin")
    assert page.status_code == 200 and f'{COOKIE}=""' in page.headers["set-cookie"]
    with EngineClient(engine_url[0], token=token) as old, pytest.raises(UnauthorizedError):
        old.me()


def test_posting_the_sign_in_form_ends_the_session_the_browser_held(engine_url: tuple[str, str]) -> None:
    """POST /signin kept the session cookie the browser already held (issue 31): after a failed sign-in the
    previous user stayed signed in in that browser, and after a new one the old session lived on at the engine."""
    client = console()
    first = client.post("/signin", data=FORM, headers=SAME_SITE).cookies[COOKIE]
    client.cookies.set(COOKIE, first)
    failed = client.post("/signin", data={**FORM, "password": "wrong-password"}, headers=SAME_SITE)
    assert failed.status_code == 401 and f'{COOKIE}=""' in failed.headers["set-cookie"]
    with EngineClient(engine_url[0], token=first) as old, pytest.raises(UnauthorizedError):
        old.me()
    client.cookies.clear()
    second = client.post("/signin", data=FORM, headers=SAME_SITE).cookies[COOKIE]
    client.cookies.set(COOKIE, second)
    third = client.post("/signin", data=FORM, headers=SAME_SITE)
    assert third.status_code == 303 and third.cookies[COOKIE] not in ("", second)
    with EngineClient(engine_url[0], token=second) as old, pytest.raises(UnauthorizedError):
        old.me()
    with EngineClient(engine_url[0], token=third.cookies[COOKIE]) as new:
        assert new.me().name == "admin"


def test_sign_out_takes_post_only_from_the_console_and_ends_the_session(engine_url: tuple[str, str]) -> None:
    client = console()
    token = client.post("/signin", data=FORM, headers=SAME_SITE).cookies[COOKIE]
    client.cookies.set(COOKIE, token)
    assert client.get("/signout").status_code == 405  # a link or an image elsewhere cannot sign anyone out
    assert client.post("/signout", headers={"origin": "https://evil.example"}).status_code == 403
    with EngineClient(engine_url[0], token=token) as session:
        assert session.me().name == "admin"  # still signed in
    key = drafts.session_key(token)
    assert key is not None
    drafts.STORE.put(key, "playground", {"prompt": "a draft of the signed-in user"})
    out = client.post("/signout", headers=SAME_SITE)
    assert out.status_code == 303 and out.headers["location"] == "/signin?why=out"
    with EngineClient(engine_url[0], token=token) as session, pytest.raises(UnauthorizedError):
        session.me()
    assert drafts.STORE.get(key, "playground") == {}  # the next user of this browser does not find it
