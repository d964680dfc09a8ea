"""Health: the engine process is alive; vLLM is ready. Both answer on the event loop itself (async, with async
dependencies): no thread of the shared pool is needed, so a flood that holds every thread cannot delay them."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from engine.api.deps import ControllerDep, access
from engine.schemas import EngineState, HealthOut, ReadyOut

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthOut, dependencies=access(None))
async def healthz() -> HealthOut:
    """The engine process is alive (vLLM may not be)."""
    return HealthOut(ok=True)


@router.get("/readyz", response_model=ReadyOut, dependencies=access(None),
            responses={503: {"description": "vLLM is not ready: state and why", "model": ReadyOut}})
async def readyz(controller: ControllerDep) -> JSONResponse:
    """vLLM is ready to serve: 200, else 503 with the state and why."""
    ready = controller.sm.state == EngineState.READY
    body = ReadyOut(ready=ready, state=controller.sm.state, reason=controller.sm.reason)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if ready else 503)
