"""Teams (admins manage them; operators see them) and usage you can bill (operators see everyone's; anyone else
the usage of the keys they own and of their team's)."""

from __future__ import annotations

import time
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi import Path as PathParam
from sqlmodel import select

from engine.access import LIMIT_FIELDS, TeamError, Teams, allows
from engine.api.deps import NoteDep, PrincipalDep, ServicesDep, access
from engine.api.services import Services
from engine.db import ApiToken, Team, User
from engine.gateway.usage import Usage, UsageSum, to_csv
from engine.schemas import BudgetOut, TeamIn, TeamOut, TeamPatch, UsageGroup, UsageOut, UsageRow

router = APIRouter(tags=["access"])
TEAM_PATH = PathParam(min_length=1, max_length=100)
MAX_DAYS = 3660  # the longest window one usage answer covers


def team_out(svc: Services, team: Team, keys: dict[int, int], members: dict[int, list[str]]) -> TeamOut:
    out = TeamOut.model_validate(team, from_attributes=True)
    assert team.id is not None
    out.keys, out.members = keys.get(team.id, 0), members.get(team.id, [])
    if team.token_budget is not None and team.budget_period in ("day", "month") and svc.key_limits is not None:
        used, reserved, resets_at = svc.key_limits.budget_now("team", team.id, team.budget_period)
        out.budget = BudgetOut(limit=team.token_budget, period=team.budget_period,
                               used=used, reserved=reserved, resets_at=resets_at)
    return out


def _refused(exc: TeamError) -> HTTPException:
    if exc.missing:
        return HTTPException(404, detail=str(exc))
    return HTTPException(422, detail=[{"loc": ["body", exc.field or ""], "msg": str(exc), "type": "value_error"}])


def _changed(svc: Services) -> None:
    if svc.key_limits is not None:
        svc.key_limits.changed()


@router.get("/api/teams", response_model=list[TeamOut], dependencies=access("operator"))
def teams(svc: ServicesDep) -> list[TeamOut]:
    """Teams with their limits, keys, members and budget's state now."""
    store = Teams(svc.db)
    keys, members = store.key_counts(), store.members()
    return [team_out(svc, t, keys, members) for t in store.all()]


@router.post("/api/teams", status_code=201, response_model=TeamOut, dependencies=access("admin", "teams.create"))
def create_team(body: TeamIn, svc: ServicesDep, principal: PrincipalDep, note: NoteDep) -> TeamOut:
    """A new team: its limits hold for all its keys together (each key's own limits too)."""
    values = {f: getattr(body, f) for f in LIMIT_FIELDS}
    try:
        team = Teams(svc.db).create(body.name, values, body.note, principal.name)
    except TeamError as exc:
        raise _refused(exc) from None
    note.target, note.after = f"team {team.name}", {**values, "note": body.note}
    return team_out(svc, team, {}, {})


@router.patch("/api/teams/{name}", response_model=TeamOut, dependencies=access("admin", "teams.update"))
def update_team(body: TeamPatch, svc: ServicesDep, note: NoteDep, name: str = TEAM_PATH) -> TeamOut:
    """Change a team's limits, weight or note (only the fields sent; null clears a limit): in effect for its keys'
    next requests."""
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    for field in ("weight", "note"):
        if field in changes and changes[field] is None:
            raise HTTPException(422, detail=[{"loc": ["body", field], "type": "value_error",
                                              "msg": f"{field} cannot be null"}])
    note.target = f"team {name}"
    store = Teams(svc.db)
    try:
        before, team = store.update(name, changes)
    except TeamError as exc:
        raise _refused(exc) from None
    _changed(svc)
    note.before, note.after = {f: before[f] for f in changes}, changes
    return team_out(svc, team, store.key_counts(), store.members())


@router.delete("/api/teams/{name}", response_model=TeamOut, dependencies=access("admin", "teams.delete"))
def delete_team(svc: ServicesDep, note: NoteDep, name: str = TEAM_PATH) -> TeamOut:
    """Delete a team: its keys and users belong to no team after (each key's own limits stay); its usage stays
    in the records, under its id."""
    note.target = f"team {name}"
    try:
        team, keys, users = Teams(svc.db).delete(name)
    except TeamError as exc:
        raise _refused(exc) from None
    _changed(svc)
    note.after = {"deleted": True, "keys": keys, "users": users}
    return team_out(svc, team, {}, {})


def _day(text: str | None, default: date, field: str) -> date:
    if text is None:
        return default
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise HTTPException(422, detail=[{"loc": ["query", field], "type": "value_error",
                                          "msg": "a day as YYYY-MM-DD (UTC)"}]) from None


def _own(svc: Services, user_id: int | None) -> tuple[list[int], list[int]]:
    """The keys a user owns and their team (what a non-operator's usage shows)."""
    with svc.db.read() as s:
        keys = [i for i in s.exec(select(ApiToken.id).where(ApiToken.user_id == user_id)).all()
                if i is not None] if user_id is not None else []
        user = s.get(User, user_id) if user_id is not None else None
        return keys, [user.team_id] if user is not None and user.team_id is not None else []


Day = Annotated[str | None, Query(max_length=10, description="YYYY-MM-DD (UTC)")]


@router.get("/api/usage", response_model=UsageOut, dependencies=access("viewer"),
            responses={200: {"content": {"application/json": {}, "text/csv": {}}}})
def usage(svc: ServicesDep, principal: PrincipalDep, group_by: UsageGroup = "key", since: Day = None,
          until: Day = None, format: Literal["json", "csv"] = "json") -> UsageOut | Response:
    """Requests and tokens (prompt, completion) per key, team, deployment or day over ``since``..``until``
    (inclusive, UTC days; default: the last 30), with their cost by each deployment's price per 1,000 tokens.
    Operators see every key's; anyone else the keys they own and their team's. ``format=csv`` for a file."""
    today = datetime.fromtimestamp(time.time(), UTC).date()
    last = _day(until, today, "until")
    first = _day(since, last - timedelta(days=29), "since")
    if first > last:
        raise HTTPException(422, detail=[{"loc": ["query", "since"], "type": "value_error",
                                          "msg": "since is after until"}])
    if (last - first).days >= MAX_DAYS:
        raise HTTPException(422, detail=[{"loc": ["query", "since"], "type": "value_error",
                                          "msg": f"at most {MAX_DAYS} days at once"}])
    everyone = allows(principal.role, "operator")
    keys, teams_ = (None, None) if everyone else _own(svc, principal.user_id)
    rows, total = Usage(svc.db).query(group_by, first.isoformat(), last.isoformat(), keys, teams_)
    if format == "csv":
        return Response(to_csv(rows, total, group_by), media_type="text/csv", headers={
            "Content-Disposition": f'attachment; filename="usage-{group_by}-{first}-{last}.csv"'})
    return UsageOut(group_by=group_by, since=first.isoformat(), until=last.isoformat(),
                    rows=[_row(r) for r in rows], total=_row(total), scope="all" if everyone else "own")


def _row(r: UsageSum) -> UsageRow:
    return UsageRow(group=r.group, id=r.id, requests=r.requests, failed=r.failed, input_tokens=r.input_tokens,
                    output_tokens=r.output_tokens, cost=None if r.cost is None else round(r.cost, 6))
