"""Deployments through the control API on a real SQLite file, vLLM not started (autostart off): create one beside
the default, its own revisions and routes, today's routes still on the default, the gateway routing by model,
enable/disable, deletion with its confirmation, and the audit naming the deployment."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.service.test_api import signed_in
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.wait import wait_until


@pytest.fixture
def api(data_dir: Path) -> Iterator[TestClient]:
    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD)
    with signed_in(create_app(config)) as client:
        yield client


def refused(api: TestClient, model: str, why: str) -> Any:
    """A /v1 request for ``model``, when it is refused with 503 saying ``why``."""
    resp = api.post("/v1/completions", json={"model": model, "prompt": "x"})
    return resp if resp.status_code == 503 and why in resp.text else None


def create(api: TestClient, name: str = "small", **values: object) -> Any:
    return api.post("/api/deployments", json={"name": name, "values": {"model": "models/demo", **values},
                                              "note": "a second model"})


def test_a_data_dir_has_its_default_deployment(api: TestClient) -> None:
    rows = api.get("/api/deployments").json()
    assert [(r["id"], r["name"], r["default"], r["enabled"]) for r in rows] == [(1, "demo", True, True)]
    assert rows[0]["desired_revision"] == 1 and rows[0]["model"].endswith("models/demo")
    assert api.get("/api/status").json()["deployment"] == "demo"


def test_a_second_deployment_has_its_own_revisions_and_routes(api: TestClient) -> None:
    made = create(api, max_num_seqs=4)
    assert made.status_code == 201, made.text
    body = made.json()
    assert body["name"] == "small" and body["default"] is False and body["state"] == "stopped"
    first = body["revision"]
    own = api.get("/api/deployments/small/settings").json()
    assert own["revision"] == first and own["values"]["max_num_seqs"] == 4
    assert own["values"]["served_model_name"] == "small"  # the name clients send is vLLM's served name
    # a write on it is its own history; today's routes stay on the default deployment
    resp = api.put("/api/deployments/small/settings", json={"base_revision": first, "values": {"max_num_seqs": 2}})
    assert resp.status_code == 201, resp.text
    assert [r["revision"] for r in api.get("/api/deployments/small/settings/history").json()] == [
        resp.json()["revision"], first]
    assert [r["revision"] for r in api.get("/api/settings/history").json()] == [1]
    assert api.get("/api/settings").json()["values"]["max_num_seqs"] == 16
    # by id as well as by name (a name with a / in it is one path segment only as its id)
    assert api.get(f"/api/deployments/{body['id']}/status").json()["deployment"] == "small"
    assert api.get(f"/api/deployments/{body['id']}/settings/{first}").status_code == 200
    assert api.get(f"/api/settings/{first}").status_code == 404  # another deployment's revision
    # its status is its own, waiting for an operator (autostart is off)
    status = wait_until(lambda: api.get("/api/deployments/small/status").json(), 60, what="its status")
    assert (status["deployment"], status["state"], status["desired_revision"]) == (
        "small", "stopped", resp.json()["revision"])


def test_bad_deployments_are_refused_naming_why(api: TestClient) -> None:
    assert create(api).status_code == 201
    assert create(api).status_code == 409  # the name is taken
    assert create(api, name="demo").status_code == 409
    bad = api.post("/api/deployments", json={"name": "bad name!", "values": {"model": "models/demo"}})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"][-1] == "name"
    digits = api.post("/api/deployments", json={"name": "12", "values": {"model": "models/demo"}})
    assert digits.status_code == 422 and "digits" in str(digits.json())
    no_model = api.post("/api/deployments", json={"name": "x", "values": {}})
    assert no_model.status_code == 422 and no_model.json()["detail"][0]["loc"][-1] == "model"
    escape = api.post("/api/deployments", json={"name": "x", "values": {"model": "../../etc"}})
    assert escape.status_code == 422 and escape.json()["detail"][0]["loc"][-1] == "model"
    gpus = api.post("/api/deployments", json={"name": "x", "values": {"model": "models/demo"}, "gpus": [0]})
    assert gpus.status_code == 422 and gpus.json()["detail"][0]["loc"] == ["body", "gpus"]  # the CPU build
    assert api.get("/api/deployments/nope/status").status_code == 404
    assert "nope" in api.get("/api/deployments/nope/settings").json()["detail"]
    assert [r["name"] for r in api.get("/api/deployments").json()] == ["demo", "small"]


def test_the_gateway_routes_by_model(api: TestClient) -> None:
    assert create(api).status_code == 201
    unknown = api.post("/v1/completions", json={"model": "gpt-17", "prompt": "x"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found" and "gpt-17" in unknown.json()["error"]["message"]
    # a deployment that is there but stopped answers as stopped, at once (not queued)
    stopped = wait_until(lambda: refused(api, "small", "stopped"), 60, what="the stopped deployment's refusal")
    assert stopped.headers["retry-after"]
    models = api.get("/v1/models").json()
    assert models == {"object": "list", "data": []}  # nothing serves


def test_disable_enable_and_delete_with_its_confirmation(api: TestClient) -> None:
    assert create(api).status_code == 201
    off = api.patch("/api/deployments/small", json={"enabled": False})
    assert off.status_code == 200 and off.json()["enabled"] is False
    disabled = wait_until(lambda: refused(api, "small", "disabled"), 60, what="the disabled refusal")
    assert "PATCH /api/deployments/small" in disabled.json()["error"]["message"]
    assert api.patch("/api/deployments/small", json={"enabled": True}).json()["enabled"] is True
    what = api.get("/api/deployments/small/deletion").json()
    assert what["name"] == "small" and what["revisions"] == 1
    unconfirmed = api.delete("/api/deployments/small", params={"confirm": "smal"})
    assert unconfirmed.status_code == 422 and "repeat the name" in str(unconfirmed.json())
    assert api.get("/api/deployments/small").status_code == 200  # nothing deleted
    gone = api.delete("/api/deployments/small", params={"confirm": "small"})
    assert gone.status_code == 200 and gone.json()["revisions"] == 1
    # its row is gone at once; its runtime (the list, its routes) once its instances have stopped
    wait_until(lambda: api.get("/api/deployments/small/status").status_code == 404, 60, what="its runtime gone")
    assert [r["name"] for r in api.get("/api/deployments").json()] == ["demo"]
    default = api.delete("/api/deployments/demo", params={"confirm": "demo"})
    assert default.status_code == 409 and "disable it instead" in default.json()["detail"]
    actions = {(r["action"], r.get("deployment")) for r in api.get("/api/audit", params={"limit": 50}).json()}
    assert {("deployments.create", "small"), ("deployments.update", "small"),
            ("deployments.delete", "small")} <= actions


def test_the_audit_names_the_deployment_a_change_was_made_on(api: TestClient) -> None:
    assert create(api).status_code == 201
    base = api.get("/api/deployments/small/settings").json()["revision"]
    assert api.put("/api/deployments/small/settings",
                   json={"base_revision": base, "values": {"max_num_seqs": 3}}).status_code == 201
    assert api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 5}}).status_code == 201
    rows = [r for r in api.get("/api/audit", params={"action": "settings.write"}).json()]
    assert [r["deployment"] for r in rows] == ["demo", "small"]


def test_models_to_create_a_deployment_from(api: TestClient) -> None:
    listed = api.get("/api/models").json()
    demo = [m for m in listed["models"] if m["value"].endswith("models/demo")]
    assert demo and demo[0]["source"] == "local" and demo[0]["used_by"] == ["demo"]


def test_a_gateway_key_limited_to_deployments_reaches_those_only(data_dir: Path) -> None:
    """A key made for one team's model: the other deployments do not exist for it (OpenAI's 404), /v1/models lists
    its own only, and a limit that names nothing real is refused with the field named."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD, gateway_keys="on"))
    with signed_in(app) as api:
        assert create(api).status_code == 201
        made = api.post("/api/tokens", json={"name": "team-small", "role": "viewer", "kind": "gateway",
                                             "deployments": ["small"]})
        assert made.status_code == 201 and made.json()["deployments"] == ["small"]
        key = {"authorization": f"Bearer {made.json()['token']}"}
        everywhere = {"authorization": "Bearer " + api.post("/api/tokens", json={
            "name": "all", "role": "viewer", "kind": "gateway"}).json()["token"]}
        for model in ("demo", None):  # the default deployment, by name or by sending no model
            body = {"prompt": "x", **({"model": model} if model else {})}
            resp = api.post("/v1/completions", json=body, headers=key)
            assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found", resp.text
            assert api.post("/v1/completions", json=body, headers=everywhere).status_code == 503  # vLLM is down
        mine = api.post("/v1/completions", json={"model": "small", "prompt": "x"}, headers=key)
        assert mine.status_code == 503 and "stopped" in mine.text  # past the key: the deployment is stopped
        app.data_path.models = lambda: [  # type: ignore[attr-defined]  # (EngineApp's): as if both served
            {"id": "demo", "object": "model", "deployment": "demo"},
            {"id": "small", "object": "model", "deployment": "small"}]
        assert [m["id"] for m in api.get("/v1/models", headers=key).json()["data"]] == ["small"]
        assert [m["id"] for m in api.get("/v1/models", headers=everywhere).json()["data"]] == ["demo", "small"]
        assert "deployment" not in api.get("/v1/models", headers=everywhere).json()["data"][0]
        for bad, why in (({"deployments": ["nope"]}, "no deployment named nope"),
                         ({"deployments": []}, "deployments"),
                         ({"kind": "api", "deployments": ["small"]}, "only a gateway key")):
            resp = api.post("/api/tokens", json={"name": "x", "role": "viewer", "kind": "gateway", **bad})
            assert resp.status_code == 422 and why in resp.text, resp.text
        assert [t["name"] for t in api.get("/api/tokens").json()].count("x") == 0


