"""The engine's HTTP API: routes by area (engine/api/routes), each declaring its role and audit action; typed
dependencies over one services container; the access gate that checks roles before bodies are read."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi import Path as PathParam
from fastapi.routing import APIRoute

from engine.api.deps import route_meta
from engine.api.errors import install_error_handlers
from engine.api.gate import AccessGate
from engine.api.routes import (
    access,
    alerts,
    audit,
    benchmarks,
    deployments,
    docs,
    engine,
    events,
    gateway,
    gpu,
    health,
    prompts,
    serving,
    teams,
)
from engine.api.routes import settings as settings_routes
from engine.api.services import Services

ROUTERS = [health.router, engine.router, settings_routes.router, events.router, access.router, audit.router,
           serving.router, gpu.router, benchmarks.router, prompts.router, gateway.router, deployments.router,
           teams.router, alerts.router, docs.router]
# the routes that act on one deployment: today's /api/… act on the default one, and each is also mounted as
# /api/deployments/{deployment}/… for any other (engine/api/deps.py `runtime` reads which)
PER_DEPLOYMENT = [engine.router, settings_routes.router, events.router, serving.router, benchmarks.router]
DEPLOYMENT_PREFIX = "/api/deployments/{deployment}"


def _deployment_path(deployment: str = PathParam(min_length=1, max_length=128,
                                                 description="the deployment's name")) -> str:
    return deployment


def per_deployment(router: APIRouter) -> APIRouter:
    """A copy of ``router``'s /api routes under /api/deployments/{deployment}: the same handlers, roles, audit
    actions and response models."""
    out = APIRouter()
    for route in router.routes:
        if not isinstance(route, APIRoute) or not route.path.startswith("/api/"):
            continue
        out.add_api_route(
            DEPLOYMENT_PREFIX + route.path.removeprefix("/api"), route.endpoint, methods=sorted(route.methods),
            response_model=route.response_model, status_code=route.status_code,
            tags=[*route.tags, "per deployment"], dependencies=[*route.dependencies, Depends(_deployment_path)],
            summary=route.summary, description=route.description, responses=route.responses,
            response_class=route.response_class, name=f"{route.name}_of_deployment",
            operation_id=f"{route.name}_of_deployment", include_in_schema=route.include_in_schema)
    return out


COMMON: dict[int | str, dict[str, Any]] = {  # answers any route may give, documented for its clients
    400: {"description": "The body could not be read as JSON"},
    401: {"description": "No valid bearer token (missing, unknown, revoked or expired)"},
    403: {"description": "The token's role may not do this"},
    404: {"description": "No such revision, run, prompt, user or token"},
    409: {"description": "Conflict: a stale base revision, or a benchmark already running"},
    413: {"description": "The body is larger than this route takes"},
    423: {"description": "Sign-in locked after repeated failures"},
    503: {"description": "The engine's database is unavailable now (a full disk, a lock held too long, a "
                         "PostgreSQL server down or restarting): nothing was done; try again after Retry-After"},
}


def mount(app: FastAPI) -> None:
    """Every route and the error handlers."""
    for router in ROUTERS:
        app.include_router(router, responses=COMMON)
    for router in PER_DEPLOYMENT:
        app.include_router(per_deployment(router), responses=COMMON)
    install_error_handlers(app)


__all__ = ["ROUTERS", "AccessGate", "Services", "mount", "route_meta"]
