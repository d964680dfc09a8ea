"""The engine: its status, start / stop / restart of vLLM, how clients reach the model, and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from engine.api.deps import (
    ControllerDep,
    DeploymentsDep,
    EventsDep,
    NoteDep,
    RuntimeDep,
    ServicesDep,
    access,
    actor,
)
from engine.capacity import find_model_config, load_shape, model_card
from engine.metrics import render
from engine.revisions import EngineSettings
from engine.schemas import ActionOut, GatewayInfo, GatewayWorkerOut, ModelCard, StatusOut

router = APIRouter(tags=["engine"])


@router.get("/api/status", response_model=StatusOut, dependencies=access("viewer"))
def status(controller: ControllerDep) -> StatusOut:
    """State (and why, since when), running and desired revision, model, vLLM, the gateway, the start's phases."""
    return controller.status()


def _act(action: str, request: Request, controller: ControllerDep, events: EventsDep, note: NoteDep,
         runtime: RuntimeDep, deployments: DeploymentsDep) -> ActionOut:
    before = controller.sm.state.value
    note.target = "vLLM"
    if action != "stop" and not deployments.get(runtime.name).enabled:  # it would serve while listed disabled
        raise HTTPException(409, detail=f"deployment {runtime.name} is disabled: enable it first (PATCH "
                            f"/api/deployments/{runtime.name} with enabled true, or Enable on the Deployments page)")
    {"start": controller.request_start, "stop": controller.request_stop,
     "restart": controller.request_restart}[action]()
    events.add(f"{action}_requested", f"{action} requested by {actor(request)}")
    note.target, note.before = "vLLM", {"state": before}
    return ActionOut(accepted=action, **controller.status().model_dump())


@router.post("/api/engine/start", status_code=202, response_model=ActionOut,
             dependencies=access("operator", "engine.start"))
def start(request: Request, controller: ControllerDep, events: EventsDep, note: NoteDep, runtime: RuntimeDep,
          deployments: DeploymentsDep) -> ActionOut:
    """Start vLLM (and clear a crash-loop halt); the state in the answer is the state before it takes effect."""
    return _act("start", request, controller, events, note, runtime, deployments)


@router.post("/api/engine/stop", status_code=202, response_model=ActionOut,
             dependencies=access("operator", "engine.stop"))
def stop(request: Request, controller: ControllerDep, events: EventsDep, note: NoteDep, runtime: RuntimeDep,
          deployments: DeploymentsDep) -> ActionOut:
    """Stop vLLM (in-flight requests finish first; new ones get 503 until it starts)."""
    return _act("stop", request, controller, events, note, runtime, deployments)


@router.post("/api/engine/restart", status_code=202, response_model=ActionOut,
             dependencies=access("operator", "engine.restart"))
def restart(request: Request, controller: ControllerDep, events: EventsDep, note: NoteDep, runtime: RuntimeDep,
          deployments: DeploymentsDep) -> ActionOut:
    """Restart vLLM on the desired revision."""
    return _act("restart", request, controller, events, note, runtime, deployments)


@router.get("/api/gateway", response_model=GatewayInfo, dependencies=access("viewer"))
def gateway_info(svc: ServicesDep, runtime: RuntimeDep) -> GatewayInfo:
    """How clients reach the deployment's model: the /v1 base URL, whether an API key is needed, the model name
    to send, and the model's card (architecture, parameters, context length, dtype, KV-cache bytes per token)."""
    rev = runtime.controller.running or runtime.revisions.desired_revision()
    values = rev.values if rev is not None else {}
    card: ModelCard | None = None
    folder = find_model_config(str(values.get("model") or ""), svc.config.data_dir.resolve())
    if folder is not None:
        try:
            card = model_card(load_shape(folder), EngineSettings.model_construct(**values))
        except (KeyError, ValueError, TypeError, OSError):
            card = None  # a config.json this model does not understand: no card, not an error
    served = values.get("served_model_name")
    workers = [GatewayWorkerOut(index=w.index, pid=w.pid, alive=w.alive, started_at=w.started_at,
                                restarts=w.restarts, last_exit=w.last_exit, requests=w.tally.requests,
                                in_flight=w.tally.held, waiting=w.tally.waits, refused=w.tally.refused,
                                accepting=svc.workers is not None and svc.workers.accepting(w),
                                shedding=w.tally.shedding if w.alive else 0.0,
                                cpu=w.tally.cpu if w.alive else None)
               for w in (svc.workers.workers if svc.workers is not None else [])]
    return GatewayInfo(base_url=svc.public_url.rstrip("/") + "/v1", keys_required=svc.gateway_keys,
                       served_model=str(served) if served else None, model=card,
                       data_base_url=svc.data_url + "/v1" if svc.data_url else None, workers=workers)


@router.get("/metrics", tags=["export"], response_class=Response, dependencies=access("viewer"),
            responses={200: {"description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {}}}})
def metrics(svc: ServicesDep) -> Response:
    """The engine's own metrics in Prometheus format (docs/grafana-dashboard.json reads them)."""
    return Response(render(svc.registry), media_type=CONTENT_TYPE_LATEST)
