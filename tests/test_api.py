"""The control API on a real SQLite file, with vLLM not started (autostart off): validation, conflicts, history."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig


@pytest.fixture
def api(data_dir: Path) -> Iterator[TestClient]:
    config = AppConfig(data_dir=data_dir, autostart=False)
    with TestClient(create_app(config)) as client:
        yield client


def test_status_says_stopped_and_why(api: TestClient) -> None:
    body = api.get("/api/status").json()
    assert body["state"] == "stopped"
    assert body["desired_revision"] == 1 and body["running_revision"] is None
    assert api.get("/healthz").json() == {"ok": True}
    ready = api.get("/readyz")
    assert ready.status_code == 503 and ready.json()["state"] == "stopped"


def test_put_partial_values_creates_a_revision(api: TestClient) -> None:
    resp = api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 4}, "note": "why"},
                   headers={"x-llmops-user": "ana"})
    assert resp.status_code == 201
    rev = resp.json()
    assert (rev["revision"], rev["author"], rev["note"], rev["status"]) == (2, "ana", "why", "pending")
    assert rev["values"]["max_num_seqs"] == 4 and rev["values"]["max_model_len"] == 2048
    assert api.get("/api/settings").json()["revision"] == 2
    assert [r["revision"] for r in api.get("/api/settings/history").json()] == [2, 1]
    assert api.get("/api/settings/1").json()["values"]["max_num_seqs"] == 16
    kinds = [e["kind"] for e in api.get("/api/events").json()]
    assert "settings_changed" in kinds


def test_bad_values_get_422_naming_each_field_and_write_nothing(api: TestClient) -> None:
    resp = api.put("/api/settings", json={"base_revision": 1,
                                         "values": {"gpu_memory_utilization": 1.5, "max_num_seqs": -1}})
    assert resp.status_code == 422
    fields = {e["loc"][-1]: e["msg"] for e in resp.json()["detail"]}
    assert set(fields) == {"gpu_memory_utilization", "max_num_seqs"}
    assert "less than or equal to 1" in fields["gpu_memory_utilization"]
    assert [r["revision"] for r in api.get("/api/settings/history").json()] == [1]


def test_malformed_body_gets_422(api: TestClient) -> None:
    assert api.put("/api/settings", json={"values": {"max_num_seqs": 2}}).status_code == 422
    assert api.put("/api/settings", content=b"not json", headers={"content-type": "application/json"}
                   ).status_code == 422
    assert api.get("/api/settings/history").json()[0]["revision"] == 1


def test_stale_base_gets_409(api: TestClient) -> None:
    assert api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 4}}).status_code == 201
    resp = api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 8}})
    assert resp.status_code == 409
    assert resp.json()["current_revision"] == 2
    assert api.get("/api/settings").json()["values"]["max_num_seqs"] == 4


def test_rollback_creates_a_copy_of_an_old_revision(api: TestClient) -> None:
    api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 4}})
    resp = api.post("/api/settings/rollback", json={"revision": 1})
    assert resp.status_code == 201
    rev = resp.json()
    assert rev["revision"] == 3 and rev["values"]["max_num_seqs"] == 16 and "rollback" in rev["note"]
    assert api.post("/api/settings/rollback", json={"revision": 99}).status_code == 404


def test_unknown_engine_action(api: TestClient) -> None:
    assert api.post("/api/engine/explode").status_code == 404


def test_gateway_refuses_with_503_and_retry_after_when_vllm_is_down(data_dir: Path) -> None:
    config = AppConfig(data_dir=data_dir, autostart=False, queue_timeout_s=0.2)
    with TestClient(create_app(config)) as client:
        resp = client.post("/v1/completions", json={"model": "demo", "prompt": "hi"})
        assert resp.status_code == 503
        assert resp.headers["retry-after"]
        assert "stopped" in resp.json()["error"]["message"]
        assert client.post("/v1/generate", json={"prompt": ""}).status_code == 422
