"""Teams, token limits per key and team, and usage you can bill (issue 34, items 1, 3 and 5), through the API and
the /v1 path of a real engine app (vLLM not started: its one instance is a stub upstream), on SQLite and
PostgreSQL: editing is audited and refused with the field named, a budget refuses with 429 naming the limit and
when it resets, it survives a restart, usage is exported as JSON and CSV, each user sees what is theirs."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.service.test_api import signed_in
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.stub_upstream import stub_upstream
from tests.testkit.wait import wait_until

PROMPT = "hello there"  # the stub answers 8 prompt tokens, and as many completion tokens as max_tokens asks


def engine_app(data_dir: Path) -> Any:
    return create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                                gateway_keys="on", gateway_workers=0))


@pytest.fixture
def upstream() -> Iterator[str]:
    with stub_upstream() as (_, url):
        yield url


def serve_from(api: TestClient, url: str) -> None:
    """The default deployment's one instance is ``url`` (vLLM is not started in this tier)."""
    admission = api.app.state.services.fleet.admission_for(None)  # type: ignore[attr-defined]
    assert api.portal is not None
    api.portal.call(admission.open, url)


def complete(api: TestClient, key: str, max_tokens: int) -> Any:
    return api.post("/v1/completions", headers={"authorization": f"Bearer {key}"},
                    json={"prompt": PROMPT, "max_tokens": max_tokens})


