"""Settings revisions: the desired one, writing and rolling back (with pre-flight), history, and the capacity
check of values not saved yet."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from pydantic import JsonValue

from engine.api.convert import revision_out
from engine.api.deps import (
    ControllerDep,
    NoteDep,
    PlannerDep,
    RevisionsDep,
    WriterDep,
    access,
    actor,
    admin_for_remote_code,
)
from engine.revisions import Change, EngineSettings, merge_values
from engine.schemas import MAX_ID, CapacityOut, RestartEta, RevisionOut, RollbackRequest, SettingsWrite

router = APIRouter(tags=["settings"])


def _out(revisions: RevisionsDep, rev: Any) -> RevisionOut:
    return revision_out(rev, revisions.oom_counts([rev.id]).get(rev.id, 0))


def _note(note: NoteDep, change: Change) -> None:
    note.target, note.before, note.after, note.detail = change.target, change.before, change.after, change.detail


@router.get("/api/settings", response_model=RevisionOut, dependencies=access("viewer"))
def get_settings(revisions: RevisionsDep) -> RevisionOut:
    """The desired revision."""
    rev = revisions.desired_revision() or revisions.get_revision(revisions.head_revision_id() or 0)
    return _out(revisions, rev)


@router.get("/api/settings/schema", response_model=dict[str, JsonValue], dependencies=access("viewer"))
def settings_schema() -> dict[str, Any]:
    """JSON Schema of the settings fields, with each field's documentation (for help texts)."""
    return EngineSettings.model_json_schema()


@router.put("/api/settings", status_code=201, response_model=RevisionOut,
            dependencies=access("operator", "settings.write"))
def put_settings(body: SettingsWrite, request: Request, writer: WriterDep, revisions: RevisionsDep,
                 note: NoteDep) -> RevisionOut:
    """Write a new revision on top of ``base_revision``; the controller applies it with a restart."""
    admin_for_remote_code(request, dict(body.values))
    change = writer.write(body.base_revision, dict(body.values), author=actor(request), note=body.note,
                          force=body.force)
    _note(note, change)
    return _out(revisions, change.revision)


@router.get("/api/capacity", response_model=CapacityOut, dependencies=access("viewer"))
def capacity(request: Request, revisions: RevisionsDep, writer: WriterDep, planner: PlannerDep,
             controller: ControllerDep) -> CapacityOut:
    """Pre-flight for values not saved yet (query parameters, merged onto the desired revision): the capacity
    prediction, errors and warnings, each naming the value that would fit, how long a restart would take, and the
    plan an apply would follow (blue/green, bridge, rolling or pause) with what clients should expect, also for
    values with errors (an apply forced through them runs that plan)."""
    t0 = time.perf_counter()
    base = revisions.desired_revision() or revisions.get_revision(revisions.head_revision_id() or 0)
    changes: dict[str, Any] = {}
    for key in request.query_params:
        raw = request.query_params.getlist(key)
        changes[key] = raw if key == "extra_args" else (None if raw[-1].lower() in ("", "none", "null") else raw[-1])
    settings = writer.validate(merge_values(base.values, changes))
    result = planner.check(settings).as_dict()
    plan = controller.plan_for(settings)  # a forced apply of values with errors runs a plan too: show it
    # the new revision's start, of the kind its apply would run: beside what serves, unless it pauses
    alone = controller.primary is None or (plan is not None and plan.kind in ("pause", "start"))
    eta = controller.eta_for(settings.model_dump(), "alone" if alone else "beside")
    restart = RestartEta(seconds=eta.total_s, basis=eta.basis, samples=eta.samples, text=eta.describe(),
                         kind=eta.kind, note=eta.note())
    return CapacityOut.model_validate({"base_revision": base.id, "values": settings.model_dump(), **result,
                                       "restart_eta": restart, "plan": plan,
                                       "elapsed_ms": round(1e3 * (time.perf_counter() - t0), 2)})


@router.get("/api/settings/history", response_model=list[RevisionOut], dependencies=access("viewer"))
def history(revisions: RevisionsDep, limit: int = Query(50, ge=1, le=1000),
            before: int | None = Query(None, ge=1, le=MAX_ID)) -> list[RevisionOut]:
    """Revisions, newest first."""
    revs = revisions.history(limit, before)
    ooms = revisions.oom_counts([r.id for r in revs if r.id is not None])
    return [revision_out(r, ooms.get(r.id or 0, 0)) for r in revs]


@router.get("/api/settings/{revision}", response_model=RevisionOut, dependencies=access("viewer"))
def get_revision(revisions: RevisionsDep, revision: int = PathParam(ge=1, le=MAX_ID)) -> RevisionOut:
    return _out(revisions, revisions.get_revision(revision))


@router.post("/api/settings/rollback", status_code=201, response_model=RevisionOut,
             dependencies=access("operator", "settings.rollback"))
def rollback(body: RollbackRequest, request: Request, writer: WriterDep, revisions: RevisionsDep,
             note: NoteDep) -> RevisionOut:
    """A new desired revision equal to an earlier one."""
    desired = revisions.desired_revision()
    remote_code_on = desired is not None and bool(desired.values.get("trust_remote_code"))
    if not remote_code_on:  # a rollback that turns it on
        admin_for_remote_code(request, revisions.get_revision(body.revision).values)
    # decided on a desired revision with it on: written only if that is still the desired one (a change that
    # turned it off meanwhile is not undone by who may not turn it on)
    change = writer.rollback(body.revision, author=actor(request), note=body.note, force=body.force,
                             base_revision=desired.id if remote_code_on and desired is not None else None)
    _note(note, change)
    return _out(revisions, change.revision)
