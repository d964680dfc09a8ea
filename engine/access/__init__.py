"""Access: users, tokens, sessions and roles, and the append-only audit trail with its middleware."""

from __future__ import annotations

from engine.access.audit import (
    AuditLog,
    AuditMiddleware,
    AuditNote,
    AuditTallies,
    bound,
    ensure_console_key,
    generic_action,
    redact,
    source_of,
    to_csv,
)
from engine.access.auth import (
    TOKEN_PREFIX,
    Auth,
    AuthError,
    BadCredentialsError,
    LastAdminError,
    LockedError,
    OwnerGoneError,
    Principal,
    UnknownUserError,
    allows,
    digest,
    skeleton,
    token_state,
)
from engine.access.hashing import HashBusyError, HashPool
from engine.access.keys import GatewayKeys, KeyRefusedError, bearer
from engine.access.ratelimit import RateLimiter
from engine.access.teams import LIMIT_FIELDS, TeamError, Teams, check_budget, limits_of
from engine.schemas import ROLES, Role

__all__ = [
    "LIMIT_FIELDS",
    "ROLES",
    "TOKEN_PREFIX",
    "AuditLog",
    "AuditMiddleware",
    "AuditNote",
    "AuditTallies",
    "Auth",
    "AuthError",
    "BadCredentialsError",
    "GatewayKeys",
    "HashBusyError",
    "HashPool",
    "KeyRefusedError",
    "LastAdminError",
    "LockedError",
    "OwnerGoneError",
    "Principal",
    "RateLimiter",
    "Role",
    "TeamError",
    "Teams",
    "UnknownUserError",
    "allows",
    "bearer",
    "bound",
    "check_budget",
    "digest",
    "ensure_console_key",
    "generic_action",
    "limits_of",
    "redact",
    "skeleton",
    "source_of",
    "to_csv",
    "token_state",
]
