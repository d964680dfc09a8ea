"""Access control of the engine's HTTP service, and the routes of sign-in, users, tokens and the audit trail.

Every /api route needs a bearer token whose role is high enough (``RULES``: the first match wins; an unlisted
route needs admin); /healthz, /readyz and sign-in are open. The /v1 gateway needs an API key only when
``gateway_keys`` says so (by default: when the engine listens beyond loopback), with a per-key rate limit.
"""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict, deque
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field

from engine.access import (
    ROLES,
    ApiToken,
    AuditLog,
    AuditRecord,
    Auth,
    AuthError,
    BadCredentialsError,
    LockedError,
    Principal,
    User,
    allows,
    to_csv,
)
from engine.errors import MAX_ID

RULES: list[tuple[str, re.Pattern[str], str | None]] = [
    ("GET", re.compile(r"^/(healthz|readyz)$"), None),
    ("POST", re.compile(r"^/api/auth/login$"), None),
    ("*", re.compile(r"^/api/auth/(logout|me)$"), "viewer"),
    ("*", re.compile(r"^/api/(users|tokens)\b"), "admin"),
    ("GET", re.compile(r"^/api/audit\b"), "operator"),
    ("*", re.compile(r"^/api/prompts\b"), "prompter"),
    ("GET", re.compile(r"^/api/"), "viewer"),
    ("GET", re.compile(r"^/metrics$"), "viewer"),
    ("*", re.compile(r"^/api/(settings|engine|benchmarks)\b"), "operator"),
]


RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "The body could not be read as JSON"},
    401: {"description": "No valid bearer token (missing, unknown, revoked or expired)"},
    403: {"description": "The token's role may not do this"},
    404: {"description": "No such revision, run, prompt, user or token"},
    409: {"description": "Conflict: a stale base revision, or a benchmark already running"},
    423: {"description": "Sign-in locked after repeated failures"},
}


def required_role(method: str, path: str) -> str | None:
    """The role a request needs: None for open routes, admin for anything the rules do not name."""
    for m, pattern, role in RULES:
        if (m == "*" or m == method) and pattern.match(path):
            return role
    return "admin"


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None


def actor(request: Request) -> str:
    """Who acts: the authenticated principal (no body field or header can claim another name)."""
    principal: Principal | None = getattr(request.state, "principal", None)
    return principal.name if principal is not None else "api"


class Access:
    def __init__(self, auth: Auth, gateway_keys: bool) -> None:
        self.auth = auth
        self.gateway_keys = gateway_keys
        self._windows: dict[int, deque[float]] = defaultdict(deque)
        self._windows_lock = threading.Lock()  # the dependency runs in FastAPI's thread pool

    def authorize(self, request: Request) -> Principal | None:
        """FastAPI dependency of the /api routes (and /metrics)."""
        needed = required_role(request.method, request.url.path)
        if needed is None:
            return None
        token = bearer(request)
        principal = self.auth.authenticate(token) if token else None
        if principal is None:
            raise HTTPException(401, detail="a valid bearer token is needed: sign in, or create a token with "
                                "`llmops token create`", headers={"WWW-Authenticate": "Bearer"})
        request.state.principal = principal
        if principal.kind == "gateway":
            raise HTTPException(403, detail="a gateway API key serves /v1 only")
        if not allows(principal.role, needed):
            raise HTTPException(403, detail=f"role {principal.role} may not {request.method} {request.url.path}: "
                                f"it needs {needed}")
        return principal

    def authorize_gateway(self, request: Request) -> Principal | None:
        """FastAPI dependency of /v1: an API key (or a prompter's token) when keys are required; rate limits."""
        if not self.gateway_keys:
            return None
        token = bearer(request)
        principal = self.auth.authenticate(token) if token else None
        if principal is None or (principal.kind != "gateway" and not allows(principal.role, "prompter")):
            raise HTTPException(401, detail="this gateway needs an API key: Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})
        limit = principal.rate_limit_per_min
        if limit and principal.token_id is not None:
            with self._windows_lock:  # check and count as one step, or a burst slips past the limit
                window = self._windows[principal.token_id]
                now = time.monotonic()
                while window and now - window[0] > 60:
                    window.popleft()
                full = len(window) >= limit
                retry = max(1, int(60 - (now - window[0])) + 1) if full else 0
                if not full:
                    window.append(now)
            if full:
                raise HTTPException(429, detail=f"rate limit of {limit} requests per minute for this key",
                                    headers={"Retry-After": str(retry)})
        return principal


class LoginRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=1024)


class SsoRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    username: str = Field(min_length=1, max_length=64)


class UserIn(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=10, max_length=1024)
    role: Literal["viewer", "prompter", "operator", "admin"] = "viewer"


class UserPatch(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    role: Literal["viewer", "prompter", "operator", "admin"] | None = None
    password: str | None = Field(None, min_length=10, max_length=1024)
    disabled: bool | None = None


class TokenIn(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    name: str = Field(min_length=1, max_length=100)
    role: Literal["viewer", "prompter", "operator", "admin"] = "viewer"
    kind: Literal["api", "gateway"] = "api"
    expires_days: float | None = Field(None, gt=0, le=3650)
    rate_limit_per_min: int | None = Field(None, ge=1, le=1_000_000, description="gateway keys: requests/minute")


def user_out(u: User) -> dict[str, Any]:
    return {"username": u.username, "role": u.role, "disabled": u.disabled, "created_at": u.created_at,
            "last_login": u.last_login, "locked_until": u.locked_until}


def token_out(t: ApiToken) -> dict[str, Any]:
    return {"id": t.id, "name": t.name, "prefix": t.prefix, "role": t.role, "kind": t.kind,
            "created_by": t.created_by, "created_at": t.created_at, "expires_at": t.expires_at,
            "revoked_at": t.revoked_at, "last_used_at": t.last_used_at, "rate_limit_per_min": t.rate_limit_per_min}


def audit_out(r: AuditRecord) -> dict[str, Any]:
    return r.model_dump()


def build_router(auth: Auth, audit: AuditLog) -> APIRouter:
    router = APIRouter(tags=["access"])

    def principal_of(request: Request) -> Principal:
        principal: Principal = request.state.principal
        return principal

    @router.post("/api/auth/login")
    def login(body: LoginRequest, request: Request) -> dict[str, Any]:
        """A session token for the console (expires; repeated failures lock the user out for a while)."""
        request.state.audit = {"target": f"user {body.username}"}
        try:
            token, row, user = auth.login(body.username, body.password)
        except LockedError as exc:
            raise HTTPException(423, detail=str(exc)) from None
        except BadCredentialsError as exc:
            raise HTTPException(401, detail=str(exc)) from None
        request.state.audit["role"] = user.role
        return {"token": token, "username": user.username, "role": user.role, "expires_at": row.expires_at}

    @router.post("/api/auth/sso")
    def sso(body: SsoRequest, request: Request) -> dict[str, Any]:
        """For the console's service token (admin) after single sign-on: a session for an existing user."""
        try:
            token, row, user = auth.session_for(body.username)
        except AuthError as exc:
            raise HTTPException(404, detail=str(exc)) from None
        request.state.audit = {"target": f"user {user.username}", "after": {"session": "single sign-on"}}
        return {"token": token, "username": user.username, "role": user.role, "expires_at": row.expires_at}

    @router.post("/api/auth/logout")
    def logout(request: Request) -> dict[str, Any]:
        token = bearer(request)
        if token:
            auth.revoke(token=token)
        return {"ok": True}

    @router.get("/api/auth/me")
    def me(request: Request) -> dict[str, Any]:
        p = principal_of(request)
        return {"name": p.name, "role": p.role, "kind": p.kind, "roles": [r for r in ROLES if allows(p.role, r)]}

    @router.get("/api/users")
    def users() -> list[dict[str, Any]]:
        return [user_out(u) for u in auth.users()]

    @router.post("/api/users", status_code=201)
    def create_user(body: UserIn, request: Request) -> dict[str, Any]:
        try:
            user = auth.create_user(body.username, body.password, body.role)
        except AuthError as exc:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": str(exc), "type": "value_error"}]) from None
        request.state.audit = {"target": f"user {user.username}", "after": {"role": user.role}}
        return user_out(user)

    @router.patch("/api/users/{username}")
    def update_user(username: str, body: UserPatch, request: Request) -> dict[str, Any]:
        before = next((user_out(u) for u in auth.users() if u.username == username), None)
        if before is None:
            raise HTTPException(404, detail=f"no user {username!r}")
        try:
            user = auth.update_user(username, role=body.role, password=body.password, disabled=body.disabled)
        except AuthError as exc:
            raise HTTPException(422, detail=[{"loc": ["body"], "msg": str(exc), "type": "value_error"}]) from None
        request.state.audit = {"target": f"user {username}",
                               "before": {"role": before["role"], "disabled": before["disabled"]},
                               "after": {"role": user.role, "disabled": user.disabled,
                                         "password_changed": body.password is not None}}
        return user_out(user)

    @router.get("/api/tokens")
    def tokens() -> list[dict[str, Any]]:
        return [token_out(t) for t in auth.tokens()]

    @router.post("/api/tokens", status_code=201)
    def create_token(body: TokenIn, request: Request) -> dict[str, Any]:
        """A new token: the answer holds its only copy."""
        token, row = auth.create_token(body.name, body.role, body.kind, principal_of(request).name,
                                       ttl_s=body.expires_days * 86400 if body.expires_days else None,
                                       rate_limit_per_min=body.rate_limit_per_min)
        request.state.audit = {"target": f"token {row.id} {row.name}",
                               "after": {"role": row.role, "kind": row.kind, "prefix": row.prefix}}
        return {**token_out(row), "token": token}

    @router.delete("/api/tokens/{token_id}")
    def revoke_token(request: Request, token_id: int = PathParam(ge=1, le=MAX_ID)) -> dict[str, Any]:
        try:
            row = auth.revoke(token_id=token_id)
        except AuthError:
            raise HTTPException(404, detail=f"no token {token_id}") from None
        request.state.audit = {"target": f"token {row.id} {row.name}", "after": {"revoked": True}}
        return token_out(row)

    def filters(actor: str | None, action: str | None, target: str | None, since: float | None,
                until: float | None, result: int | None, contains: str | None, limit: int,
                offset: int) -> list[AuditRecord]:
        return list(audit.query(actor=actor, action=action, target=target, since=since, until=until, result=result,
                                text_=contains, limit=limit, offset=offset))

    @router.get("/api/audit")
    def audit_trail(actor: str | None = None, action: str | None = Query(None, description="prefix, e.g. settings"),
                    target: str | None = None, since: float | None = None, until: float | None = None,
                    result: int | None = Query(None, ge=0, le=999), contains: str | None = None,
                    limit: int = Query(200, ge=1, le=10_000),
                    offset: int = Query(0, ge=0, le=MAX_ID)) -> list[dict[str, Any]]:
        """The append-only audit trail, newest first, with filters (times as Unix seconds)."""
        return [audit_out(r) for r in filters(actor, action, target, since, until, result, contains, limit, offset)]

    @router.get("/api/audit/export", response_class=Response, responses={200: {
        "description": "The filtered trail as a file", "content": {"text/csv": {}, "application/json": {}}}})
    def audit_export(format: Literal["csv", "json"] = "csv", actor: str | None = None, action: str | None = None,
                     target: str | None = None, since: float | None = None, until: float | None = None,
                     result: int | None = Query(None, ge=0, le=999), contains: str | None = None,
                     limit: int = Query(100_000, ge=1, le=1_000_000)) -> Response:
        rows = filters(actor, action, target, since, until, result, contains, limit, 0)
        if format == "json":
            import json

            body = json.dumps([audit_out(r) for r in rows], indent=1, default=str)
            return Response(body, media_type="application/json",
                            headers={"Content-Disposition": 'attachment; filename="audit.json"'})
        return Response(to_csv(rows), media_type="text/csv",
                        headers={"Content-Disposition": 'attachment; filename="audit.csv"'})

    return router
