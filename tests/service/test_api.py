"""The control API on a real SQLite file, with vLLM not started (autostart off): validation, conflicts, history."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from engine.db import DEFAULT_DEPLOYMENT
from engine.vllm import sandbox_for
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.wait import wait_until


def signed_in(app: FastAPI) -> TestClient:
    """A test client carrying an admin token (every /api route needs one)."""
    client = TestClient(app)
    token, _ = app.state.services.auth.create_token("tests", "admin")
    client.headers["authorization"] = f"Bearer {token}"
    return client


@pytest.fixture
def api(data_dir: Path) -> Iterator[TestClient]:
    config = AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD)
    with signed_in(create_app(config)) as client:
        yield client


def test_status_says_stopped_and_why(api: TestClient) -> None:
    body = api.get("/api/status").json()
    assert body["state"] == "stopped"
    assert body["desired_revision"] == 1 and body["running_revision"] is None
    assert api.get("/healthz").json() == {"ok": True}
    ready = api.get("/readyz")
    assert ready.status_code == 503 and ready.json()["state"] == "stopped"


def test_put_partial_values_creates_a_revision(api: TestClient) -> None:
    resp = api.put("/api/settings", json={"base_revision": 1, "values": {"max_num_seqs": 4}, "note": "why",
                                          "author": "someone else"})
    assert resp.status_code == 201
    rev = resp.json()
    # the author is who the token says, whatever the body claims
    assert (rev["revision"], rev["author"], rev["note"], rev["status"]) == (2, "tests", "why", "pending")
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
    with signed_in(create_app(config)) as client:
        resp = client.post("/v1/completions", json={"model": "demo", "prompt": "hi"})
        assert resp.status_code == 503
        assert resp.headers["retry-after"]
        assert "stopped" in resp.json()["error"]["message"]
        assert client.post("/v1/generate", json={"prompt": ""}).status_code == 422


def test_gpu_endpoint_is_honest_without_a_gpu(api: TestClient) -> None:
    """This machine has no NVIDIA driver: the API says so with NVML's reason and shows the host instead."""
    body = wait_until(lambda: (b := api.get("/api/gpu").json())["reason"] != "sampler not started" and b, 10,
                      what="the sampler's first sample")
    assert body["available"] is False
    assert "NVML" in body["reason"]
    assert body["gpus"] == []
    assert body["host"]["mem_total"] > 0 and body["host"]["cpu_count"] >= 1


