"""Saved prompts as a team shares them: each shows its author, only the author or an operator may delete one
(enforced by the engine), a prompt is bounded in size and a user in how many they keep, and the list comes a page
at a time. A real engine app on a real SQLite file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.testkit.engine import ADMIN_PASSWORD

Headers = dict[str, str]


@pytest.fixture
def team(data_dir: Path) -> Iterator[tuple[TestClient, dict[str, Headers]]]:
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               prompts_per_user=3, prompt_max_chars=2000))
    auth = app.state.services.auth
    people = {name: {"authorization": f"Bearer {auth.create_token(name, role)[0]}"}
              for name, role in (("ana", "prompter"), ("bo", "prompter"), ("olga", "operator"))}
    with TestClient(app) as client:
        yield client, people


def save(client: TestClient, who: Headers, name: str, prompt: str = "Describe the module.") -> int:
    resp = client.post("/api/prompts", json={"name": name, "prompt": prompt}, headers=who)
    assert resp.status_code == 201, resp.text
    return int(resp.json()["id"])


def test_only_the_author_or_an_operator_deletes_a_saved_prompt(team: tuple[TestClient, dict[str, Headers]]) -> None:
    client, people = team
    mine = save(client, people["ana"], "ana's prompt")
    listed = client.get("/api/prompts", headers=people["bo"]).json()
    assert [(p["name"], p["author"]) for p in listed] == [("ana's prompt", "ana")]  # the author is shown
    refused = client.delete(f"/api/prompts/{mine}", headers=people["bo"])
    assert refused.status_code == 403 and "ana" in refused.json()["detail"]
    assert len(client.get("/api/prompts", headers=people["bo"]).json()) == 1  # nothing deleted
    assert client.delete(f"/api/prompts/{mine}", headers=people["ana"]).status_code == 204
    other = save(client, people["bo"], "bo's prompt")
    assert client.delete(f"/api/prompts/{other}", headers=people["olga"]).status_code == 204  # an operator may
    assert client.get("/api/prompts", headers=people["ana"]).json() == []


def test_a_saved_prompt_is_bounded_in_size_and_a_user_in_how_many(team: tuple[TestClient, dict[str, Headers]]
                                                                  ) -> None:
    client, people = team
    big = client.post("/api/prompts", json={"name": "huge", "prompt": "x" * 2001}, headers=people["ana"])
    assert big.status_code == 422 and big.json()["detail"][0]["loc"][-1] == "prompt"
    assert "2,001 characters" in big.json()["detail"][0]["msg"]
    for i in range(3):
        save(client, people["ana"], f"p{i}")
    full = client.post("/api/prompts", json={"name": "p3", "prompt": "one more"}, headers=people["ana"])
    assert full.status_code == 409 and "delete one" in full.json()["detail"]
    save(client, people["bo"], "bo's")  # the bound is per user
    assert len(client.get("/api/prompts", headers=people["ana"]).json()) == 4


def test_the_list_comes_a_page_at_a_time_newest_first(team: tuple[TestClient, dict[str, Headers]]) -> None:
    client, people = team
    ids = [save(client, people[who], f"{who}{i}") for i in range(3) for who in ("ana", "bo")]
    first = client.get("/api/prompts", params={"limit": 4}, headers=people["ana"]).json()
    assert [p["id"] for p in first] == sorted(ids, reverse=True)[:4]
    rest = client.get("/api/prompts", params={"limit": 4, "before": first[-1]["id"]}, headers=people["ana"]).json()
    assert [p["id"] for p in rest] == sorted(ids, reverse=True)[4:]
    assert client.get("/api/prompts", params={"limit": 101}, headers=people["ana"]).status_code == 422
