"""The access gate: every request's route is found and its declared role checked before a byte of its body is read
(a 50 MB body on a route the caller may not use is refused with 401/403, not parsed first). Pure ASGI.

Roles are declared by each route (``access(...)`` in its decorator); the gate reads them off the app's routes
once. A route that matches nothing passes on (FastAPI answers 404 or 405)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.access import Auth, GatewayKeys, KeyRefusedError, Principal, allows
from engine.api.deps import RouteMeta, route_meta
from engine.db import RETRY_AFTER_S, UNAVAILABLE, unavailable_message


def bearer_of(scope: Scope) -> str | None:
    for name, value in scope.get("headers") or []:
        if name == b"authorization":
            text = value.decode("latin-1")
            return text[7:].strip() if text.lower().startswith("bearer ") else None
    return None


async def send_json(send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
                    ) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


NONE = RouteMeta(False, None, None, False)


class AccessGate:
    def __init__(self, app: ASGIApp, api: FastAPI, auth: Auth, keys: GatewayKeys,
                 writable: Callable[[], str | None] = lambda: None) -> None:
        self.app = app
        self.api = api
        self.auth = auth
        self.keys = keys
        self.writable = writable  # None, or why the database cannot take a change now
        self._meta: dict[int, RouteMeta] | None = None

    def _route(self, scope: Scope) -> RouteMeta:
        """What the matching route declares (nothing when no route matches fully)."""
        if self._meta is None:
            self._meta = {id(r): route_meta(r) for r in self.api.routes if isinstance(r, APIRoute)}
        for route in self.api.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return self._meta.get(id(route), NONE)
        return NONE

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        meta = self._route(scope)
        state = scope.setdefault("state", {})
        needed, state["audit_action"] = meta.role, meta.action
        if scope["path"].startswith("/v1/"):  # the engine's own /v1 routes: the gateway's key, before the body
            try:
                state["principal"] = await self.keys.check(scope.get("headers") or [])
            except KeyRefusedError as exc:
                await send_json(send, exc.status, {"detail": str(exc)}, exc.headers)
                return
        if needed is not None:
            token = bearer_of(scope)
            try:
                principal: Principal | None = await run_in_threadpool(self.auth.authenticate, token) if token else None
            except UNAVAILABLE as exc:  # the token cannot be checked now: 503, not a 500 from the middleware
                await send_json(send, 503, {"detail": unavailable_message(exc, reading=True)},
                                [(b"retry-after", str(RETRY_AFTER_S).encode())])
                return
            if principal is None:
                await send_json(send, 401, {"detail": "a valid bearer token is needed: sign in, or create a token "
                                            "with `llmops token create`"}, [(b"www-authenticate", b"Bearer")])
                return
            state["principal"] = principal
            if principal.kind == "gateway":
                state["refused_by_gate"] = True  # counted, not a row each (the audit's tallies)
                await send_json(send, 403, {"detail": "a gateway API key serves /v1 only"})
                return
            if principal.kind == "sso" and scope["path"] != "/api/auth/sso":
                state["refused_by_gate"] = True  # counted, not a row each (the audit's tallies)
                await send_json(send, 403, {"detail": "the console's single sign-on credential opens sessions "
                                            "(POST /api/auth/sso) and does nothing else"})
                return
            if not allows(principal.role, needed):
                state["refused_by_gate"] = True  # counted, not a row each (the audit's tallies)
                await send_json(send, 403, {"detail": f"role {principal.role} may not {scope['method']} "
                                            f"{scope['path']}: it needs {needed}"})
                return
        if meta.action and not meta.when_disk_low and (why := await run_in_threadpool(self.writable)):
            # a change the database could not record is refused before it is made, not made and answered 500
            await send_json(send, 507, {"detail": f"nothing was done: {why}"})
            return
        await self.app(scope, receive, send)
