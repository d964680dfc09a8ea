"""Access: users, tokens, sessions and roles, and the append-only audit trail with its middleware."""

from __future__ import annotations

from engine.access.audit import AuditLog, AuditMiddleware, AuditRecord, action_of, redact, to_csv
from engine.access.auth import (
    ROLES,
    TOKEN_PREFIX,
    ApiToken,
    Auth,
    AuthError,
    BadCredentialsError,
    LockedError,
    Principal,
    Role,
    User,
    allows,
    digest,
)

__all__ = [
    "ROLES",
    "TOKEN_PREFIX",
    "ApiToken",
    "AuditLog",
    "AuditMiddleware",
    "AuditRecord",
    "Auth",
    "AuthError",
    "BadCredentialsError",
    "LockedError",
    "Principal",
    "Role",
    "User",
    "action_of",
    "allows",
    "digest",
    "redact",
    "to_csv",
]
