"""Access: users, tokens, sessions and roles, and the append-only audit trail with its middleware."""

from __future__ import annotations

from engine.access.audit import AuditLog, AuditMiddleware, AuditNote, bound, generic_action, redact, to_csv
from engine.access.auth import (
    TOKEN_PREFIX,
    Auth,
    AuthError,
    BadCredentialsError,
    LockedError,
    Principal,
    allows,
    digest,
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
    "Auth",
    "AuthError",
    "BadCredentialsError",
    "GatewayKeys",
    "HashBusyError",
    "HashPool",
    "KeyRefusedError",
    "LockedError",
    "Principal",
    "RateLimiter",
    "Role",
    "allows",
    "bearer",
    "bound",
    "digest",
    "generic_action",
    "redact",
    "to_csv",
]
