"""Sign-in, users and tokens. Roles, each including the ones before it: viewer, prompter, operator, admin."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request
from fastapi import Path as PathParam

from engine.access import (
    LIMIT_FIELDS,
    AuthError,
    BadCredentialsError,
    HashBusyError,
    LastAdminError,
    LockedError,
    OwnerGoneError,
    TeamError,
    Teams,
    UnknownUserError,
    allows,
    check_budget,
    token_state,
)
from engine.api.deps import AuthDep, DeploymentsDep, NoteDep, PrincipalDep, ServicesDep, access
from engine.api.gate import bearer_of
from engine.api.services import Services
from engine.db import ApiToken, User
from engine.schemas import (
    MAX_ID,
    ROLES,
    BudgetOut,
    LoginRequest,
    MeOut,
    OkOut,
    SessionOut,
    SsoRequest,
    TokenCreatedOut,
    TokenIn,
    TokenOut,
    TokenPatch,
    UserDeletedOut,
    UserIn,
    UserOut,
    UserPatch,
    shown,
)

router = APIRouter(tags=["access"])
USERNAME_PATH = PathParam(min_length=1, max_length=64)


def user_out(u: User, teams: dict[int, str] | None = None) -> UserOut:
    out = UserOut.model_validate(u, from_attributes=True)
    if u.team_id is not None:
        out.team = (teams or {}).get(u.team_id, f"deleted team {u.team_id}")
    return out


def token_out(t: ApiToken, owners: dict[int, str] | None = None, teams: dict[int, str] | None = None,
              svc: Services | None = None) -> TokenOut:
    out = TokenOut.model_validate(t, from_attributes=True)
    out.state = token_state(t)
    if t.user_id is not None:
        out.owner = (owners or {}).get(t.user_id, f"deleted user {t.user_id}")
    if t.team_id is not None:
        out.team = (teams or {}).get(t.team_id, f"deleted team {t.team_id}")
    if svc is not None and t.id is not None and t.token_budget is not None and t.budget_period is not None:
        out.budget = budget_out(svc, "key", t.id, t.token_budget, t.budget_period)
    return out


def budget_out(svc: Services, scope: str, scope_id: int, limit: int, period: str) -> BudgetOut | None:
    """A budget's state: the gateway's count when it has seen the key or team this period, else the store's."""
    if svc.key_limits is None or period not in ("day", "month"):
        return None
    used, reserved, resets_at = svc.key_limits.budget_now(scope, scope_id, period)
    return BudgetOut(limit=limit, period=period, used=used, reserved=reserved,
                     resets_at=resets_at)


def _limits_refused(exc: TeamError) -> HTTPException:
    if exc.missing:
        return HTTPException(404, detail=str(exc))
    return HTTPException(422, detail=[{"loc": ["body", exc.field or ""], "msg": str(exc), "type": "value_error"}])


def _refused(exc: AuthError) -> HTTPException:
    """A user change refused: 404 for no such user, 409 for the last admin, else 422 naming the field."""
    if isinstance(exc, UnknownUserError):
        return HTTPException(404, detail=str(exc))
    if isinstance(exc, LastAdminError):
        return HTTPException(409, detail=str(exc))
    return HTTPException(422, detail=[{"loc": ["body"], "msg": str(exc), "type": "value_error"}])


@router.post("/api/auth/login", response_model=SessionOut, dependencies=access(None, "auth.login", when_disk_low=True),
             responses={401: {"description": "unknown user or wrong password"}, 423: {"description": "locked"},
                        429: {"description": "too many sign-ins at once: try again after Retry-After seconds"}})
