"""Single sign-on's session minting, as an outside probe found it (issue 31): any admin credential could mint any
user's session (another admin's too) past a lockout, and what it minted outlived it. Now only the console's single
sign-on credential (a token of kind sso, a viewer that does nothing else) opens sessions; a locked-out or disabled
user gets none; the session names the credential and ends when it is revoked; the audit names who minted it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from console.identity import sso_username
from engine.app import create_app
from engine.config import AppConfig
from tests.service.test_api import signed_in
from tests.testkit.engine import ADMIN_PASSWORD


@pytest.fixture
def api(data_dir: Path) -> Iterator[TestClient]:
    with signed_in(create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))) as c:
        assert c.post("/api/users", json={"username": "ana@example.com", "password": "ana-password-1",
                                          "role": "operator"}).status_code == 201
        yield c


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def sso_credential(api: TestClient) -> dict[str, str]:
    made = api.post("/api/tokens", json={"name": "console-sso", "role": "viewer", "kind": "sso"})
    assert made.status_code == 201, made.text
    return bearer(made.json()["token"])


def test_only_the_single_sign_on_credential_opens_sessions(api: TestClient) -> None:
    minted = api.post("/api/auth/sso", json={"username": "admin"})  # an admin's own token: not its to mint
    assert minted.status_code == 403 and "kind sso" in minted.text
    sso = sso_credential(api)
    session = api.post("/api/auth/sso", json={"username": "ana@example.com"}, headers=sso)
    assert session.status_code == 200, session.text
    me = api.get("/api/auth/me", headers=bearer(session.json()["token"])).json()
    assert (me["name"], me["role"]) == ("ana@example.com", "operator")
    # the credential does nothing else
    assert api.get("/api/status", headers=sso).status_code == 403
    assert api.post("/api/tokens", json={"name": "x", "role": "admin"}, headers=sso).status_code == 403
    # it is a viewer, whatever was asked
    assert api.post("/api/tokens", json={"name": "sso2", "role": "admin", "kind": "sso"}).status_code == 422
    rows = [r for r in api.get("/api/audit", params={"action": "auth"}).json() if r["action"] == "auth.sso"]
    assert rows[0]["actor"] == "console-sso" and rows[0]["target"] == "user ana@example.com"  # who minted it


def test_a_locked_out_or_disabled_user_gets_no_session(api: TestClient) -> None:
    sso = sso_credential(api)
    for _ in range(5):
        api.post("/api/auth/login", json={"username": "ana@example.com", "password": "wrong-password"})
    locked = api.post("/api/auth/sso", json={"username": "ana@example.com"}, headers=sso)
    assert locked.status_code == 423, locked.text
    assert api.patch("/api/users/ana@example.com", json={"disabled": True}).status_code == 200
    disabled = api.post("/api/auth/sso", json={"username": "ana@example.com"}, headers=sso)
    assert disabled.status_code in (404, 423), disabled.text
    assert api.post("/api/auth/sso", json={"username": "nobody"}, headers=sso).status_code == 404


def test_revoking_the_credential_ends_the_sessions_it_opened(api: TestClient) -> None:
    made = api.post("/api/tokens", json={"name": "console-sso", "role": "viewer", "kind": "sso"}).json()
    session = api.post("/api/auth/sso", json={"username": "ana@example.com"}, headers=bearer(made["token"])).json()
    assert api.get("/api/status", headers=bearer(session["token"])).status_code == 200
    assert api.delete(f"/api/tokens/{made['id']}").status_code == 200
    assert api.get("/api/status", headers=bearer(session["token"])).status_code == 401


def test_the_console_names_a_user_by_a_verified_email_only() -> None:
    assert sso_username({"email": "ana@example.com", "email_verified": True}) == "ana@example.com"
    refused: list[dict[str, object]] = [{"email": "admin@example.com"},
                                        {"email": "admin@example.com", "email_verified": False},
                                        {"email": "admin@example.com", "email_verified": "true"},
                                        {"preferred_username": "admin"}, {}]
    for claims in refused:
        assert sso_username(claims) is None, claims


def test_a_token_made_by_a_credential_named_like_the_sso_mark_works(api: TestClient) -> None:
    """The mark of a single sign-on session (created_by sso:<id>) is read on sessions only: a token made by a
    credential whose name looks like it neither answers 500 nor lives and dies with another token."""
    for name in ("sso:x", "sso:1", "sso:99999999999999999999"):
        maker = api.post("/api/tokens", json={"name": name, "role": "admin"}).json()["token"]
        made = api.post("/api/tokens", json={"name": f"made by {name}", "role": "viewer"}, headers=bearer(maker))
        assert made.status_code == 201, made.text
        assert api.get("/api/status", headers=bearer(made.json()["token"])).status_code == 200