def test_gpu_history_validates_its_window(api: TestClient) -> None:
    assert api.get("/api/gpu/history", params={"window": "5m"}).status_code == 200
    bad = api.get("/api/gpu/history", params={"window": "soon"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "window"]
    assert api.get("/api/gpu/history", params={"window": "30d"}).status_code == 422


def test_history_refuses_numbers_out_of_range_with_422(api: TestClient) -> None:
    # found by the schemathesis run: such numbers used to reach SQLite and answer 500
    for path, params, field in [
            ("/api/gpu/history", {"device": "9223372036854775808"}, "device"),
            ("/api/gpu/history", {"window": "2h", "step": "99999999999999999999d"}, "step"),
            ("/api/serving/history", {"revision": "9223372036854775808"}, "revision"),
            ("/api/serving/history", {"window": "5m", "step": "0"}, "step")]:
        response = api.get(path, params=params)
        assert response.status_code == 422, (path, params, response.text)
        assert field in str(response.json()["detail"][0]["loc"]), (path, params)


@pytest.mark.parametrize(("path", "body", "loc"), [
    ("/api/benchmarks", {"concurrency": [1, 5000]}, ["body", "concurrency", 1]),
    ("/api/benchmarks/search", {"target_p95_s": 5, "candidates": [0]}, ["body", "candidates", 0]),
])
def test_benchmark_levels_out_of_range_get_422_naming_the_item_and_start_nothing(
        api: TestClient, path: str, body: dict[str, object], loc: list[object]) -> None:
    resp = api.post(path, json=body)
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"] == loc
    assert api.get("/api/benchmarks").json() == []


def test_preflight_refuses_a_kv_cache_too_small_for_max_model_len(api: TestClient) -> None:
    resp = api.put("/api/settings", json={"base_revision": 1, "values": {"cpu_kv_cache_gib": 0.001}})
    assert resp.status_code == 422
    err = resp.json()["detail"][0]
    assert err["type"] == "preflight" and err["code"] == "kv_cache_too_small"
    assert err["loc"] == ["body", "values", "cpu_kv_cache_gib"]
    assert err["fit"]["max_model_len"] == 896 and "896" in err["msg"]
    assert [r["revision"] for r in api.get("/api/settings/history").json()] == [1]


def test_force_writes_past_preflight_and_records_it(api: TestClient) -> None:
    resp = api.put("/api/settings", json={"base_revision": 1, "values": {"cpu_kv_cache_gib": 0.001},
                                          "note": "testing the safety net", "force": True})
    assert resp.status_code == 201
    rev = resp.json()
    assert rev["forced"] is True
    assert [(w["code"], w["severity"], w.get("forced")) for w in rev["warnings"]] == [
        ("kv_cache_too_small", "error", True)]


def test_capacity_answers_for_values_not_saved(api: TestClient) -> None:
    body = api.get("/api/capacity", params={"cpu_kv_cache_gib": "0.25", "max_model_len": "1024"}).json()
    assert body["ok"] is True and body["base_revision"] == 1
    assert body["values"]["max_model_len"] == 1024
    pred = body["prediction"]
    assert pred["kv_tokens"] == 262_144 and pred["kv_bytes_per_token"] == 1024 and pred["max_concurrency"] == 256.0
    assert body["model"]["max_position_embeddings"] == 2048
    bad = api.get("/api/capacity", params={"max_model_len": "4096"}).json()
    assert bad["ok"] is False and bad["errors"][0]["fit"] == {"max_model_len": 2048}
    assert bad["plan"]["kind"] == "start"  # a forced apply of them runs a plan: the confirmation shows it
    invalid = api.get("/api/capacity", params={"max_num_seqs": "zero"})
    assert invalid.status_code == 422 and invalid.json()["detail"][0]["loc"][-1] == "max_num_seqs"
    assert [r["revision"] for r in api.get("/api/settings/history").json()] == [1]


def test_an_internal_error_fails_the_engine_visibly_and_serving_goes_on(data_dir: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.serving.launcher

    def broken(*_: object, **__: object) -> list[str]:
        raise RuntimeError("argument builder bug")

    monkeypatch.setattr(engine.serving.launcher, "build_command", broken)
    config = AppConfig(data_dir=data_dir, autostart=True, backoff_max_s=3600)
    with signed_in(create_app(config)) as client:
        wait_until(lambda: client.get("/api/status").json()["state"] == "failed", 10, every=0.05,
                   what="the failed state")
        status = client.get("/api/status").json()
        assert "internal error RuntimeError: argument builder bug" in status["reason"]
        failed = client.get("/api/events", params={"kind": "failed"}).json()
        assert failed and "argument builder bug" in failed[-1]["message"]
        client.post("/api/engine/stop")  # the loop is alive: it acts on the stop request
        wait_until(lambda: client.get("/api/status").json()["state"] == "stopped", 10, every=0.05,
                   what="the stopped state")


def test_engine_exports_prometheus_metrics(api: TestClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    api.post("/v1/completions", json={"model": "demo", "prompt": "x"})  # refused: vLLM is stopped
    resp = api.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    state = {s.labels["state"]: s.value for s in families["llmops_engine_state"].samples}
    assert state["stopped"] == 1.0 and sum(state.values()) == 1.0
    assert families["llmops_gpu_available"].samples[0].value == 0.0  # no GPU here, and no invented GPU series
    assert not families["llmops_gpu_memory_used_bytes"].samples
    assert families["llmops_host_memory_used_bytes"].samples[0].value > 0
    assert families["llmops_host_memory_used_bytes"].samples[0].labels == {"node": "local"}  # labelled by node
    per = {(s.labels["deployment"], s.labels["state"]): s.value for s in families["llmops_deployment_state"].samples}
    assert per[("demo", "stopped")] == 1.0  # and each deployment's state, labelled by it
    refused = [s for s in families["llmops_requests"].samples if s.name == "llmops_requests_total"]
    assert refused and refused[0].labels["outcome"] == "refused" and refused[0].value == 1.0


def test_the_event_loops_lag_is_exported(api: TestClient) -> None:
    """Every stream through the gateway runs on the engine's event loop: how late it wakes is a figure an operator
    reads beside the latency (a stall of the gateway itself, not of vLLM). A loop blocked 0.6 s shows as such."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from tests.testkit.wait import wait_until

    def buckets() -> dict[str, float]:
        families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
        return {s.labels.get("le", s.name): s.value for s in families["llmops_event_loop_lag_seconds"].samples}

    wait_until(lambda: buckets()["+Inf"] >= 2, 30, every=0.1, what="two wake-ups of the loop-lag probe")
    before = buckets()
    assert api.portal is not None
    api.portal.call(time.sleep, 0.6)  # runs on the engine's loop: it is blocked meanwhile
    wait_until(lambda: (lambda b: b["+Inf"] - b["0.5"] > before["+Inf"] - before["0.5"])(buckets()), 30, every=0.1,
               what="the stall counted")


def test_grafana_dashboard_reads_only_metrics_the_engine_exports(api: TestClient) -> None:
    import json
    import re

    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics import GPU_GAUGES, SERVING_GAUGES
    from tests.testkit.engine import REPO

    exported = {f.name for f in text_string_to_metric_families(api.get("/metrics").text)}
    exported |= {name for name, _ in (*GPU_GAUGES.values(), *SERVING_GAUGES.values())}  # need a GPU / vLLM up
    exported |= {"llmops_running_revision"}  # exported while vLLM runs
    dashboard = json.loads((REPO / "docs" / "grafana-dashboard.json").read_text())
    used = {re.sub(r"_(total|bucket|count|sum)$", "", m)
            for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"llmops_[a-z_]+", t["expr"])}
    assert used and used <= exported, used - exported


def test_log_filters_hide_polling_keep_levels_and_find_text() -> None:
    from engine.vllm import filter_log

    lines = ["(APIServer pid=1) INFO 12-01 [x.py:1] Starting vLLM server", 'INFO:     127.0.0.1:1 - "GET /health '
             'HTTP/1.1" 200 OK', 'INFO:     127.0.0.1:1 - "GET /metrics HTTP/1.1" 200 OK',
             "(EngineCore pid=2) WARNING 12-01 [y.py:2] Found ulimit", "(EngineCore pid=2) ERROR 12-01 [z.py:3] boom",
             "Traceback (most recent call last):", '  File "a.py", line 1', 'INFO:     1.2.3.4:5 - "POST /v1/'
             'completions HTTP/1.1" 200 OK']
    assert len(filter_log(lines, hide_polling=True, level="debug", contains=None)) == len(lines) - 2
    # a traceback's lines carry the level of the line before them
    assert filter_log(lines, hide_polling=False, level="error", contains=None) == lines[4:7]
    assert filter_log(lines, hide_polling=False, level="warning", contains=None) == lines[3:7]
    assert filter_log(lines, hide_polling=False, level="debug", contains="ULIMIT") == [lines[3]]


def test_gateway_card_names_the_address_keys_and_the_model(api: TestClient) -> None:
    info = api.get("/api/gateway").json()
    assert info["base_url"].endswith("/v1") and info["keys_required"] is False
    assert info["served_model"] == "demo"
    card = info["model"]
    assert card["architecture"] == "LlamaForCausalLM" and card["context_length"] == 2048
    assert card["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2  # 2 x layers x KV heads x head_dim x bf16


def test_only_an_admin_turns_trust_remote_code_on(api: TestClient) -> None:
    """trust_remote_code runs the model repository's code as the engine's user, beside its database and the CLI's
    admin token: an operator could make themselves admin with it (issue 31). Turning it on — a write, a rollback to
    a revision with it, a new deployment — takes an admin; an operator's other changes go on as before."""
    token, _ = api.app.state.services.auth.create_token("op", "operator")  # type: ignore[attr-defined]
    operator = {"authorization": f"Bearer {token}"}
    base = api.get("/api/settings").json()["revision"]
    for value in (True, "true", 1):
        refused = api.put("/api/settings", headers=operator,
                          json={"base_revision": base, "values": {"trust_remote_code": value}})
        assert refused.status_code == 403 and "only an admin" in refused.text, refused.text
    made = api.post("/api/deployments", headers=operator, json={
        "name": "remote", "values": {"model": "models/demo", "trust_remote_code": True}})
    assert made.status_code == 403 and api.get("/api/deployments/remote").status_code == 404
    assert api.get("/api/settings").json()["revision"] == base  # nothing written
    fine = api.put("/api/settings", headers=operator, json={"base_revision": base, "values": {"max_num_seqs": 3}})
    assert fine.status_code == 201, fine.text
    by_admin = api.put("/api/settings", json={"base_revision": fine.json()["revision"],
                                              "values": {"trust_remote_code": True}})
    assert by_admin.status_code == 201, by_admin.text
    off = api.put("/api/settings", headers=operator, json={"base_revision": by_admin.json()["revision"],
                                                           "values": {"trust_remote_code": False}})
    assert off.status_code == 201  # turning it off is anyone's
    back = api.post("/api/settings/rollback", headers=operator, json={"revision": by_admin.json()["revision"]})
    assert back.status_code == 403 and "only an admin" in back.text


def test_an_operator_s_rollback_decided_while_remote_code_was_on_is_refused_if_an_admin_turned_it_off_meanwhile(
        api: TestClient) -> None:
    """A rollback to a revision with trust_remote_code needs no admin while the desired revision has it on already.
    That was read in one transaction and written in another: an admin's change that turned it off in between was
    undone by an operator who may not turn it on. The write now holds to the desired revision it was decided on."""
    services = api.app.state.services  # type: ignore[attr-defined]
    token, _ = services.auth.create_token("op", "operator")
    operator = {"authorization": f"Bearer {token}"}
    base = api.get("/api/settings").json()["revision"]
    on = api.put("/api/settings", json={"base_revision": base, "values": {"trust_remote_code": True}})
    assert on.status_code == 201, on.text
    revisions = services.fleet.runtimes[DEFAULT_DEPLOYMENT].revisions
    read = revisions.desired_revision

    def then_an_admin_turns_it_off() -> Any:  # right after the rollback's route read the desired revision
        found = read()
        revisions.desired_revision = read
        revisions.create_revision({**found.values, "trust_remote_code": False}, base_revision=found.id,
                                  author="admin", note="off again")
        return found

    revisions.desired_revision = then_an_admin_turns_it_off
    back = api.post("/api/settings/rollback", headers=operator, json={"revision": on.json()["revision"]})
    assert back.status_code == 409 and "stale" in back.text, back.text
    now = api.get("/api/settings").json()
    assert (now["author"], now["values"]["trust_remote_code"]) == ("admin", False)


def test_the_engine_removes_its_folder_for_vllms_sockets_when_it_stops(tmp_path: Path) -> None:
    """An engine on a data dir too deep for vLLM's socket paths makes a short folder for them in the temp folder
    (on its first start of a vLLM); its stop removes it, so that engines that come and go (each test's) do not
    leave one behind each."""
    data = tmp_path / ("d" * max(1, 90 - len(str(tmp_path)))) / "data"
    data.mkdir(parents=True)
    env = {"TMPDIR": str(data)}
    sandbox_for(data, env)  # what the engine's first start of a vLLM child does
    folder = Path(env["VLLM_RPC_BASE_PATH"])
    assert folder.is_dir() and not folder.is_relative_to(tmp_path)
    try:
        with TestClient(create_app(AppConfig(data_dir=data, autostart=False, admin_password=ADMIN_PASSWORD))) as api:
            assert api.get("/healthz").status_code == 200
            assert folder.is_dir()  # while the engine runs, its vLLM children may use it
        assert not folder.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
