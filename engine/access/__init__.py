"""Access: users, tokens, sessions and roles, and the append-only audit trail with its middleware."""

from __future__ import annotations

from engine.access.audit import (
    CONSOLE_CLIENT_HEADER,
    CONSOLE_KEY_HEADER,
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
    Principal,
    UnknownUserError,
    allows,
    digest,
)
from engine.access.hashing import HashBusyError, HashPool
from engine.access.keys import GatewayKeys, KeyRefusedError, bearer
from engine.access.ratelimit import RateLimiter
from engine.schemas import ROLES, Role

__all__ = [
    "CONSOLE_CLIENT_HEADER",
    "CONSOLE_KEY_HEADER",
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
    "source_of",
    "to_csv",
]
