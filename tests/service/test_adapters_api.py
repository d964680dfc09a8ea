"""LoRA adapters through the control API on a real SQLite file, vLLM not started (autostart off): registered only
where the deployment's revision serves adapters and the adapter fits its base model, refused naming the field and
the reason otherwise (nothing changed), listed, routed by name to its deployment (a key limited to the deployment
reaches it, another does not), audited, removed, gone with its deployment, and kept over an engine restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.service.test_api import signed_in
from tests.testkit.adapters import give_demo_weights, make_adapter
from tests.testkit.engine import ADMIN_PASSWORD


@pytest.fixture
def data(data_dir: Path) -> Path:
    give_demo_weights(data_dir / "models" / "demo")
    make_adapter(data_dir / "models" / "tuned")
    make_adapter(data_dir / "models" / "r64", rank=64)
    return data_dir


def app_for(data: Path, **config: Any) -> Any:
    return create_app(AppConfig(data_dir=data, autostart=False, admin_password=ADMIN_PASSWORD, **config))


def enable_lora(api: TestClient, deployment: str = "demo") -> None:
    prefix = "" if deployment == "demo" else f"/deployments/{deployment}"
    base = api.get(f"/api{prefix}/settings").json()["revision"]
    resp = api.put(f"/api{prefix}/settings", json={"base_revision": base, "values": {"enable_lora": True}})
    assert resp.status_code == 201, resp.text


def test_an_adapter_is_registered_listed_routed_audited_and_removed(data: Path) -> None:
    with signed_in(app_for(data)) as api:
        refused = api.post("/api/deployments/demo/adapters", json={"name": "tuned", "path": "models/tuned"})
        assert refused.status_code == 422 and "enable_lora is off" in refused.text
        assert refused.json()["detail"][0]["loc"] == ["body", "path"]
        enable_lora(api)
        made = api.post("/api/deployments/demo/adapters", json={"name": "tuned", "path": "models/tuned"})
        assert made.status_code == 201, made.text
        body = made.json()
        assert (body["name"], body["rank"], body["target_modules"], body["deployment"]) == (
            "tuned", 8, ["q_proj", "v_proj"], "demo")
        assert body["listed"] is True and body["loaded_on"] == []  # no instance serves yet
        assert [a["name"] for a in api.get("/api/deployments/demo/adapters").json()] == ["tuned"]
        # its name reaches its deployment (stopped here: 503 from it, not the gateway's 404)
        resp = api.post("/v1/completions", json={"model": "tuned", "prompt": "x"})
        assert resp.status_code == 503, resp.text
        assert api.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        # the same name again, a deployment's name, and a rank above max_lora_rank: refused, nothing changed
        again = api.post("/api/deployments/demo/adapters", json={"name": "tuned", "path": "models/tuned"})
        assert again.status_code == 409 and "taken" in again.text
        assert api.post("/api/deployments/demo/adapters", json={"name": "demo", "path": "models/tuned"}
                        ).status_code == 409
        high = api.post("/api/deployments/demo/adapters", json={"name": "big", "path": "models/r64"})
        assert high.status_code == 422 and "max_lora_rank 16" in high.text
        assert [a["name"] for a in api.get("/api/deployments/demo/adapters").json()] == ["tuned"]
        actions = [(r["action"], r["target"]) for r in api.get("/api/audit", params={"limit": 50}).json()
                   if r["action"].startswith("adapters.")]
        assert ("adapters.register", "adapter tuned of deployment demo") in actions
        gone = api.delete("/api/deployments/demo/adapters/tuned")
        assert gone.status_code == 200 and api.get("/api/deployments/demo/adapters").json() == []
        assert api.post("/v1/completions", json={"model": "tuned", "prompt": "x"}).status_code == 404
        assert api.delete("/api/deployments/demo/adapters/tuned").status_code == 404
        assert any(a == "adapters.remove" for a, _ in (
            (r["action"], r["target"]) for r in api.get("/api/audit", params={"limit": 50}).json()))


def test_hostile_registrations_are_refused_naming_the_field(data: Path, tmp_path: Path) -> None:
    outside = make_adapter(tmp_path / "outside")
    with signed_in(app_for(data)) as api:
        enable_lora(api)
        for body, status, field in (
                ({"name": "a\x00b", "path": "models/tuned"}, 422, "name"),
                ({"name": "x" * 129, "path": "models/tuned"}, 422, "name"),
                ({"name": "ok", "path": "models/../models/tuned"}, 422, "path"),
                ({"name": "ok", "path": str(outside)}, 422, "path"),
                ({"name": "ok", "path": "models/tuned", "extra": 1}, 422, "extra"),
                ({"name": "ok", "path": 7}, 422, "path")):
            resp = api.post("/api/deployments/demo/adapters", json=body)
            assert resp.status_code == status, (body, resp.text)
            assert any(field in d["loc"] for d in resp.json()["detail"]), resp.text
        deep = api.post("/api/deployments/demo/adapters", content=b"[" * 50_000 + b"]" * 50_000,
                        headers={"content-type": "application/json"})
        assert deep.status_code in (400, 413, 422)
        assert api.get("/api/deployments/demo/adapters").json() == []
        assert api.get("/healthz").status_code == 200


def test_roles_keys_and_restarts(data: Path) -> None:
    app = app_for(data, gateway_keys="on")
    with signed_in(app) as api:
        enable_lora(api)
        assert api.post("/api/deployments", json={"name": "small", "values": {"model": "models/demo"}}
                        ).status_code == 201
        assert api.post("/api/deployments/demo/adapters", json={"name": "tuned", "path": "models/tuned"}
                        ).status_code == 201
        viewer = api.post("/api/tokens", json={"name": "v", "role": "viewer", "kind": "api"}).json()["token"]
        assert api.post("/api/deployments/demo/adapters", json={"name": "t2", "path": "models/tuned"},
                        headers={"authorization": f"Bearer {viewer}"}).status_code == 403
        assert api.get("/api/deployments/demo/adapters", headers={"authorization": f"Bearer {viewer}"}
                       ).status_code == 200
        small_key = api.post("/api/tokens", json={"name": "k-small", "role": "viewer", "kind": "gateway",
                                                  "deployments": ["small"]}).json()["token"]
        demo_key = api.post("/api/tokens", json={"name": "k-demo", "role": "viewer", "kind": "gateway",
                                                 "deployments": ["demo"]}).json()["token"]
        ask = {"model": "tuned", "prompt": "x"}
        assert api.post("/v1/completions", json=ask, headers={"authorization": f"Bearer {small_key}"}
                        ).status_code == 404  # another deployment's adapter does not exist for this key
        assert api.post("/v1/completions", json=ask, headers={"authorization": f"Bearer {demo_key}"}
                        ).status_code == 503  # its own deployment's: past the key (the deployment is stopped)
    with signed_in(app_for(data, gateway_keys="on")) as api:  # the engine again: the adapter is still there
        assert [a["name"] for a in api.get("/api/deployments/demo/adapters").json()] == ["tuned"]
        delete = api.delete("/api/deployments/small", params={"confirm": "small"})
        assert delete.status_code == 200