def test_ids_are_never_reused_after_a_deployment_is_deleted(api: TestClient) -> None:
    """Deleting a deployment gave its deployment id, its revision numbers (and so its log and the audit's "what
    happened next") to the next one made: SQLite reuses the largest id of a table unless told not to (issue 31)."""
    assert create(api).status_code == 201
    base = api.get("/api/deployments/small/settings").json()["revision"]
    second = api.put("/api/deployments/small/settings", json={"base_revision": base, "values": {"max_num_seqs": 2}})
    assert second.status_code == 201, second.text
    small_id = next(d["id"] for d in api.get("/api/deployments").json() if d["name"] == "small")
    given = {base, second.json()["revision"]}
    engine_wide = {e["id"] for e in api.get("/api/events", params={"limit": 500}).json()}  # listed for every one
    events_before = {e["id"] for e in api.get("/api/deployments/small/events", params={"limit": 500}).json()}
    events_before -= engine_wide
    assert events_before  # the deleted deployment's own
    assert api.delete("/api/deployments/small", params={"confirm": "small"}).status_code == 200
    wait_until(lambda: api.get("/api/deployments/small/status").status_code == 404, 60, what="its runtime gone")
    made = create(api, name="other")
    assert made.status_code == 201, made.text
    other = next(d for d in api.get("/api/deployments").json() if d["name"] == "other")
    assert other["id"] > small_id  # not the deleted one's
    assert made.json()["revision"] > max(given)  # no revision number given twice
    again = create(api, name="small")  # even under the same name
    assert again.status_code == 201 and again.json()["revision"] > made.json()["revision"]
    newest = api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 5}})
    assert newest.status_code == 201 and newest.json()["revision"] > again.json()["revision"]
    events_after = {e["id"] for e in api.get("/api/deployments/small/events", params={"limit": 500}).json()}
    assert events_after - engine_wide and not events_after & events_before  # the new "small"'s are its own


