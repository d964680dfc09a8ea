"""The guard loaded into every vLLM server (engine/vllm_guard.py): no path answers without the instance's key.
vLLM's own --api-key left /invocations (completions and chat), /tokenize, /load, /metrics and /docs open on the
instance's port (issue 31). The real vLLM with the guard: tests/system/test_session_engine.py."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from engine.vllm_guard import KeyOnEveryPath

PATHS = ["/health", "/invocations", "/tokenize", "/detokenize", "/load", "/scale_elastic_ep", "/metrics", "/docs",
         "/openapi.json", "/v1/completions", "/sleep", "/collective_rpc"]


async def ok(_: object) -> PlainTextResponse:
    return PlainTextResponse("served")


async def ws(socket: WebSocket) -> None:
    await socket.accept()
    await socket.send_text("served")
    await socket.close()


def guarded(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv("VLLM_API_KEY", "the-key")
    app = Starlette(routes=[*(Route(p, ok, methods=["GET", "POST"]) for p in PATHS),
                            WebSocketRoute("/v1/realtime", ws)])
    app.add_middleware(KeyOnEveryPath)  # as vLLM adds a --middleware class
    return TestClient(app)


def test_no_path_answers_without_the_instance_s_key(monkeypatch: pytest.MonkeyPatch) -> None:
    client = guarded(monkeypatch)
    for path in PATHS:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "the-key"},
                        {"authorization": "Bearer the-key2"}):
            resp = client.post(path, headers=headers)
            assert resp.status_code == 401 and "served" not in resp.text, (path, headers)
        assert client.get(path, headers={"authorization": "Bearer the-key"}).text == "served"
    with pytest.raises(WebSocketDisconnect), client.websocket_connect("/v1/realtime") as socket:
        socket.receive_text()
    with client.websocket_connect("/v1/realtime", headers={"authorization": "Bearer the-key"}) as socket:
        assert socket.receive_text() == "served"


def test_a_server_without_its_key_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="VLLM_API_KEY"):
        KeyOnEveryPath(ok)  # type: ignore[arg-type]


def test_the_guard_is_found_by_a_python_that_does_not_have_the_engine_installed(tmp_path: object) -> None:
    """vLLM may run under a Python of its own (a GPU host's staged venv), in the data dir: the guard is found
    through the PYTHONPATH the engine gives it, with no site-packages at all (-S), and imports the standard library
    only."""
    import subprocess
    import sys

    from engine.vllm import build_env

    env = build_env({"PATH": "/usr/bin:/bin", "PYTHONPATH": "/elsewhere"}, api_key="k")
    assert env["PYTHONPATH"].split(":")[-1] == "/elsewhere"  # what the engine was given is kept, after it
    done = subprocess.run([sys.executable, "-S", "-c", "import engine.vllm_guard as g, sys; "
                           "print(sorted(m for m in sys.modules if m.startswith('engine')))"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['engine', 'engine.vllm_guard']"
