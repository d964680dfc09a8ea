"""The API's shape: every route declares its role and (if it changes something) its audit action where it is
defined; every /api route has a typed answer; the console's client needs none of the engine's internals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.routing import APIRoute

from engine.api import route_meta
from engine.app import create_app
from engine.config import AppConfig
from tests.testkit.engine import ADMIN_PASSWORD, REPO

pytestmark = pytest.mark.one_database  # what each route declares: the store plays no part

MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
FILES = ("/api/logs/download", "/api/audit/export", "/metrics", "/api/engine/", "/api/prompts/{prompt_id}",
         "/api/deployments/{deployment}/logs/download", "/api/deployments/{deployment}/engine/")


def routes(data_dir: Path) -> list[APIRoute]:
    app = create_app(AppConfig(data_dir=data_dir, autostart=False, admin_password=ADMIN_PASSWORD))
    return [r for r in app.routes if isinstance(r, APIRoute)]


def test_every_route_declares_its_role_and_every_change_its_audit_action(data_dir: Path) -> None:
    undeclared = [f"{sorted(r.methods)} {r.path}" for r in routes(data_dir) if not route_meta(r)[0]]
    assert undeclared == [], "routes without a role: add dependencies=access(role, action)"
    unaudited = [f"{sorted(r.methods)} {r.path}" for r in routes(data_dir)
                 if r.methods & MUTATING and r.path.startswith("/api/") and not route_meta(r)[2]]
    assert unaudited == [], "mutating routes without an audit action"


def test_every_api_route_answers_with_a_declared_model(data_dir: Path) -> None:
    untyped = [f"{sorted(r.methods)} {r.path}" for r in routes(data_dir)
               if r.path.startswith(("/api/", "/healthz", "/readyz")) and r.response_model is None
               and not r.path.startswith(FILES) and r.status_code != 204]
    assert untyped == []


def test_the_console_client_imports_no_sqlite_nvml_or_vllm_code() -> None:
    probe = ("import sys, engine.client, console.serve, engine.edge, engine.schemas; "
             "print(sorted(m for m in ('sqlalchemy', 'sqlmodel', 'pynvml', 'vllm', 'torch', 'engine.db', "
             "'engine.serving', 'engine.gpu') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