def audit(api: TestClient, action: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = api.get("/api/audit", params={"action": action}).json()
    return rows


def field_of(resp: Any) -> list[str]:
    assert resp.status_code == 422, resp.text
    return [str(d["loc"][-1]) for d in resp.json()["detail"]]


def test_an_admin_makes_a_team_and_keys_in_it_and_every_edit_is_audited(data_dir: Path) -> None:
    with signed_in(engine_app(data_dir)) as api:
        made = api.post("/api/teams", json={"name": "research", "weight": 2, "token_budget": 50_000,
                                            "budget_period": "day", "tokens_per_minute": 9000, "note": "batch"})
        assert made.status_code == 201, made.text
        team = made.json()
        assert team["weight"] == 2 and team["budget"]["used"] == 0 and team["budget"]["limit"] == 50_000
        key = api.post("/api/tokens", json={"name": "etl", "kind": "gateway", "role": "prompter", "team": "research",
                                            "tokens_per_minute": 4000, "token_budget": 10_000,
                                            "budget_period": "month"})
        assert key.status_code == 201, key.text
        assert key.json()["team"] == "research" and key.json()["budget"]["period"] == "month"
        key_id = key.json()["id"]
        listed = {t["name"]: t for t in api.get("/api/teams").json()}
        assert listed["research"]["keys"] == 1
        # a change of limits: only what is sent changes, null clears
        patched = api.patch(f"/api/tokens/{key_id}", json={"tokens_per_minute": None, "weight": 3})
        assert patched.status_code == 200, patched.text
        assert patched.json()["tokens_per_minute"] is None and patched.json()["weight"] == 3
        assert patched.json()["token_budget"] == 10_000
        assert api.patch("/api/teams/research", json={"weight": 0.5}).json()["weight"] == 0.5
        # a user joins the team
        api.post("/api/users", json={"username": "ana", "password": "a-long-password", "role": "viewer"})
        assert api.patch("/api/users/ana", json={"team": "research"}).json()["team"] == "research"
        assert api.get("/api/teams").json()[0]["members"] == ["ana"]
        # the audit trail has each, with what changed
        [created] = audit(api, "teams.create")
        assert created["target"] == "team research" and created["after"]["token_budget"] == 50_000
        [update] = audit(api, "tokens.update")
        assert update["before"] == {"tokens_per_minute": 4000, "weight": 1.0}
        assert update["after"] == {"tokens_per_minute": None, "weight": 3}
        [team_update] = audit(api, "teams.update")
        assert team_update["before"] == {"weight": 2.0} and team_update["after"] == {"weight": 0.5}
        # deleting the team: its key and member belong to none, the key keeps its own limits
        gone = api.delete("/api/teams/research")
        assert gone.status_code == 200
        [deleted] = audit(api, "teams.delete")
        assert deleted["after"] == {"deleted": True, "keys": 1, "users": 1}
        key_now = next(t for t in api.get("/api/tokens").json() if t["id"] == key_id)
        assert key_now["team"] is None and key_now["token_budget"] == 10_000


WRONG_TEAMS: list[tuple[dict[str, Any], str]] = [
    ({"name": "t", "token_budget": 100}, "budget_period"),
    ({"name": "t", "budget_period": "day"}, "token_budget"),
    ({"name": "t", "budget_period": "week", "token_budget": 5}, "budget_period"),
    ({"name": "t", "weight": 0}, "weight"),
    ({"name": "t", "weight": "NaN"}, "weight"),
    ({"name": "t", "tokens_per_minute": -1}, "tokens_per_minute"),
    ({"name": "t", "tokens_per_minute": 1.5}, "tokens_per_minute"),
    ({"name": "bad\nname"}, "name"),
    ({"name": "x" * 101}, "name"),
]


def test_a_team_with_a_wrong_field_is_refused_naming_it_and_nothing_is_made(data_dir: Path) -> None:
    with signed_in(engine_app(data_dir)) as api:
        for body, field in WRONG_TEAMS:
            assert field in field_of(api.post("/api/teams", json=body)), body
        assert api.get("/api/teams").json() == []


def test_wrong_edits_of_keys_and_teams_change_nothing(data_dir: Path) -> None:
    with signed_in(engine_app(data_dir)) as api:
        api.post("/api/teams", json={"name": "ops"})
        assert field_of(api.post("/api/teams", json={"name": "OPS"})) == ["name"]  # the same name, another case
        assert "team" in field_of(api.post("/api/tokens", json={"name": "k", "kind": "gateway", "team": "nobody"}))
        assert "team" in field_of(api.post("/api/tokens", json={"name": "k", "kind": "api", "team": "ops"}))
        key = api.post("/api/tokens", json={"name": "k", "kind": "gateway", "role": "prompter"}).json()
        assert api.patch(f"/api/tokens/{key['id']}", json={"team": "nobody"}).status_code == 404
        assert "budget_period" in field_of(api.patch(f"/api/tokens/{key['id']}", json={"token_budget": 5}))
        assert "weight" in field_of(api.patch(f"/api/tokens/{key['id']}", json={"weight": None}))
        assert api.patch("/api/tokens/999999", json={"weight": 2}).status_code == 404
        assert api.patch("/api/teams/nobody", json={"weight": 2}).status_code == 404
        assert "token_budget" in field_of(api.patch("/api/teams/ops", json={"budget_period": "day"}))
        unchanged = next(t for t in api.get("/api/tokens").json() if t["id"] == key["id"])
        assert unchanged["team"] is None and unchanged["token_budget"] is None and unchanged["weight"] == 1
        assert audit(api, "tokens.update") == [] or all(r["result"] >= 400 for r in audit(api, "tokens.update"))


def test_a_budget_refuses_with_429_naming_it_survives_a_restart_and_usage_is_billed(data_dir: Path,
                                                                                    upstream: str) -> None:
    with signed_in(engine_app(data_dir)) as api:
        serve_from(api, upstream)
        api.patch("/api/deployments/demo", json={"price_input_per_1k": 0.5, "price_output_per_1k": 2.0})
        made = api.post("/api/tokens", json={"name": "capped", "kind": "gateway", "role": "prompter",
                                             "token_budget": 1000, "budget_period": "day"}).json()
        key = made["token"]
        answered = []
        while (resp := complete(api, key, 100)).status_code == 200:
            answered.append(resp.json()["usage"]["total_tokens"])
            assert len(answered) < 20, "the budget never refused"
        assert resp.status_code == 429, resp.text
        error = resp.json()["error"]
        assert error["limit"] == "token_budget" and error["scope"] == "key" and error["limit_value"] == 1000
        assert error["resets_at"] % 86400 == 0 and int(resp.headers["retry-after"]) == math.ceil(
            error["resets_at"] - error["resets_at"] + error["retry_after_s"])
        used = sum(answered)
        assert used <= 1000 and error["used"] == used  # never past the budget; the refusal says what was used
        # usage you can bill: by key, with the deployment's price
        def billed() -> dict[str, Any] | None:
            rows = api.get("/api/usage", params={"group_by": "key"}).json()["rows"]
            row = next((r for r in rows if r["group"] == "capped"), None)
            return row if row and row["requests"] == len(answered) + 1 else None
        row = wait_until(billed, 10, what="the ledger's usage of the key")
        assert row["input_tokens"] + row["output_tokens"] == used and row["failed"] == 1
        assert row["cost"] == pytest.approx(row["input_tokens"] / 1000 * 0.5 + row["output_tokens"] / 1000 * 2.0)
        exported = api.get("/api/usage", params={"group_by": "deployment", "format": "csv"})
        assert exported.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(exported.text)))
        assert table[0]["deployment"] == "demo" and int(table[0]["output_tokens"]) == row["output_tokens"]
        assert table[-1]["deployment"] == "total"
        # by the model the requests named (a deployment's, or a LoRA adapter's): these named none
        by_model = api.get("/api/usage", params={"group_by": "model"}).json()
        assert [(r["group"], r["requests"]) for r in by_model["rows"]] == [("(none)", len(answered) + 1)]
        listed = next(t for t in api.get("/api/tokens").json() if t["name"] == "capped")
        assert listed["budget"]["used"] == used and listed["budget"]["reserved"] == 0
        metrics = api.get("/metrics").text
        assert 'llmops_limit_refusals_total{limit="token_budget",team="none"} 1.0' in metrics
    # a restart: what was used is read back from the store, and the key is still refused
    with signed_in(engine_app(data_dir)) as api:
        serve_from(api, upstream)
        again = complete(api, key, 100)
        assert again.status_code == 429 and again.json()["error"]["used"] == used
        # an admin raises the budget: in effect for the next request
        assert api.patch(f"/api/tokens/{made['id']}", json={"token_budget": 5000}).status_code == 200
        assert complete(api, key, 100).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_the_responses_api_and_anthropic_messages_are_metered_against_a_budget_like_completions(
        data_dir: Path, upstream: str, stream: bool) -> None:
    """vLLM serves OpenAI's Responses API and Anthropic's Messages too: they were passed on unmetered, so a key with
    a token budget (or tokens per minute) used them without limit and they showed no tokens in its usage. Now
    their usage (in the answer, or in the stream's response.completed / message_delta events) is counted, and
    they are refused with 429 once the budget is used, as completions are."""
    with signed_in(engine_app(data_dir)) as api:
        serve_from(api, upstream)
        made = api.post("/api/tokens", json={"name": "agents", "kind": "gateway", "role": "prompter",
                                             "token_budget": 1000, "budget_period": "day"}).json()
        key = {"authorization": f"Bearer {made['token']}"}
        asks = [("/v1/responses", {"input": PROMPT, "max_output_tokens": 100}),
                ("/v1/messages", {"model": "demo", "max_tokens": 100,
                                  "messages": [{"role": "user", "content": PROMPT}]})]
        used, statuses = 0, []
        for i in range(20):
            path, body = asks[i % 2]
            resp = api.post(path, headers=key, json={**body, "stream": stream})
            statuses.append(resp.status_code)
            if resp.status_code != 200:
                break
            if stream:
                assert resp.text.count("event: ") > 100  # relayed whole: every named event
            used += 8 + 100  # the stub's 8 prompt tokens (Anthropic's: 6 and 2 from the cache) and 100 out
        assert statuses[-1] == 429, statuses  # the budget refused: they are metered
        assert resp.json()["error"]["limit"] == "token_budget" and resp.json()["error"]["used"] == used
        assert used <= 1000 and statuses[:-1] == [200] * (len(statuses) - 1)

        def billed() -> dict[str, Any] | None:
            rows = api.get("/api/usage", params={"group_by": "key"}).json()["rows"]
            row = next((r for r in rows if r["group"] == "agents"), None)
            return row if row and row["requests"] == len(statuses) else None
        row = wait_until(billed, 10, what="the ledger's usage of the key")
        assert (row["input_tokens"], row["output_tokens"]) == (8 * (len(statuses) - 1), 100 * (len(statuses) - 1))


