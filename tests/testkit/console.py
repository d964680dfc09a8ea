"""The engine in the test's own process, for the console tier: the real app (API, auth, audit, store, gateway, the
serving controller) with fake vLLM children beneath it (tests/testkit/fake_vllm.py, in real time: a start takes
half a second), reached by every EngineClient the console makes through an injected transport
(engine/client.py route_through). Page tests then need no engine process and no vLLM."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from starlette.testclient import TestClient

from engine.app import create_app
from engine.client import EngineClient, route_through
from engine.config import AppConfig
from tests.testkit.clock import LiveClock
from tests.testkit.data import make_data_dir
from tests.testkit.fake_vllm import FakePlacement, Script

URL = "http://testserver"  # the Host every in-process request carries (LLMOPS_ALLOWED_HOSTS has it in tests)
ADMIN_PASSWORD = "admin-password-for-tests"


@dataclass
class InProcessEngine:
    url: str
    app: FastAPI
    http: TestClient
    transport: httpx.BaseTransport
    token: str  # an admin API token
    client: EngineClient  # acting as that admin
    placement: FakePlacement

    @property
    def services(self) -> Any:
        return self.app.state.services



HOP = {"content-encoding", "transfer-encoding", "content-length"}


def _through(http: TestClient, request: httpx.Request) -> httpx.Response:
    """One request of an httpx client, sent into the app by Starlette's test client (its own httpx)."""
    answer = http.request(request.method, str(request.url), content=request.read(),
                          headers=[(k, v) for k, v in request.headers.multi_items()], follow_redirects=False)
    return httpx.Response(answer.status_code, content=answer.content,
                          headers=[(k, v) for k, v in answer.headers.multi_items() if k.lower() not in HOP])


@contextlib.contextmanager
def in_process_engine(folder: Path, script: Script | None = None, **config: Any) -> Iterator[InProcessEngine]:
    """The engine app in this process on a fresh data dir, its default deployment serving on a fake vLLM; every
    EngineClient made meanwhile (the console's pages' too) reaches it."""
    settings = {"admin_password": ADMIN_PASSWORD, "serving_scrape_interval_s": 0.5, "reconcile_interval_s": 0.2,
                "handover_s": 1.0, "drain_timeout_s": 5.0, **config}
    app_config = AppConfig(data_dir=make_data_dir(folder / "data"), **settings)
    placement = FakePlacement(LiveClock(), script or Script(ready_s=0.5, token_delay_s=0.002))
    app = create_app(app_config, placement=placement)
    before = os.environ.get("LLMOPS_ENGINE_URL")
    with TestClient(app, base_url=URL) as http:
        transport = httpx.MockTransport(lambda request: _through(http, request))
        route_through(transport)
        os.environ["LLMOPS_ENGINE_URL"] = URL
        token = app.state.services.auth.create_token("tests", "admin", "api", "tests")[0]
        client = EngineClient(URL, token=token, timeout=30)
        try:
            yield InProcessEngine(URL, app, http, transport, token, client, placement)
        finally:
            client.close()
            route_through(None)
            if before is None:
                os.environ.pop("LLMOPS_ENGINE_URL", None)
            else:
                os.environ["LLMOPS_ENGINE_URL"] = before
