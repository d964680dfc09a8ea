"""Who may do what, and what is recorded: each finding of the outside security probe of issue 17, and what must
hold. On a real SQLite file with vLLM not started (autostart off); the concurrency findings behind a real uvicorn.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.app import create_app
from engine.config import AppConfig
from tests.support.engine import ADMIN_PASSWORD
from tests.support.served import serve
from tests.support.wait import wait_until


class Gate:
    """Holds every caller of a wrapped function until released, and counts who is waiting."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.entered = 0
        self._lock = threading.Lock()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.entered += 1
            self.released.wait(120)
            return fn(*args, **kwargs)
        return held


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.released.set()  # whatever the test did, nothing stays held


# --- 1. sign-in floods ------------------------------------------------------------------------------------------

def test_a_sign_in_flood_past_the_hashing_queue_is_refused_with_429_and_health_answers(
        data_dir: Path, gate: Gate) -> None:
    """48 sign-ins at once took every thread of the pool that serves /healthz (and 64 MiB each): now at most
    workers + queue are taken in, the rest are refused at once with 429 and Retry-After, and health answers."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD,
                               login_hash_workers=1, login_hash_queue=2))
    auth = app.state.services.auth
    auth._verify = gate.wrap(auth._verify)  # a password check that takes as long as the test wants
    with serve(app) as url, ThreadPoolExecutor(48) as pool, httpx.Client(base_url=url, timeout=60) as http:
        def sign_in(i: int) -> httpx.Response:
            return http.post("/api/auth/login", json={"username": "admin" if i % 2 else f"guess{i}",
                                                      "password": "wrong-password"})

        flood = [pool.submit(sign_in, i) for i in range(48)]
        refused = wait_until(lambda: [f.result() for f in flood if f.done()] if sum(f.done() for f in flood) >= 45
                             else None, 60, what="45 of 48 sign-ins answered while 3 are being checked")
        assert len(refused) == 45 and {r.status_code for r in refused} == {429}
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
        assert "try again in" in refused[0].json()["detail"]
        assert gate.entered == 1  # one hashing thread: one check at a time, two waiting
        assert http.get("/healthz", timeout=10).json() == {"ok": True}  # during the flood
        assert http.get("/readyz", timeout=10).status_code == 503  # answered (vLLM is stopped), not held
        gate.released.set()
        assert [f.result().status_code for f in flood if f.result().status_code != 429] == [401, 401, 401]


def test_health_and_readiness_never_wait_for_the_shared_thread_pool(data_dir: Path, gate: Gate) -> None:
    """Every thread of the shared pool held (here by token checks that hang): /healthz and /readyz still answer."""
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))
    auth = app.state.services.auth
    auth.authenticate = gate.wrap(auth.authenticate)
    with serve(app) as url, ThreadPoolExecutor(48) as pool, httpx.Client(base_url=url, timeout=60) as http:
        held = [pool.submit(http.get, "/api/status", headers={"authorization": "Bearer llmops_x"})
                for _ in range(48)]
        wait_until(lambda: gate.entered >= 40, 60, what="every thread of the shared pool held")  # anyio's 40
        assert http.get("/healthz", timeout=10).status_code == 200
        assert http.get("/readyz", timeout=10).status_code == 503
        gate.released.set()
        assert {f.result().status_code for f in held} == {401}
