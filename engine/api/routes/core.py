"""The engine's control API: status, settings revisions, engine actions, events and logs."""

from __future__ import annotations

import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from engine.api.routes.access import actor
from engine.capacity import Planner, find_model_config, kv_bytes_per_token, load_shape
from engine.db import Event, Revision, Store
from engine.errors import MAX_ID, InvalidSettingsError, PreflightError, RevisionNotFoundError, StaleRevisionError
from engine.revisions import EngineSettings, merge_values, validate_settings
from engine.schemas import EngineState
from engine.serving import Supervisor


def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")


class RevisionOut(BaseModel):
    revision: int
    values: dict[str, Any]
    status: str
    status_reason: str
    author: str
    note: str
    created_at: str
    parent_revision: int | None
    forced: bool
    warnings: list[dict[str, Any]]
    oom_count: int = 0

    @classmethod
    def of(cls, rev: Revision, oom_count: int = 0) -> RevisionOut:
        assert rev.id is not None
        return cls(revision=rev.id, values=rev.values, status=rev.status, status_reason=rev.status_reason,
                   author=rev.author, note=rev.note, created_at=iso(rev.created_at) or "",
                   parent_revision=rev.parent_id, forced=rev.forced, warnings=rev.warnings, oom_count=oom_count)


class SettingsWrite(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    base_revision: int = Field(ge=1, le=MAX_ID, description="The revision these changes were made on; stale → 409.")
    values: dict[str, Any] = Field(description="Fields to change; omitted fields keep the base revision's values.")
    note: str = Field("", max_length=2000, description="Why: shown in the history.")
    force: bool = Field(False, description="Write despite pre-flight errors (recorded as forced; the automatic "
                        "rollback still guards the apply).")


class RollbackRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    revision: int = Field(ge=1, le=MAX_ID, description="Revision whose values become a new desired revision.")
    note: str = Field("", max_length=2000)
    force: bool = False


class EventOut(BaseModel):
    id: int
    ts: str
    kind: str
    severity: str
    message: str
    revision: int | None
    data: dict[str, Any]

    @classmethod
    def of(cls, ev: Event) -> EventOut:
        assert ev.id is not None
        return cls(id=ev.id, ts=iso(ev.ts) or "", kind=ev.kind, severity=ev.severity, message=ev.message,
                   revision=ev.revision_id, data=ev.data)


def _preflight(planner: Planner, settings: EngineSettings, force: bool) -> tuple[bool, list[dict[str, Any]]]:
    """Run pre-flight; refuse on errors unless forced. Returns (forced, findings to record with the revision)."""
    result = planner.check(settings)
    errors: list[dict[str, object]] = [
        {"type": "preflight", "loc": ["body", "values", f.field], "msg": f.message, "code": f.code, "fit": f.fit}
        for f in result.errors]
    if errors and not force:
        raise PreflightError(errors)
    recorded = [{**f.as_dict(), "severity": "warning"} for f in result.warnings]
    recorded += [{**f.as_dict(), "severity": "error", "forced": True} for f in result.errors]
    return bool(errors), recorded


POLLING = re.compile(r'"(?:GET|HEAD) /(?:health|metrics|ping|load)(?:\?\S*)? HTTP/')
LEVELS = {"debug": 0, "info": 1, "warning": 2, "error": 3}
_LEVEL = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")


def filter_log(lines: list[str], *, hide_polling: bool, level: str, contains: str | None) -> list[str]:
    """Lines at ``level`` or above (a line without a level, a traceback's say, has its predecessor's), without
    health and metrics polling if asked, containing ``contains``."""
    least, current, out = LEVELS[level], 1, []
    needle = contains.lower() if contains else None
    for line in lines:
        if m := _LEVEL.search(line[:80]):
            current = 3 if m[1] == "CRITICAL" else LEVELS[m[1].lower()]
        if current < least or (hide_polling and POLLING.search(line)) or (needle and needle not in line.lower()):
            continue
        out.append(line)
    return out


def model_card(values: dict[str, Any], data_dir: Path) -> dict[str, Any] | None:
    """What a client wants to know of the served model, from its config.json (None when it is not on this host)."""
    folder = find_model_config(str(values.get("model") or ""), data_dir)
    if folder is None:
        return None
    try:
        shape = load_shape(folder)
    except (KeyError, ValueError, TypeError, OSError):
        return None
    settings = EngineSettings.model_construct(**values)  # the defaults fill what an old revision lacks
    return {"architecture": ", ".join(shape.architectures) or "unknown", "parameters": shape.parameters(),
            "context_length": int(values.get("max_model_len") or shape.max_position_embeddings),
            "model_max_length": shape.max_position_embeddings, "dtype": shape.dtype,
            "kv_bytes_per_token": kv_bytes_per_token(shape, settings), "layers": shape.layers}


def build_router(store: Store, supervisor: Supervisor, planner: Planner, public_url: str = "",
                 keys_required: bool = False) -> APIRouter:
    router = APIRouter()
    data_dir = supervisor.config.data_dir.resolve()
    roots = supervisor.config.model_roots

    def out(rev: Revision) -> RevisionOut:
        assert rev.id is not None
        return RevisionOut.of(rev, store.oom_counts([rev.id]).get(rev.id, 0))

    @router.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        """The engine process is alive (vLLM may not be)."""
        return {"ok": True}

    @router.get("/readyz", tags=["health"], responses={503: {"description": "vLLM is not ready: state and why"}})
    def readyz() -> Response:
        """vLLM is ready to serve: 200, else 503 with the state and why."""
        ready = supervisor.sm.state == EngineState.READY
        body = {"ready": ready, "state": supervisor.sm.state.value, "reason": supervisor.sm.reason}
        return JSONResponse(body, status_code=200 if ready else 503)

    @router.get("/api/status", tags=["engine"])
    def status() -> dict[str, Any]:
        out = supervisor.status()
        out["since"] = iso(out["since"])
        out["ready_since"] = iso(out["ready_since"])
        return out

    @router.get("/api/settings", tags=["settings"])
    def get_settings() -> RevisionOut:
        """The desired revision."""
        rev = store.desired_revision()
        if rev is None:
            rev = store.get_revision(store.head_revision_id() or 0)
        return out(rev)

    @router.get("/api/settings/schema", tags=["settings"])
    def settings_schema() -> dict[str, Any]:
        """JSON schema of the settings fields, with each field's documentation (for help texts)."""
        return EngineSettings.model_json_schema()

    @router.put("/api/settings", status_code=201, tags=["settings"])
    def put_settings(body: SettingsWrite, request: Request) -> RevisionOut:
        """Write a new revision on top of ``base_revision``; the supervisor applies it with a restart."""
        base = store.get_revision(body.base_revision)
        settings = validate_settings(merge_values(base.values, body.values), data_dir, roots)
        forced, findings = _preflight(planner, settings, body.force)
        rev = store.create_revision(settings.model_dump(), base_revision=body.base_revision,
                                    author=actor(request), note=body.note, forced=forced,
                                    warnings=findings)
        detail = f"base {body.base_revision}" + (" (forced)" if forced else "")
        request.state.audit = _changed(store, rev, base.values, detail + (f"; note: {body.note}" if body.note else ""))
        supervisor.wake()
        return out(rev)

    @router.get("/api/capacity", tags=["settings"])
    def capacity(request: Request) -> dict[str, Any]:
        """Pre-flight for values not saved yet (query parameters, merged onto the desired revision): the
        capacity prediction, errors and warnings, each naming the value that would fit."""
        t0 = time.perf_counter()
        base = store.desired_revision() or store.get_revision(store.head_revision_id() or 0)
        changes: dict[str, Any] = {}
        for key in request.query_params:
            raw = request.query_params.getlist(key)
            changes[key] = raw if key == "extra_args" else (None if raw[-1].lower() in ("", "none", "null")
                                                             else raw[-1])
        settings = validate_settings(merge_values(base.values, changes), data_dir, roots)
        result = planner.check(settings).as_dict()
        eta = supervisor.eta_for(settings.model_dump())
        restart = None if eta is None else {"seconds": eta.total_s, "basis": eta.basis, "samples": eta.samples,
                                            "text": eta.describe()}
        return {"base_revision": base.id, "values": settings.model_dump(), **result, "restart_eta": restart,
                "elapsed_ms": round(1e3 * (time.perf_counter() - t0), 2)}

    @router.get("/api/settings/history", tags=["settings"])
    def history(limit: int = Query(50, ge=1, le=1000),
                before: int | None = Query(None, ge=1, le=MAX_ID)) -> list[RevisionOut]:
        revs = store.history(limit, before)
        ooms = store.oom_counts([r.id for r in revs if r.id is not None])
        return [RevisionOut.of(r, ooms.get(r.id or 0, 0)) for r in revs]

    @router.get("/api/settings/{revision}", tags=["settings"])
    def get_revision(revision: int = PathParam(ge=1, le=MAX_ID)) -> RevisionOut:
        return out(store.get_revision(revision))

    @router.post("/api/settings/rollback", status_code=201, tags=["settings"])
    def rollback(body: RollbackRequest, request: Request) -> RevisionOut:
        """A new desired revision equal to an earlier one."""
        target = store.get_revision(body.revision)
        current = store.desired_revision()
        settings = validate_settings(target.values, data_dir, roots)
        forced, findings = _preflight(planner, settings, body.force)
        rev = store.create_revision(settings.model_dump(), base_revision=None, author=actor(request),
                                    note=body.note or f"rollback to revision {body.revision}", forced=forced,
                                    warnings=findings)
        request.state.audit = _changed(store, rev, current.values if current else {},
                                       f"rollback to revision {body.revision}" + (" (forced)" if forced else ""))
        supervisor.wake()
        return out(rev)

    @router.post("/api/engine/{action}", status_code=202, tags=["engine"])
    def engine_action(action: str, request: Request) -> Response:
        """start | stop | restart vLLM; the state in the answer is the state before the action takes effect."""
        actions = {"start": supervisor.request_start, "stop": supervisor.request_stop,
                   "restart": supervisor.request_restart}
        if action not in actions:
            return JSONResponse({"detail": f"unknown action {action!r}: use start, stop or restart"}, 404)
        before = supervisor.sm.state.value
        actions[action]()
        store.add_event(f"{action}_requested", f"{action} requested by {actor(request)}")
        request.state.audit = {"target": "vLLM", "before": {"state": before}}
        return JSONResponse({"accepted": action, **status()}, status_code=202)

    @router.get("/api/events", tags=["events"])
    def events(since: int = Query(0, ge=0, le=MAX_ID), limit: int = Query(200, ge=1, le=5000),
               kind: list[str] | None = Query(None), newest_first: bool = False) -> list[EventOut]:
        return [EventOut.of(e) for e in store.events(since, limit, kind, newest_first)]

    @router.get("/api/logs", tags=["events"])
    def logs(tail: int = Query(200, ge=0, le=5000),
             hide_polling: bool = Query(False, description="leave out /health and /metrics access lines"),
             level: Literal["debug", "info", "warning", "error"] = Query("debug", description="the least level"),
             contains: str | None = Query(None, max_length=200, description="only lines with this text "
                                          "(case-insensitive)")) -> dict[str, Any]:
        """The last ``tail`` lines of vLLM's output that pass the filters (all runs since the engine started)."""
        lines = filter_log(supervisor.log.tail(5000), hide_polling=hide_polling, level=level, contains=contains)
        return {"lines": lines[-tail:] if tail else [], "path": str(supervisor.log.path)}

    @router.get("/api/logs/download", tags=["events"], response_class=Response, responses={200: {
        "description": "vLLM's current log file", "content": {"text/plain": {}}}})
    def logs_download() -> Response:
        """vLLM's current log file, whole (it rotates at log_max_bytes)."""
        try:
            body = supervisor.log.path.read_bytes()[-supervisor.config.log_max_bytes:]
        except FileNotFoundError:
            body = b""
        return Response(body, media_type="text/plain; charset=utf-8",
                        headers={"Content-Disposition": 'attachment; filename="vllm.log"'})

    @router.get("/api/gateway", tags=["engine"])
    def gateway_info() -> dict[str, Any]:
        """How clients reach the served model: the /v1 base URL, whether an API key is needed, and the model's
        card (architecture, parameters, context length, dtype, KV-cache bytes per token)."""
        rev = supervisor.running or store.desired_revision()
        values = rev.values if rev is not None else {}
        return {"base_url": public_url.rstrip("/") + "/v1", "keys_required": keys_required,
                "served_model": values.get("served_model_name"), "model": model_card(values, data_dir)}

    return router


def _changed(store: Store, rev: Revision, before: dict[str, Any], detail: str) -> dict[str, Any]:
    """Record a new revision's change as an event; return its audit entry (target, before, after, detail)."""
    diff = {k: {"from": before.get(k), "to": v} for k, v in rev.values.items() if before.get(k) != v}
    store.add_event("settings_changed", f"revision {rev.id} by {rev.author}: "
                    + (", ".join(f"{k}={d['to']}" for k, d in diff.items()) or "no change")
                    + (f" ({rev.note})" if rev.note else ""), revision_id=rev.id, data={"diff": diff})
    return {"target": f"revision {rev.id}", "before": {k: d["from"] for k, d in diff.items()},
            "after": {k: d["to"] for k, d in diff.items()}, "detail": detail}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InvalidSettingsError)
    async def _invalid(_: Request, exc: InvalidSettingsError) -> JSONResponse:
        return JSONResponse({"detail": exc.errors}, status_code=422)

    @app.exception_handler(PreflightError)
    async def _preflight_refused(_: Request, exc: PreflightError) -> JSONResponse:
        return JSONResponse({"detail": exc.errors}, status_code=422)

    @app.exception_handler(StaleRevisionError)
    async def _stale(_: Request, exc: StaleRevisionError) -> JSONResponse:
        return JSONResponse({"detail": str(exc), "current_revision": exc.current}, status_code=409)

    @app.exception_handler(RevisionNotFoundError)
    async def _missing(_: Request, exc: RevisionNotFoundError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)