@pytest.mark.parametrize(("path", "body"), [("/v1/embeddings", {"input": PROMPT}),
                                            ("/v1/score", {"text_1": "a", "text_2": PROMPT}),
                                            ("/v1/rerank", {"query": "a", "documents": [PROMPT]})])
def test_embeddings_scores_and_reranks_count_their_inputs_against_a_budget(data_dir: Path, upstream: str, path: str,
                                                                           body: dict[str, Any]) -> None:
    """Embeddings, scores and reranks were passed on unmetered: their inputs now count (vLLM's usage), and they
    reserve no completion tokens (a budget does not refuse them for 1,024 tokens they will never generate)."""
    with signed_in(engine_app(data_dir)) as api:
        serve_from(api, upstream)
        made = api.post("/api/tokens", json={"name": "search", "kind": "gateway", "role": "prompter",
                                             "token_budget": 200, "budget_period": "day"}).json()
        key = {"authorization": f"Bearer {made['token']}"}
        statuses: list[int] = []
        while len(statuses) < 60:
            statuses.append(api.post(path, headers=key, json=body).status_code)
            if statuses[-1] != 200:
                break
        assert statuses[-1] == 429 and len(statuses) > 10, statuses  # 8 tokens each, not 1,024 reserved
        refusal = api.post(path, headers=key, json=body).json()["error"]
        assert refusal["limit"] == "token_budget" and refusal["used"] == 8 * (len(statuses) - 1)


