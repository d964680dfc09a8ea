"""A gateway key limited to some deployments reaches those and nothing else, on every /v1 route there is — the data
path's (forwarded to vLLM) and the engine's own (FastAPI's, /v1/generate) — walked from the app itself, so a route
added later is walked too. The default deployment was reachable through /v1/generate by any key (issue 31)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from engine.api.deps import route_meta
from engine.app import create_app
from engine.config import AppConfig
from engine.gateway import ROUTES
from tests.service.test_api import signed_in
from tests.testkit.engine import ADMIN_PASSWORD

pytestmark = pytest.mark.one_database  # a key's scope on every /v1 route: the store plays no part


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, dict[str, str], dict[str, str]]]:
    """An engine (vLLM not started) with a second deployment, a key limited to it and a key for every one."""
    data_dir = tmp_path_factory.mktemp("scope")
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               gateway_keys="on"))
    with signed_in(app) as api:
        made = api.post("/api/deployments", json={"name": "small", "values": {"model": "models/demo"},
                                                  "note": "a second model"})
        assert made.status_code == 201, made.text

        def key(**limits: object) -> dict[str, str]:
            resp = api.post("/api/tokens", json={"name": f"k{len(limits)}", "role": "viewer", "kind": "gateway",
                                                 **limits})
            assert resp.status_code == 201, resp.text
            return {"authorization": f"Bearer {resp.json()['token']}"}

        yield api, key(deployments=["small"]), key()


def every_v1_route(api: TestClient) -> list[tuple[str, str]]:
    """(method, path) of every /v1 route a client can call: the data path's and FastAPI's own."""
    own = [(m, r.path) for r in api.app.routes if isinstance(r, APIRoute)  # type: ignore[attr-defined]
           if r.path.startswith("/v1/") for m in sorted(r.methods or ())]
    return [(m, p.replace("{id}", "resp_1")) for m, p in ROUTES] + own


def test_every_route_of_the_engine_s_own_under_v1_declares_the_deployment_it_sends_to(
        keyed: tuple[TestClient, dict[str, str], dict[str, str]]) -> None:
    api, _, _ = keyed
    own = [r for r in api.app.routes if isinstance(r, APIRoute) and r.path.startswith("/v1/")]  # type: ignore[attr-defined]
    assert own, "no FastAPI route under /v1: the walk below would prove nothing of them"
    assert [r.path for r in own if not route_meta(r).scoped] == []


@pytest.mark.parametrize("model", ["demo", None])
def test_a_key_limited_to_one_deployment_reaches_no_other_on_any_v1_route(
        keyed: tuple[TestClient, dict[str, str], dict[str, str]], model: str | None) -> None:
    api, limited, everywhere = keyed
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "input": "x", "query": "x",
            **({"model": model} if model else {})}
    leaks = []
    for method, path in every_v1_route(api):
        if path == "/v1/models":
            listed = api.get(path, headers=limited)
            assert listed.status_code == 200 and all(m["id"] == "small" for m in listed.json()["data"])
            continue
        sent = body if method == "POST" else None
        resp = api.request(method, path, headers=limited, json=sent)
        if not (resp.status_code == 404 and "model_not_found" in resp.text):
            leaks.append((method, path, resp.status_code, resp.text[:120]))
        # the same request with a key for every deployment gets past the scope (vLLM is not running: 503)
        other = api.request(method, path, headers=everywhere, json=sent)
        assert other.status_code != 404, (method, path, other.text[:200])
    assert leaks == []


def test_the_limited_key_still_reaches_its_own_deployment(
        keyed: tuple[TestClient, dict[str, str], dict[str, str]]) -> None:
    api, limited, _ = keyed
    mine = api.post("/v1/completions", json={"model": "small", "prompt": "x"}, headers=limited)
    assert mine.status_code == 503 and "stopped" in mine.text  # past the key: the deployment is stopped