async def login(body: LoginRequest, request: Request, auth: AuthDep, note: NoteDep) -> SessionOut:
    """A session token for the console (expires; repeated failures lock the user out for a while). Its password
    check runs on the engine's few hashing threads; when they and their queue are full: 429 with Retry-After."""
    note.target, note.after = f"user {body.username}", {"username": body.username, "password": "[redacted]"}
    try:
        source = getattr(request.state, "source", None) or (request.client.host if request.client else "")
        token, row, user = await auth.login_async(body.username, body.password, source)
    except HashBusyError as exc:
        raise HTTPException(429, detail=str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
    except LockedError as exc:
        raise HTTPException(423, detail=str(exc)) from None
    except BadCredentialsError as exc:
        raise HTTPException(401, detail=str(exc)) from None
    note.role = user.role
    return SessionOut(token=token, username=user.username, role=user.role, expires_at=row.expires_at)


@router.post("/api/auth/sso", response_model=SessionOut, dependencies=access("viewer", "auth.sso", when_disk_low=True),
             responses={403: {"description": "not the console's single sign-on credential (kind sso)"},
                        404: {"description": "no enabled user of that name"}, 423: {"description": "locked out"}})
def sso(body: SsoRequest, auth: AuthDep, principal: PrincipalDep, note: NoteDep) -> SessionOut:
    """For the console's single sign-on credential (a token of kind sso, ``LLMOPS_CONSOLE_TOKEN``) once the identity
    provider has signed a user in: a session for that existing, enabled, not locked-out user. Any other credential,
    an admin's included, gets 403: a session for someone else is not an admin's to mint. The session names the
    credential and ends when it is revoked."""
    note.target = f"user {body.username}"
    if principal.kind != "sso":
        raise HTTPException(403, detail="only the console's single sign-on credential (a token of kind sso, "
                            "`llmops token create --kind sso`) opens sessions for others")
    try:
        token, row, user = auth.session_for(body.username, principal)
    except LockedError as exc:
        raise HTTPException(423, detail=str(exc)) from None
    except AuthError as exc:
        raise HTTPException(404, detail=str(exc)) from None
    note.target, note.after = f"user {user.username}", {"session": "single sign-on"}
    return SessionOut(token=token, username=user.username, role=user.role, expires_at=row.expires_at)


@router.post("/api/auth/logout", response_model=OkOut, dependencies=access("viewer", "auth.logout", when_disk_low=True))
def logout(request: Request, auth: AuthDep) -> OkOut:
    """End this token's session."""
    token = bearer_of(request.scope)
    if token:
        auth.revoke(token=token)
    return OkOut()


@router.get("/api/auth/me", response_model=MeOut, dependencies=access("viewer"))
def me(principal: PrincipalDep) -> MeOut:
    """Who this token stands for, and the roles it includes."""
    return MeOut(name=principal.name, role=principal.role, kind=principal.kind,
                 roles=[r for r in ROLES if allows(principal.role, r)])


@router.get("/api/users", response_model=list[UserOut], dependencies=access("admin"))
def users(auth: AuthDep) -> list[UserOut]:
    teams = Teams(auth.db).names()
    return [user_out(u, teams) for u in auth.users()]


@router.post("/api/users", status_code=201, response_model=UserOut, dependencies=access("admin", "users.create"))
def create_user(body: UserIn, auth: AuthDep, note: NoteDep) -> UserOut:
    try:
        user = auth.create_user(body.username, body.password, body.role)
    except AuthError as exc:
        raise HTTPException(422, detail=[{"loc": ["body"], "msg": str(exc), "type": "value_error"}]) from None
    note.target, note.after = f"user {user.username}", {"role": user.role}
    return user_out(user)


@router.patch("/api/users/{username}", response_model=UserOut, dependencies=access("admin", "users.update"),
              responses={409: {"description": "the last enabled admin cannot be disabled or demoted"}})
def update_user(body: UserPatch, auth: AuthDep, note: NoteDep, username: str = USERNAME_PATH) -> UserOut:
    """Change a user's role, password or access. Disabling or demoting them revokes every token and gateway key
    they own at once (on /v1 within the key cache's 5 s when done by another process); a new password ends
    their sessions."""
    note.target = f"user {username}"
    before = next((u for u in auth.users() if u.username == username), None)
    if before is None:
        raise HTTPException(404, detail=f"no user {username!r}")
    teams = Teams(auth.db)
    if "team" in body.model_fields_set and body.team is not None:
        try:
            teams.team_id(body.team)
        except TeamError as exc:
            raise HTTPException(422, detail=[{"loc": ["body", "team"], "msg": str(exc), "type": "value_error"}]
                                ) from None
    try:
        user, revoked = auth.update_user(username, role=body.role, password=body.password, disabled=body.disabled)
        if "team" in body.model_fields_set:
            _, user = teams.set_user(username, body.team)
    except TeamError as exc:
        raise _limits_refused(exc) from None
    except AuthError as exc:
        raise _refused(exc) from None
    names = teams.names()
    note.before = {"role": before.role, "disabled": before.disabled,
                   **({"team": names.get(before.team_id or 0)} if "team" in body.model_fields_set else {})}
    note.after = {"role": user.role, "disabled": user.disabled, "password_changed": body.password is not None,
                  "tokens_revoked": revoked, **({"team": body.team} if "team" in body.model_fields_set else {})}
    return user_out(user, names)


@router.delete("/api/users/{username}", response_model=UserDeletedOut, dependencies=access("admin", "users.delete"),
               responses={409: {"description": "the last enabled admin cannot be deleted"}})
def delete_user(auth: AuthDep, note: NoteDep, username: str = USERNAME_PATH) -> UserDeletedOut:
    """Delete a user: their sign-in, sessions, API tokens and gateway keys end at once; their audit records stay."""
    note.target = f"user {username}"
    try:
        user, revoked = auth.delete_user(username)
    except AuthError as exc:
        raise _refused(exc) from None
    note.before = {"role": user.role, "disabled": user.disabled}
    note.after = {"deleted": True, "tokens_revoked": revoked}
    return UserDeletedOut(username=user.username, role=user.role, tokens_revoked=revoked)


@router.get("/api/tokens", response_model=list[TokenOut], dependencies=access("admin"))
def tokens(auth: AuthDep, svc: ServicesDep) -> list[TokenOut]:
    """API tokens and gateway keys (never their values; console sessions are not listed), with each key's team,
    limits and budget's state."""
    owners = {u.id: u.username for u in auth.users() if u.id is not None}
    teams = Teams(auth.db).names()
    return [token_out(t, owners, teams, svc) for t in auth.tokens()]


@router.post("/api/tokens", status_code=201, response_model=TokenCreatedOut,
             dependencies=access("admin", "tokens.create"))
def create_token(body: TokenIn, auth: AuthDep, principal: PrincipalDep, note: NoteDep,
                 deployments: DeploymentsDep, svc: ServicesDep) -> TokenCreatedOut:
    """A new token: the answer holds its only copy. It belongs to the user who asked (or to the owner of the
    token that asked), or to ``owner``: disabling, demoting or deleting them revokes it. A gateway key may be
    limited to some deployments (``deployments``, by name, each one that exists), belong to a team, and have
    limits on tokens (per minute, a budget per day or month) and a weight in fair queues."""
    limits: dict[str, object] = {}
    teams = Teams(auth.db)
    asked = {f: getattr(body, f) for f in ("team", *LIMIT_FIELDS) if f in body.model_fields_set
             and getattr(body, f) is not None and f != "rate_limit_per_min"}
    if asked and body.kind != "gateway":
        field = next(iter(asked))
        raise HTTPException(422, detail=[{"loc": ["body", field], "type": "value_error",
                                          "msg": "only a gateway key (kind gateway) has a team and token limits"}])
    try:
        check_budget(asked)
        if body.team is not None:
            limits["team_id"] = teams.team_id(body.team)
    except TeamError as exc:
        raise HTTPException(422, detail=[{"loc": ["body", exc.field or "team"], "msg": str(exc),
                                          "type": "value_error"}]) from None
    limits.update({f: v for f, v in asked.items() if f != "team"})
    owner_id = principal.user_id
    if body.owner is not None:
        found = next((u for u in auth.users() if u.username == body.owner and not u.disabled), None)
        if found is None:
            raise HTTPException(422, detail=[{"loc": ["body", "owner"], "type": "value_error",
                                              "msg": f"no enabled user {shown(body.owner)}"}])
        owner_id = found.id
    limited = None
    if body.deployments is not None:
        if body.kind != "gateway":
            raise HTTPException(422, detail=[{"loc": ["body", "deployments"], "type": "value_error",
                                              "msg": "only a gateway key (kind gateway) is limited to deployments"}])
        known = {d.name for d in deployments.all()}
        if unknown := [n for n in body.deployments if n not in known]:
            raise HTTPException(422, detail=[{"loc": ["body", "deployments"], "type": "value_error",
                                              "msg": f"no deployment named {shown(unknown[0])} (GET /api/deployments "
                                              "lists them)"}])
        limited = list(dict.fromkeys(body.deployments))
    try:
        token, row = auth.create_token(body.name, body.role, body.kind, principal.name,
                                       ttl_s=body.expires_days * 86400 if body.expires_days else None,
                                       rate_limit_per_min=body.rate_limit_per_min, owner_id=owner_id,
                                       deployments=limited, limits=limits)
    except OwnerGoneError as exc:
        raise HTTPException(401, detail=str(exc)) from None
    except AuthError as exc:
        raise _refused(exc) from None
    note.target, note.after = f"token {row.id} {row.name}", {"role": row.role, "kind": row.kind, "prefix": row.prefix,
                                                            **({"deployments": limited} if limited else {}),
                                                            **asked, **({"owner": body.owner} if body.owner else {}),
                                                            **({"rate_limit_per_min": body.rate_limit_per_min}
                                                               if body.rate_limit_per_min else {})}
    owners = {u.id: u.username for u in auth.users() if u.id == row.user_id and u.id is not None}
    return TokenCreatedOut(**token_out(row, owners, teams.names(), svc).model_dump(), token=token)


@router.patch("/api/tokens/{token_id}", response_model=TokenOut, dependencies=access("admin", "tokens.update"))
def update_token(body: TokenPatch, auth: AuthDep, svc: ServicesDep, note: NoteDep,
                 token_id: int = PathParam(ge=1, le=MAX_ID)) -> TokenOut:
    """Change a gateway key's team, limits (null clears one) or weight: in effect for its next request on every
    gateway worker (another process's edit: within limit_cache_s)."""
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    if changes.get("weight", 0) is None:
        raise HTTPException(422, detail=[{"loc": ["body", "weight"], "type": "value_error",
                                          "msg": "weight: a number above 0 (1: an equal share)"}])
    teams = Teams(auth.db)
    try:
        before, row = teams.set_key(token_id, changes)
    except TeamError as exc:
        raise _limits_refused(exc) from None
    auth.changes += 1  # (the key's cached principal: its rate limit)
    if svc.key_limits is not None:
        svc.key_limits.changed()
    names = teams.names()
    shown_before = {("team" if f == "team_id" else f): (names.get(v, v) if f == "team_id" and v else v)
                    for f, v in before.items() if f in changes or (f == "team_id" and "team" in changes)}
    note.target = f"token {row.id} {row.name}"
    note.before, note.after = shown_before, changes
    owners = {u.id: u.username for u in auth.users() if u.id == row.user_id and u.id is not None}
    return token_out(row, owners, names, svc)


@router.delete("/api/tokens/{token_id}", response_model=TokenOut, dependencies=access("admin", "tokens.revoke"))
def revoke_token(auth: AuthDep, note: NoteDep, token_id: int = PathParam(ge=1, le=MAX_ID)) -> TokenOut:
    try:
        row = auth.revoke(token_id=token_id)
    except AuthError:
        raise HTTPException(404, detail=f"no token {token_id}") from None
    note.target, note.after = f"token {row.id} {row.name}", {"revoked": True}
    return token_out(row)
