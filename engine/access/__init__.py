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
from engine.schemas import ROLES, Role

__all__ = [
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
    "UnknownUserError",
    "allows",
    "bearer",
    "bound",
    "digest",
    "ensure_console_key",
    "generic_action",
    "redact",
    "skeleton",
    "source_of",
    "to_csv",
    "token_state",
]
