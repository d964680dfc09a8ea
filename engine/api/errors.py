"""How the engine's errors answer over HTTP: each a 4xx naming what was wrong and what to do, never a 500 for bad
input, and never the input itself echoed back at length."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from engine.benchmarks import BenchmarkBusyError
from engine.db import RETRY_AFTER_S, UNAVAILABLE, unavailable_message
from engine.errors import (
    AdapterConflictError,
    AdapterInvalidError,
    AdapterNotFoundError,
    InvalidSettingsError,
    OutOfScopeError,
    PreflightError,
    RevisionNotFoundError,
    StaleRevisionError,
)
from engine.gateway import model_not_found

ECHO_LIMIT = 200  # characters of a refused input a 422 repeats


def _short(value: Any) -> Any:
    """A refused input as a 422 repeats it: short values as they are, long or nested ones summarised."""
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str):
        return value if len(value) <= ECHO_LIMIT else f"{value[:ECHO_LIMIT]}… ({len(value)} characters)"
    if isinstance(value, dict | list | tuple):  # never repr'd: it may be huge, or nested too deep to repr
        return f"{type(value).__name__} of {len(value)} items"
    return f"{type(value).__name__}"


def database_unavailable(exc: BaseException, reading: bool = False) -> JSONResponse:
    """The answer to a request the database could not serve: 503, Retry-After, what happened and what to do
    (``reading``: a request that changes nothing)."""
    return JSONResponse({"detail": unavailable_message(exc, reading)}, status_code=503,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"type": e.get("type"), "loc": list(e.get("loc", ())), "msg": e.get("msg"),
                   **({"input": _short(e["input"])} if "input" in e else {})} for e in exc.errors()[:50]]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(InvalidSettingsError)
    async def _invalid(_: Request, exc: InvalidSettingsError) -> JSONResponse:
        return JSONResponse({"detail": [{**e, "input": _short(e.get("input"))} for e in exc.errors]},
                            status_code=422)

    @app.exception_handler(PreflightError)
    async def _preflight_refused(_: Request, exc: PreflightError) -> JSONResponse:
        return JSONResponse({"detail": exc.errors}, status_code=422)

    @app.exception_handler(StaleRevisionError)
    async def _stale(_: Request, exc: StaleRevisionError) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "current_revision": exc.current}, status_code=409)

    @app.exception_handler(RevisionNotFoundError)
    async def _missing(_: Request, exc: RevisionNotFoundError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    async def _database(request: Request, exc: Exception) -> JSONResponse:
        # a full disk, a read-only file, a lock held past the timeout, a PostgreSQL server down or restarting: the
        # request's own transaction was rolled back
        return database_unavailable(exc, reading=request.method in ("GET", "HEAD"))

    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, _database)

    @app.exception_handler(OutOfScopeError)
    async def _out_of_scope(_: Request, exc: OutOfScopeError) -> Response:
        return Response(model_not_found(exc.model), status_code=404, media_type="application/json")

    @app.exception_handler(AdapterInvalidError)
    async def _adapter_invalid(_: Request, exc: AdapterInvalidError) -> JSONResponse:
        return JSONResponse({"detail": [{"type": "adapter_invalid", "loc": ["body", exc.field], "msg": exc.reason}]},
                            status_code=422)

    @app.exception_handler(AdapterConflictError)
    async def _adapter_conflict(_: Request, exc: AdapterConflictError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)

    @app.exception_handler(AdapterNotFoundError)
    async def _adapter_missing(_: Request, exc: AdapterNotFoundError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(BenchmarkBusyError)
    async def _busy(_: Request, exc: BenchmarkBusyError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=409)
