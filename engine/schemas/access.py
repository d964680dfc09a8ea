"""Sign-in, users, tokens and the audit trail as they cross the API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from engine.schemas.common import Role, check_name

TokenState = Literal["active", "expired", "revoked"]


class LoginRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=1, max_length=1024)


class SsoRequest(BaseModel):
    model_config = ConfigDict(strict=True)

    username: str = Field(min_length=1, max_length=64)


class SessionOut(BaseModel):
    """A console session: its token (the only copy), who it is for, and when it expires (Unix seconds)."""

    token: str
    username: str
    role: Role
    expires_at: float | None


class MeOut(BaseModel):
    name: str
    role: Role
    kind: str
    roles: list[Role]


class UserIn(BaseModel):
    model_config = ConfigDict(strict=True)

    username: str = Field(min_length=1, max_length=64)
    password: str = Field(min_length=10, max_length=1024)
    role: Role = "viewer"


class UserPatch(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Role | None = None
    password: str | None = Field(None, min_length=10, max_length=1024)
    disabled: bool | None = None


class UserOut(BaseModel):
    username: str
    role: Role
    disabled: bool
    created_at: float
    last_login: float | None
    locked_until: float | None


class UserDeletedOut(BaseModel):
    username: str
    role: Role
    tokens_revoked: int = Field(description="API tokens and gateway keys of theirs revoked with them")


class TokenIn(BaseModel):
    model_config = ConfigDict(strict=True)

    name: Annotated[str, AfterValidator(check_name)] = Field(min_length=1, max_length=100)
    role: Role = "viewer"
    kind: Literal["api", "gateway", "sso"] = Field("api", description="api: the /api routes of its role; gateway: a "
                                                   "/v1 key; sso: the console's single sign-on credential, which "
                                                   "opens sessions (POST /api/auth/sso) and does nothing else (a "
                                                   "viewer)")
    expires_days: float | None = Field(None, gt=0, le=3650)
    rate_limit_per_min: int | None = Field(None, ge=1, le=1_000_000, description="gateway keys: requests/minute")
    deployments: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        None, min_length=1, max_length=100, description="gateway keys: the deployments (by name) it may send "
        "requests to; others answer 404 model_not_found and /v1/models lists these only (default: every one)")


class TokenOut(BaseModel):
    id: int
    name: str
    prefix: str
    role: Role
    kind: str
    created_by: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None
    rate_limit_per_min: int | None
    deployments: list[str] | None = Field(None, description="a gateway key's deployments (None: every one)")
    owner: str | None = Field(None, description="the user it belongs to: disabling, demoting or deleting them "
                              "revokes it (None: made with `llmops token create` on the engine's machine)")
    state: TokenState = Field("active", description="active, expired (past expires_at) or revoked")


class TokenCreatedOut(TokenOut):
    token: str = Field(description="the token itself: its only copy")


class AuditOut(BaseModel):
    id: int
    ts: float
    actor: str
    role: str
    action: str
    target: str
    before: dict[str, JsonValue] | None
    after: dict[str, JsonValue] | None
    source: str
    result: int
    detail: str
    deployment: str | None = Field(None, description="the deployment acted on (None: not one deployment's)")


class AuditTallyOut(BaseModel):
    """Refused requests without a valid credential, counted: how many of one kind came from one source in one
    minute (instead of a row each in the audit trail)."""

    minute: float = Field(description="the minute's start, Unix seconds")
    source: str = Field(description='the client address, or "(others)" past the minute\'s bound of keys')
    action: str
    target: str = Field(description="what it named: for a sign-in, the user name it tried")
    result: int = Field(description="the HTTP status it was answered with")
    count: int
    last_ts: float = Field(description="when the last of them came, Unix seconds")
