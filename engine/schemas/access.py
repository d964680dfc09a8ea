"""Sign-in, users, tokens and the audit trail as they cross the API."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from engine.schemas.common import Role, check_name

TokenState = Literal["active", "expired", "revoked"]
BudgetPeriod = Literal["day", "month"]
UsageGroup = Literal["key", "team", "deployment", "model", "day"]

TeamName = Annotated[str, AfterValidator(check_name)]
_WEIGHT = "its share of a deployment at capacity against the others waiting (fair queues): 2 gets twice the slots of 1"
_TPM = "tokens (prompt and completion) per minute; a request reserves its prompt and max_tokens until it ends"
_BUDGET = "tokens (prompt and completion) per budget_period; requests that would pass it get 429 until it resets"
_PERIOD = "the token_budget's period: day or month (UTC)"


class LimitsIn(BaseModel):
    """The limits of a team or a key (each optional: null or absent, none)."""

    model_config = ConfigDict(strict=True)

    rate_limit_per_min: int | None = Field(None, ge=1, le=1_000_000, description="requests per minute")
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12, description=_TPM)
    token_budget: int | None = Field(None, ge=1, le=10**15, description=_BUDGET)
    budget_period: BudgetPeriod | None = Field(None, description=_PERIOD)
    weight: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False, description=_WEIGHT)


class TeamIn(LimitsIn):
    name: TeamName = Field(min_length=1, max_length=100)
    note: str = Field("", max_length=500)


class TeamPatch(BaseModel):
    """A team's changes: only the fields sent change (null clears a limit)."""

    model_config = ConfigDict(strict=True)

    rate_limit_per_min: int | None = Field(None, ge=1, le=1_000_000)
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    token_budget: int | None = Field(None, ge=1, le=10**15)
    budget_period: BudgetPeriod | None = None
    weight: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False)
    note: str | None = Field(None, max_length=500)


class BudgetOut(BaseModel):
    """A token budget's state now."""

    limit: int
    period: BudgetPeriod
    used: int = Field(description="tokens used this period (settled)")
    reserved: int = Field(description="tokens reserved by requests in flight")
    resets_at: float = Field(description="when the period ends, Unix seconds")


class TeamOut(BaseModel):
    id: int
    name: str
    weight: float
    rate_limit_per_min: int | None
    tokens_per_minute: int | None
    token_budget: int | None
    budget_period: BudgetPeriod | None
    note: str
    created_at: float
    created_by: str
    keys: int = Field(0, description="gateway keys in it (active)")
    members: list[str] = Field(default_factory=list, description="users in it (they see its usage)")
    budget: BudgetOut | None = None


class TokenPatch(BaseModel):
    """A gateway key's changes: its team and limits; only the fields sent change (null clears)."""

    model_config = ConfigDict(strict=True)

    team: str | None = Field(None, min_length=1, max_length=100, description="its team, by name (null: none)")
    rate_limit_per_min: int | None = Field(None, ge=1, le=1_000_000)
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    token_budget: int | None = Field(None, ge=1, le=10**15)
    budget_period: BudgetPeriod | None = None
    weight: float | None = Field(None, gt=0, le=1000, allow_inf_nan=False)


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
    team: str | None = Field(None, min_length=1, max_length=100, description="the team they belong to, by name "
                             "(null: none; absent: unchanged)")


class UserOut(BaseModel):
    username: str
    role: Role
    disabled: bool
    created_at: float
    last_login: float | None
    locked_until: float | None
    team: str | None = None


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
    team: str | None = Field(None, min_length=1, max_length=100, description="gateway keys: its team, by name")
    tokens_per_minute: int | None = Field(None, ge=1, le=10**12, description="gateway keys: " + _TPM)
    token_budget: int | None = Field(None, ge=1, le=10**15, description="gateway keys: " + _BUDGET)
    budget_period: BudgetPeriod | None = Field(None, description="gateway keys: " + _PERIOD)
    weight: float = Field(1.0, gt=0, le=1000, allow_inf_nan=False, description="gateway keys: " + _WEIGHT)
    owner: str | None = Field(None, min_length=1, max_length=64, description="the user it belongs to (default: "
                              "who makes it); they see its usage")


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
    team: str | None = None
    tokens_per_minute: int | None = None
    token_budget: int | None = None
    budget_period: BudgetPeriod | None = None
    weight: float = 1.0
    budget: BudgetOut | None = None
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


class UsageRow(BaseModel):
    """Usage of one group (a key, a team, a deployment or a day) over the window asked for."""

    group: str = Field(description="the key's or team's or deployment's name, or the day (YYYY-MM-DD)")
    id: int | None = Field(None, description="the key's, team's or deployment's id (None: no key or team; a day)")
    requests: int
    failed: int = Field(description="answered 4xx or 5xx (limits' 429s included), or cut")
    input_tokens: int
    output_tokens: int
    cost: float | None = Field(None, description="by each deployment's price per 1,000 tokens (None: no price set)")


class UsageOut(BaseModel):
    group_by: UsageGroup
    since: str = Field(description="first day, YYYY-MM-DD (UTC)")
    until: str = Field(description="last day, YYYY-MM-DD (UTC)")
    rows: list[UsageRow]
    total: UsageRow
    scope: Literal["all", "own"] = Field(description="all: every key's usage (operators); own: the caller's keys "
                                         "and their team's")