def test_tokens_per_minute_of_a_team_hold_for_its_keys_together(data_dir: Path, upstream: str) -> None:
    with signed_in(engine_app(data_dir)) as api:
        serve_from(api, upstream)
        api.post("/api/teams", json={"name": "web", "tokens_per_minute": 600})
        keys = [api.post("/api/tokens", json={"name": f"k{i}", "kind": "gateway", "role": "prompter",
                                              "team": "web"}).json()["token"] for i in range(2)]
        assert complete(api, keys[0], 200).status_code == 200
        refused = complete(api, keys[1], 400)  # 208 used of 600, and this one may use 400 and its prompt
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["scope"] == "team" and refused.json()["error"]["limit"] == "tokens_per_minute"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-limit-tokens"] == "600"
        assert complete(api, keys[1], 100).status_code == 200
        def team_series() -> str | None:
            text: str = api.get("/metrics").text
            return text if 'team="web"' in text else None
        metrics = wait_until(team_series, 10, what="the team's series in /metrics")
        assert 'llmops_team_tokens_total{kind="output",team="web"} 300.0' in metrics


def test_operators_see_everyone_s_usage_and_a_key_s_owner_only_their_own(data_dir: Path, upstream: str) -> None:
    with signed_in(engine_app(data_dir)) as api:
        serve_from(api, upstream)
        api.post("/api/users", json={"username": "ana", "password": "a-long-password", "role": "viewer"})
        mine = api.post("/api/tokens", json={"name": "anas-key", "kind": "gateway", "role": "prompter",
                                             "owner": "ana"}).json()
        other = api.post("/api/tokens", json={"name": "someone-else", "kind": "gateway", "role": "prompter"}).json()
        assert mine["owner"] == "ana"
        for key in (mine["token"], other["token"]):
            assert complete(api, key, 5).status_code == 200
        wait_until(lambda: len(api.get("/api/usage").json()["rows"]) == 2, 10, what="both keys' usage")
        login = api.post("/api/auth/login", json={"username": "ana", "password": "a-long-password"})
        session = {"authorization": f"Bearer {login.json()['token']}"}
        own = api.get("/api/usage", headers=session).json()
        assert own["scope"] == "own" and [r["group"] for r in own["rows"]] == ["anas-key"]
        assert api.get("/api/usage", headers=session, params={"group_by": "day"}).json()["total"]["requests"] == 1
        assert api.get("/api/usage").json()["scope"] == "all"
        # bad windows are refused, naming the field
        assert field_of(api.get("/api/usage", params={"since": "2026-13-01"})) == ["since"]
        assert field_of(api.get("/api/usage", params={"since": "2026-12-05", "until": "2026-12-01"})) == ["since"]
        assert api.get("/api/usage", params={"group_by": "nothing"}).status_code == 422
