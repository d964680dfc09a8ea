"""The API's description: its OpenAPI schema, for a signed-in caller. No HTML docs: FastAPI's /docs and /redoc
pages load their scripts and styles from a CDN, and the engine serves no third-party assets (the schema loads
into any OpenAPI viewer, with a token)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.api.deps import access

router = APIRouter(tags=["docs"])


@router.get("/openapi.json", dependencies=access("viewer"), include_in_schema=False)
def openapi(request: Request) -> JSONResponse:
    """The OpenAPI schema of the engine's API (any role)."""
    return JSONResponse(request.app.openapi())
