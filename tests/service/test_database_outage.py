"""The engine on PostgreSQL while the server restarts under it (in-process app, vLLM not started): a write during
the outage gets a clear 503 with Retry-After and leaves nothing behind; what the engine holds in memory still
answers; once the server is back the next write works and the background writers resume, with no engine
restart. The server is this test's own (it is stopped); the shared one of the PostgreSQL pass is not touched."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.app import create_app
from engine.config import AppConfig
from tests.testkit.db import sql
from tests.testkit.engine import ADMIN_PASSWORD
from tests.testkit.postgres import PostgresServer, bindir_or_skip
from tests.testkit.wait import wait_until

pytestmark = pytest.mark.postgres


@pytest.fixture
def server() -> Iterator[PostgresServer]:
    pg = PostgresServer(bindir_or_skip())
    try:
        pg.start()
        yield pg
    finally:
        pg.remove()


def test_a_postgresql_restart_gets_503s_then_service_again_without_an_engine_restart(server: PostgresServer,
                                                                                   data_dir: Path) -> None:
    url = server.create_database("outage")  # empty: the engine migrates it
    app = create_app(AppConfig(data_dir=data_dir, database_url=url, autostart=False, admin_password=ADMIN_PASSWORD,
                               gateway_keys="on", gpu_sample_interval_s=0.2))
    auth = app.state.services.auth
    admin = {"authorization": f"Bearer {auth.create_token('ops', 'admin')[0]}"}
    unchecked_key = auth.create_token("app", "prompter", "gateway")[0]  # never used yet: not in the key cache
    counted = ["revision", "event", "audit", "saved_prompt"]
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.put("/api/settings", headers=admin, json={"base_revision": 1, "values": {"max_num_seqs": 4}}
                          ).status_code == 201
        before = {t: sql(url, f"SELECT count(*) FROM {t}")[0][0] for t in counted}

        server.stop()
        write = client.put("/api/settings", headers=admin, json={"base_revision": 2, "values": {"max_num_seqs": 8}})
        assert write.status_code == 503, write.text
        assert write.headers["retry-after"] == "5"
        detail = write.json()["detail"]
        assert "database is unavailable" in detail and "nothing was recorded" in detail and "try again" in detail
        prompt = client.post("/api/prompts", headers=admin, json={"name": "p", "prompt": "hello"})
        assert prompt.status_code == 503 and "database is unavailable" in prompt.json()["detail"]
        # what the engine holds in memory answers; a read that needs the database says why it cannot
        assert client.get("/healthz").json() == {"ok": True}
        assert client.get("/readyz").json()["state"] == "stopped"
        status = client.get("/api/status", headers=admin)
        assert status.status_code == 503 and "database is unavailable" in status.json()["detail"]
        v1 = client.get("/v1/models", headers={"authorization": f"Bearer {unchecked_key}"})
        assert v1.status_code == 503 and v1.headers["retry-after"] == "5", v1.text
        assert v1.json()["error"]["type"] == "service_unavailable"
        assert "database is unavailable" in v1.json()["error"]["message"]

        back = time.time()
        server.start()
        wait_until(lambda: client.get("/api/settings", headers=admin).status_code == 200, 30,
                   what="the API reading the database again")
        assert {t: sql(url, f"SELECT count(*) FROM {t}")[0][0] for t in counted if t != "audit"} == \
            {t: n for t, n in before.items() if t != "audit"}  # the refused writes left nothing
        again = client.put("/api/settings", headers=admin, json={"base_revision": 2, "values": {"max_num_seqs": 8}})
        assert again.status_code == 201 and again.json()["revision"] == 3
        assert client.post("/api/prompts", headers=admin, json={"name": "p", "prompt": "hi"}).status_code == 201
        v1 = client.get("/v1/models", headers={"authorization": f"Bearer {unchecked_key}"})
        assert v1.status_code != 401 and "database" not in v1.text  # the key is checked again (vLLM is stopped)
        assert [r["revision"] for r in client.get("/api/settings/history", headers=admin).json()] == [3, 2, 1]
        wait_until(lambda: (sql(url, "SELECT max(ts) FROM telemetry_raw")[0][0] or 0) > back, 30,
                   what="the telemetry sampler writing again")
        audit = client.get("/api/audit", headers=admin, params={"action": "settings.write"}).json()
        assert [(r["target"], r["result"]) for r in audit][:2] == [("revision 3", 201), ("revision 2", 201)]
