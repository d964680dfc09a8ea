"""The audit trail: every mutating action, who did it, from where, what it changed and how it ended.

Append-only by construction: SQLite triggers abort any UPDATE or DELETE of the table, and no route edits it. A
pure ASGI middleware records each mutating ``/api`` request after its response (its status is the result);
handlers add the before/after of what they changed through ``request.state.audit``; the engine records its own
automatic actions (rollbacks, crash-loop halts) directly.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.to_thread
from sqlalchemy import JSON, Column, String, cast, text
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Field, Session, SQLModel, col, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.db import Store, add_missing_columns

# a key that names a secret (password, hf_token, api_key, …), not one that merely contains the word
# (max_num_batched_tokens, max_tokens and password_changed are kept)
log = logging.getLogger("llmops.audit")
SECRET_KEYS = re.compile(r"(?:^|[_-])(?:pass(?:word)?|token|secret|(?:api)?key|authorization)$", re.I)
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
# (method, path pattern) → action name; the first match wins
ACTIONS: list[tuple[str, re.Pattern[str], str]] = [
    ("PUT", re.compile(r"^/api/settings$"), "settings.write"),
    ("POST", re.compile(r"^/api/settings/rollback$"), "settings.rollback"),
    ("POST", re.compile(r"^/api/engine/(\w+)$"), "engine.{0}"),
    ("POST", re.compile(r"^/api/benchmarks/search$"), "benchmarks.search"),
    ("POST", re.compile(r"^/api/benchmarks/(\d+)/cancel$"), "benchmarks.cancel"),
    ("POST", re.compile(r"^/api/benchmarks$"), "benchmarks.sweep"),
    ("POST", re.compile(r"^/api/users$"), "users.create"),
    ("PATCH", re.compile(r"^/api/users/([^/]+)$"), "users.update"),
    ("POST", re.compile(r"^/api/tokens$"), "tokens.create"),
    ("DELETE", re.compile(r"^/api/tokens/(\d+)$"), "tokens.revoke"),
    ("POST", re.compile(r"^/api/prompts$"), "prompts.save"),
    ("DELETE", re.compile(r"^/api/prompts/(\d+)$"), "prompts.delete"),
    ("POST", re.compile(r"^/api/auth/login$"), "auth.login"),
    ("POST", re.compile(r"^/api/auth/logout$"), "auth.logout"),
    ("POST", re.compile(r"^/api/auth/sso$"), "auth.sso"),
]


class AuditRecord(SQLModel, table=True):
    __tablename__ = "audit"

    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=time.time, index=True)
    actor: str = Field(default="anonymous", index=True)
    role: str = ""
    action: str = Field(index=True)
    target: str = ""
    before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    after: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    source: str = ""
    result: int = 0  # the HTTP status, or 0 for the engine's own actions
    detail: str = ""


def redact(value: Any) -> Any:
    """Secrets (passwords, tokens, keys) never reach the audit trail."""
    if isinstance(value, dict):
        return {k: "[redacted]" if SECRET_KEYS.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def action_of(method: str, path: str) -> str | None:
    for m, pattern, name in ACTIONS:
        if m == method and (match := pattern.match(path)):
            return name.format(*match.groups())
    return f"{method.lower()} {path}" if method in MUTATING and path.startswith("/api/") else None


class AuditLog:
    def __init__(self, store: Store) -> None:
        self.store = store
        add_missing_columns(store.engine, AuditRecord.metadata)
        with store.engine.begin() as conn:
            for op in ("UPDATE", "DELETE"):
                conn.execute(text(
                    f"CREATE TRIGGER IF NOT EXISTS audit_no_{op.lower()} BEFORE {op} ON audit "
                    "BEGIN SELECT RAISE(ABORT, 'the audit trail is append-only'); END"))

    def record(self, *, actor: str, action: str, role: str = "", target: str = "",
               before: dict[str, Any] | None = None, after: dict[str, Any] | None = None, source: str = "",
               result: int = 0, detail: str = "") -> None:
        with Session(self.store.engine) as s, s.begin():
            s.add(AuditRecord(actor=actor, role=role, action=action, target=target, before=redact(before),
                              after=redact(after), source=source, result=result, detail=detail[:2000]))

    def query(self, *, actor: str | None = None, action: str | None = None, target: str | None = None,
              since: float | None = None, until: float | None = None, result: int | None = None,
              text_: str | None = None, limit: int = 200, offset: int = 0) -> Sequence[AuditRecord]:
        with Session(self.store.engine) as s:
            q = select(AuditRecord)
            if actor:
                q = q.where(AuditRecord.actor == actor)
            if action:
                q = q.where(col(AuditRecord.action).startswith(action))
            if target:
                q = q.where(col(AuditRecord.target).contains(target))
            if since is not None:
                q = q.where(AuditRecord.ts >= since)
            if until is not None:
                q = q.where(AuditRecord.ts < until)
            if result is not None:
                q = q.where(AuditRecord.result == result)
            if text_:
                q = q.where(cast(col(AuditRecord.after), String).contains(text_)
                            | cast(col(AuditRecord.before), String).contains(text_)
                            | col(AuditRecord.detail).contains(text_) | col(AuditRecord.target).contains(text_))
            return s.exec(q.order_by(col(AuditRecord.id).desc()).offset(offset).limit(limit)).all()


def to_csv(rows: Sequence[AuditRecord]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "time_utc", "actor", "role", "action", "target", "before", "after", "source", "result",
                     "detail"])
    for r in rows:
        writer.writerow([r.id, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.ts)), r.actor, r.role, r.action,
                         r.target, json.dumps(r.before), json.dumps(r.after), r.source, r.result, r.detail])
    return out.getvalue()


class AuditMiddleware:
    """Records every mutating /api request before its response's last bytes leave, so a client that has its answer
    finds the record (pure ASGI: /v1 streams pass untouched). The write runs on a thread: a busy database must not
    stall the event loop that also carries the gateway's streams."""

    def __init__(self, app: ASGIApp, log: AuditLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in MUTATING or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        body = bytearray()
        status = 0
        recorded = False

        async def record() -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            with anyio.CancelScope(shield=True):  # a client that hangs up still leaves its action on record
                try:
                    await anyio.to_thread.run_sync(self._write, scope, state, bytes(body), status or 500)
                except SQLAlchemyError:  # the action itself is done: say loudly that its record is missing
                    log.exception("audit: could not record %s %s", scope["method"], scope["path"])

        async def receive_() -> Message:
            message = await receive()
            if message["type"] == "http.request" and len(body) < 65536:
                body.extend(message.get("body", b""))
            return message

        async def send_(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                await record()
            await send(message)

        try:
            await self.app(scope, receive_, send_)
        finally:
            await record()  # the app failed before it answered

    def _write(self, scope: Scope, state: dict[str, Any], body: bytes, status: int) -> None:
        principal = state.get("principal")
        extra: dict[str, Any] = state.get("audit") or {}
        login = scope["path"] == "/api/auth/login"
        try:
            payload = json.loads(body) if body else None
        except (json.JSONDecodeError, UnicodeDecodeError):
            payload = {"body": f"{len(body)} bytes, not JSON"}  # never the bytes: they may hold a secret
        if principal is None and not login:  # an unauthenticated caller does not get to write into the trail
            payload = {"body": f"{len(body)} bytes"} if body else None
        name = payload.get("username") if login and isinstance(payload, dict) else None
        actor = principal.name if principal else (str(name)[:64] if isinstance(name, str) else "anonymous")
        client = scope.get("client")
        self.log.record(
            actor=actor, role=principal.role if principal else str(extra.get("role", "")),
            source=client[0] if client else "",
            action=action_of(scope["method"], scope["path"]) or scope["path"], target=str(extra.get("target", "")),
            before=extra.get("before"), after=extra.get("after", payload if isinstance(payload, dict) else None),
            result=status, detail=str(extra.get("detail", "")))
