"""The audit trail: append-only, newest first, with filters and export."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from engine.access import AuditLog, bound, to_csv
from engine.api.deps import ServicesDep, access
from engine.db import AuditRecord
from engine.schemas import MAX_ID, AuditOut, AuditTallyOut

router = APIRouter(tags=["access"])


def audit_out(r: AuditRecord) -> AuditOut:
    """A record as the API returns it, bounded again: a row written before records were bounded may hold any
    JSON (a 300-deep list once made the whole listing answer 500)."""
    return AuditOut(id=r.id or 0, ts=r.ts, actor=r.actor, role=r.role, action=r.action, target=r.target,
                    before=bound(r.before) if isinstance(r.before, dict) else None,
                    after=bound(r.after) if isinstance(r.after, dict) else None, source=r.source, result=r.result,
                    detail=r.detail, deployment=r.deployment)


def _query(audit: AuditLog, actor: str | None, action: str | None, target: str | None, since: float | None,
           until: float | None, result: int | None, contains: str | None, limit: int,
           offset: int) -> list[AuditRecord]:
    return list(audit.query(actor=actor, action=action, target=target, since=since, until=until, result=result,
                            text_=contains, limit=limit, offset=offset))


# Annotated, never one Query() as the default of several parameters: FastAPI writes the first parameter's name
# into that object as its alias, and every parameter sharing it then reads that one (?actor=x also filtered the
# target and the text by x, and the export's action read ?actor=).
Actor = Annotated[str | None, Query(max_length=200, description="who acted (exact)")]
Action = Annotated[str | None, Query(max_length=200, description="prefix, e.g. settings")]
Target = Annotated[str | None, Query(max_length=200, description="part of what it acted on")]
Contains = Annotated[str | None, Query(max_length=200, description="text in the target, before, after or detail")]


@router.get("/api/audit", response_model=list[AuditOut], dependencies=access("operator"))
def audit_trail(svc: ServicesDep, actor: Actor = None, action: Action = None, target: Target = None,
                since: float | None = Query(None, ge=0, le=1e11), until: float | None = Query(None, ge=0, le=1e11),
                result: int | None = Query(None, ge=0, le=999), contains: Contains = None,
                limit: int = Query(200, ge=1, le=10_000), offset: int = Query(0, ge=0, le=MAX_ID)) -> list[AuditOut]:
    """The append-only audit trail, newest first, with filters (times as Unix seconds)."""
    return [audit_out(r) for r in _query(svc.audit, actor, action, target, since, until, result, contains, limit,
                                         offset)]


@router.get("/api/audit/export", response_class=Response, dependencies=access("operator"), responses={200: {
    "description": "The filtered trail as a file", "content": {"text/csv": {}, "application/json": {}}}})
def audit_export(svc: ServicesDep, format: Literal["csv", "json"] = "csv", actor: Actor = None,
                 action: Action = None, target: Target = None,
                 since: float | None = Query(None, ge=0, le=1e11), until: float | None = Query(None, ge=0, le=1e11),
                 result: int | None = Query(None, ge=0, le=999), contains: Contains = None,
                 limit: int = Query(100_000, ge=1, le=1_000_000)) -> Response:
    rows = _query(svc.audit, actor, action, target, since, until, result, contains, limit, 0)
    if format == "json":
        body = json.dumps([audit_out(r).model_dump() for r in rows], indent=1, default=str)
        return Response(body, media_type="application/json",
                        headers={"Content-Disposition": 'attachment; filename="audit.json"'})
    return Response(to_csv(rows), media_type="text/csv",
                    headers={"Content-Disposition": 'attachment; filename="audit.csv"'})


@router.get("/api/audit/tallies", response_model=list[AuditTallyOut], dependencies=access("operator"))
def audit_tallies(svc: ServicesDep, since: float | None = Query(None, ge=0, le=1e11),
                  until: float | None = Query(None, ge=0, le=1e11),
                  source: Annotated[str | None, Query(max_length=100, description="client address (exact)")] = None,
                  action: Action = None, target: Target = None, result: int | None = Query(None, ge=0, le=999),
                  limit: int = Query(500, ge=1, le=10_000)) -> list[AuditTallyOut]:
    """Refused requests without a valid credential (failed sign-ins, calls without a token, unknown routes…),
    counted per minute, source, action, target and result; newest minute first."""
    rows = svc.tallies.query(since=since, until=until, source=source, action=action, target=target, result=result,
                             limit=limit)
    return [AuditTallyOut.model_validate(r, from_attributes=True) for r in rows]