def test_a_deployment_name_follows_the_user_name_rules(api: TestClient) -> None:
    """Names were accepted as '..', '/', URLs and ':shortcodes:' (rendered by the console as emoji) and Unicode
    look-alikes (issue 31): a deployment's name is the model clients send and part of addresses."""
    for name in ["..", "a/b", "http://x.example/y", ":smile:", "dеmo-b", "a..b", "-x", "x" * 65, "demo b", "ｄｅｍｏ"]:
        resp = create(api, name=name)
        assert resp.status_code == 422 and "1 to 64 ASCII letters" in resp.text, (name, resp.text)
        assert "^[" not in resp.text  # the rule in words, not a raw regular expression
    assert [r["name"] for r in api.get("/api/deployments").json()] == ["demo"]


def test_a_name_that_looks_like_another_deployment_s_is_refused(api: TestClient) -> None:
    assert create(api, name="team-a").status_code == 201
    resp = create(api, name="TEAM-A")
    assert resp.status_code == 409 and "looks like the deployment 'team-a'" in resp.text


def test_a_disabled_deployment_cannot_be_started(api: TestClient) -> None:
    """A disabled deployment could be started and served while listed disabled (issue 31)."""
    assert create(api).status_code == 201
    assert api.patch("/api/deployments/small", json={"enabled": False}).status_code == 200
    for action in ("start", "restart"):
        resp = api.post(f"/api/deployments/small/engine/{action}")
        assert resp.status_code == 409 and "is disabled: enable it first" in resp.text, resp.text
    assert api.post("/api/deployments/small/engine/stop").status_code == 202  # stopping is always allowed
    assert api.get("/api/deployments/small/status").json()["state"] != "starting"


def test_a_created_deployment_is_there_as_soon_as_its_creation_is_answered(api: TestClient) -> None:
    """Creating one and opening it at once (the console does; so did a CI run whose fleet loop was busy) finds it:
    the answer to the creation waits until the engine has taken it, not the registry's next round."""
    fleet = api.app.state.services.fleet  # type: ignore[attr-defined]
    fleet.wake = lambda: None  # its loop looks again only after a second: the creation must not rely on it
    made = create(api, name="at-once")
    assert made.status_code == 201, made.text
    status = api.get("/api/deployments/at-once/status")
    assert status.status_code == 200 and status.json()["deployment"] == "at-once", status.text
    assert "at-once" in {d["name"] for d in api.get("/api/deployments").json()}


def test_an_enable_or_disable_shows_in_the_list_as_soon_as_it_is_answered(api: TestClient,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The Deployments page reads the list right after its Enable click: the list showed the registry's copy of the
    row, which takes a change over within a second, so under load the page said "Enabled" and drew "Enable" again
    (a console test on CI). The list and the deployment's own answer now show the row as written."""
    assert create(api, name="flip").status_code == 201
    fleet = api.app.state.services.fleet  # type: ignore[attr-defined]

    async def not_yet() -> None:  # the registry takes nothing over while this looks
        return None

    monkeypatch.setattr(fleet, "_sync", not_yet)
    for enabled in (False, True, False):
        assert api.patch("/api/deployments/flip", json={"enabled": enabled}).json()["enabled"] is enabled
        listed = next(d for d in api.get("/api/deployments").json() if d["name"] == "flip")
        assert listed["enabled"] is enabled
        assert api.get("/api/deployments/flip").json()["enabled"] is enabled
