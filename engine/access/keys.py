"""The /v1 gateway's own check: an API key (a ``gateway`` token, or a prompter's token) when keys are required
(and, where they are not, the key a request sends anyway), and its per-key rate limit. It runs before a byte of the
request's body is read.

A token is looked up in SQLite once and then kept for ``cache_s`` (the data path must not query the database per
request); a revocation or user change made through this engine clears the cache at once, one made by another
process (``llmops token revoke``) takes effect within ``cache_s``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine.access.auth import TOKEN_PREFIX, Auth, Principal, allows, digest
from engine.access.ratelimit import RateLimiter
from engine.db import RETRY_AFTER_S, UNAVAILABLE, unavailable_message
from engine.errors import EngineError


class KeyRefusedError(EngineError):
    """A /v1 request refused for its key: status (401, 429, or 503 when the database cannot check it), message and
    headers for the answer."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers


@dataclass(frozen=True)
class _Entry:
    principal: Principal | None
    at: float
    changes: int


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The bearer credential of raw ASGI headers (or an ``x-api-key`` header, which Anthropic's clients send)."""
    for name, value in headers:
        if name == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text[:7].lower() == "bearer " else None
        if name == b"x-api-key":
            return value.decode("latin-1").strip()
    return None


class GatewayKeys:
    def __init__(self, auth: Auth, limits: RateLimiter, required: bool, cache_s: float = 5.0,
                 max_cached: int = 10_000) -> None:
        self.auth = auth
        self.limits = limits
        self.required = required
        self.cache_s = cache_s
        self.max_cached = max_cached
        self._cache: dict[str, _Entry] = {}
        self._reading: dict[str, asyncio.Future[Principal | None]] = {}

    async def _principal(self, token: str) -> Principal | None:
        key = digest(token)
        now = time.monotonic()
        entry = self._cache.get(key)
        if entry is not None and now - entry.at < self.cache_s and entry.changes == self.auth.changes:
            return entry.principal
        # one read at a time per key: the requests that come meanwhile wait for it (at 500 requests/s, a read by
        # each that found the cache old queued them on the API's threads every cache_s)
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._read(token, key))
            self._reading[key] = reading
            reading.add_done_callback(lambda _: self._reading.pop(key, None))
        return await asyncio.shield(reading)

    async def _read(self, token: str, key: str) -> Principal | None:
        now = time.monotonic()
        changes = self.auth.changes  # before the read: a revocation during it is not cached as its answer
        try:
            principal = await asyncio.to_thread(self.auth.authenticate, token)  # SQLite: never on the event loop
        except UNAVAILABLE as exc:  # a key not in the cache cannot be checked while the database is down
            raise KeyRefusedError(503, unavailable_message(exc, reading=True),
                                  [(b"retry-after", str(RETRY_AFTER_S).encode())]) from exc
        if len(self._cache) >= self.max_cached:
            self._cache.clear()
        self._cache[key] = _Entry(principal, now, changes)
        return principal

    async def check(self, headers: list[tuple[bytes, bytes]]) -> Principal | None:
        """The caller's principal, or KeyRefusedError. Where keys are not required, a valid key sent anyway is
        still its key (its limits hold and its usage is its own); none, or one that is not valid: None."""
        token = bearer(headers)
        if not self.required:
            if not token or not token.startswith(TOKEN_PREFIX):  # (no read for what cannot be one of its keys)
                return None
            try:
                principal = await self._principal(token)
            except KeyRefusedError:  # the database is down: anonymous, as keys are not required
                return None
            if principal is None or (principal.kind != "gateway" and not allows(principal.role, "prompter")):
                return None
        else:
            principal = await self._principal(token) if token else None
        if principal is None or (principal.kind != "gateway" and not allows(principal.role, "prompter")):
            raise KeyRefusedError(401, "this gateway needs an API key: Authorization: Bearer <key>",
                                  [(b"www-authenticate", b"Bearer")])
        limit = principal.rate_limit_per_min
        if limit and principal.token_id is not None and (retry := self.limits.take(principal.token_id, limit)):
            raise KeyRefusedError(429, f"rate limit of {limit} requests per minute for this key",
                                  [(b"retry-after", str(retry).encode())])
        return principal
