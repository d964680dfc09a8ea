"""The body guard: what a request body of the API may be before any route parses it. Pure ASGI, inside the
access gate (a caller who may not use a route is refused before its body is read at all).

- Size, per route class (``body_limit_*`` in engine/config.py): a declared Content-Length past the limit is
  answered 413 at once; a body that grows past it while arriving is cut off with 413.
- Time: the body must arrive within ``body_timeout_s`` of the headers (408).
- JSON: checked by engine/bodies.py (UTF-8, finite numbers, paired surrogates, depth), 422 naming the reason.

Answers never echo the body. The /v1 data path (engine/gateway) reads its bodies with the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.api.gate import send_json
from engine.bodies import BodyBudget, BodyError, header, parse_json_async, read_body, replay


@dataclass(frozen=True)
class Limits:
    auth_bytes: int
    api_bytes: int
    v1_bytes: int
    max_depth: int
    body_timeout_s: float
    first_byte_s: float | None = None  # body_first_byte_s


def body_owner(scope: Scope) -> str:
    """Whose share of the /v1 body budget a request's body counts in: its gateway key (the gate checked it before
    the body was read), else its peer's address."""
    principal = scope.get("state", {}).get("principal")
    if principal is not None:
        return f"key:{principal.token_id}"
    client = scope.get("client")
    return f"peer:{client[0]}" if client else "peer:"


class BodyGuard:
    def __init__(self, app: ASGIApp, limits: Limits, budget: BodyBudget | None = None) -> None:
        self.app = app
        self.limits = limits
        self.budget = budget  # /v1 bodies (/v1/generate) count in the data path's budget

    def _limit(self, path: str) -> int:
        if path.startswith("/v1/"):
            return self.limits.v1_bytes
        if path.startswith("/api/auth/"):
            return self.limits.auth_bytes
        return self.limits.api_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        v1 = path.startswith("/v1/")
        limit = self._limit(path)
        headers = scope.get("headers") or []
        declared = header(headers, b"content-length")
        hold = self.budget.hold(body_owner(scope)) if v1 and self.budget is not None else None
        try:
            try:
                if declared is not None and declared.isdigit() and int(declared) > limit:
                    raise BodyError(413, f"the body is {int(declared):,} bytes; this route takes at most {limit:,} "
                                    "(body_limit_*)")
                if hold is not None and declared is not None and declared.isdigit():
                    hold.check_declared(int(declared))  # refused at once if it cannot fit; held as it arrives
                body, tail = await read_body(receive, limit, self.limits.body_timeout_s, hold,
                                             self.limits.first_byte_s)
                if body:
                    await parse_json_async(body, self.limits.max_depth)
            except BodyError as exc:
                await refuse(send, v1, exc)
                return
            await self.app(scope, replay(body, tail, receive), send)
        finally:
            if hold is not None:
                hold.release()


async def refuse(send: Send, v1: bool, exc: BodyError) -> None:
    """The refusal in the route's own dialect: OpenAI's error object on /v1; on /api a body that is not
    acceptable JSON is a 422 shaped like every other validation error of the API (FastAPI's detail list)."""
    status = exc.status
    if v1:
        kind = {400: "invalid_request_error", 408: "timeout", 413: "request_too_large",
                503: "service_unavailable"}.get(status, "error")
        body: dict[str, object] = {"error": {"message": str(exc), "type": kind, "code": status}}
    elif status == 400:
        status, body = 422, {"detail": [{"type": "json_invalid", "loc": ["body"], "msg": str(exc)}]}
    else:
        body = {"detail": str(exc)}
    await send_json(send, status, body, [(b"connection", b"close"), *exc.headers])
