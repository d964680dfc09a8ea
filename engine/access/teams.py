"""Teams and the limits of gateway keys, in the store: a team groups keys and users; its limits hold for all its
keys together, its weight is its share of a deployment at capacity. Every change here is audited by the route that
asks for it (engine/api/routes/teams.py); the gateway reads limits through engine.gateway.KeyLimits."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlmodel import Session, col, func, select

from engine.access.auth import AuthError, skeleton
from engine.db import ApiToken, Database, Team, User
from engine.schemas import check_name

LIMIT_FIELDS = ("rate_limit_per_min", "tokens_per_minute", "token_budget", "budget_period", "weight")


class TeamError(AuthError):
    """A team change refused: ``field`` names what is wrong (422), or the team or key does not exist (404)."""

    def __init__(self, message: str, field: str | None = None, missing: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.missing = missing


def check_budget(values: dict[str, Any]) -> None:
    """A token budget needs its period, and a period its budget."""
    if values.get("token_budget") is not None and values.get("budget_period") is None:
        raise TeamError("a token_budget needs its budget_period: day or month", "budget_period")
    if values.get("budget_period") is not None and values.get("token_budget") is None:
        raise TeamError("a budget_period needs a token_budget", "token_budget")


def limits_of(row: Team | ApiToken) -> dict[str, Any]:
    return {f: getattr(row, f) for f in LIMIT_FIELDS}


class Teams:
    def __init__(self, db: Database) -> None:
        self.db = db

    def all(self) -> Sequence[Team]:
        with self.db.read() as s:
            return s.exec(select(Team).order_by(col(Team.id))).all()

    def names(self) -> dict[int, str]:
        with self.db.read() as s:
            return {i: n for i, n in s.exec(select(Team.id, Team.name)).all() if i is not None}

    def members(self) -> dict[int, list[str]]:
        """Each team's users."""
        out: dict[int, list[str]] = {}
        with self.db.read() as s:
            for team_id, name in s.exec(select(User.team_id, User.username).where(col(User.team_id).is_not(None))):
                if team_id is not None:
                    out.setdefault(team_id, []).append(name)
        return out

    def key_counts(self) -> dict[int, int]:
        """Active gateway keys per team."""
        with self.db.read() as s:
            rows = s.exec(select(ApiToken.team_id, func.count()).where(
                col(ApiToken.team_id).is_not(None), col(ApiToken.revoked_at).is_(None)).group_by(
                col(ApiToken.team_id))).all()
            return {t: int(n) for t, n in rows if t is not None}

    @staticmethod
    def _get(s: Session, name: str) -> Team:
        team = s.exec(select(Team).where(Team.name == name)).first()
        if team is None:
            raise TeamError(f"no team named {name!r} (GET /api/teams lists them)", missing=True)
        return team

    def team_id(self, name: str) -> int:
        with self.db.session() as s:
            team_id = self._get(s, name).id
            assert team_id is not None
            return team_id

    def create(self, name: str, values: dict[str, Any], note: str, created_by: str) -> Team:
        try:
            check_name(name)
        except ValueError as exc:
            raise TeamError(f"name: {exc}", "name") from None
        check_budget(values)
        with self.db.session() as s:
            for (existing,) in s.execute(select(Team.name)).all():
                if existing.casefold() == name.casefold() or skeleton(existing) == skeleton(name):
                    raise TeamError(f"a team named {existing!r} exists (or one that reads alike): choose another "
                                    "name", "name")
            team = Team(name=name, note=note, created_by=created_by, **values)
            s.add(team)
            s.flush()
            return team

    def update(self, name: str, changes: dict[str, Any]) -> tuple[dict[str, Any], Team]:
        """Change the fields in ``changes`` (None clears a limit); (its limits before, the team after)."""
        with self.db.session() as s:
            team = self._get(s, name)
            before = {**limits_of(team), "note": team.note}
            merged = {**limits_of(team), **changes}
            check_budget(merged)
            for field_name, value in changes.items():
                setattr(team, field_name, value)
            s.add(team)
            s.flush()
            return before, team

    def delete(self, name: str) -> tuple[Team, int, int]:
        """Delete a team: its keys and users belong to none after (their own limits stay). (the team, keys,
        users)."""
        with self.db.session() as s:
            team = self._get(s, name)
            keys = s.exec(select(ApiToken).where(ApiToken.team_id == team.id)).all()
            users = s.exec(select(User).where(User.team_id == team.id)).all()
            for row in [*keys, *users]:
                row.team_id = None
                s.add(row)
            s.delete(team)
            return team, len([k for k in keys if k.revoked_at is None]), len(users)

    def set_key(self, token_id: int, changes: dict[str, Any]) -> tuple[dict[str, Any], ApiToken]:
        """Change a gateway key's team (by name in ``changes["team"]``; None: none) and limits; (before, after)."""
        with self.db.session() as s:
            row = s.get(ApiToken, token_id)
            if row is None or row.kind == "session":
                raise TeamError(f"no token {token_id}", missing=True)
            if row.kind != "gateway":
                raise TeamError("only a gateway key (kind gateway) has a team and token limits", "kind")
            before = {**limits_of(row), "team_id": row.team_id}
            changes = dict(changes)
            if "team" in changes:
                team = changes.pop("team")
                changes["team_id"] = self._get(s, team).id if team is not None else None
            check_budget({**limits_of(row), **changes})
            for field_name, value in changes.items():
                setattr(row, field_name, value)
            s.add(row)
            s.flush()
            return before, row

    def set_user(self, username: str, team: str | None) -> tuple[int | None, User]:
        with self.db.session() as s:
            user = s.exec(select(User).where(User.username == username)).first()
            if user is None:
                raise TeamError(f"no user {username!r}", missing=True)
            before = user.team_id
            user.team_id = self._get(s, team).id if team is not None else None
            s.add(user)
            s.flush()
            return before, user
