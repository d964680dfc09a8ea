"""The audit trail: every mutating action, who did it, from where, what it changed and how it ended.

Append-only by construction: the database's triggers (engine/db/database.py) abort any UPDATE or DELETE of the
table, and no route edits it. A pure ASGI middleware records each mutating ``/api`` request after its response (its
status is the result); handlers add the before/after of what they changed through ``request.state.audit``; the
engine records its own automatic actions (rollbacks, crash-loop halts) directly.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from sqlalchemy import String, cast
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import col, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.db import AuditRecord, Database

# a key that names a secret (password, hf_token, api_key, …), not one that merely contains the word
# (max_num_batched_tokens, max_tokens and password_changed are kept)
log = logging.getLogger("llmops.audit")
SECRET_KEYS = re.compile(r"(?:^|[_-])(?:pass(?:word)?|token|secret|(?:api)?key|authorization)$", re.I)
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
MAX_DEPTH, MAX_ITEMS, MAX_TEXT = 4, 50, 500  # what one audit value keeps: the record says what happened, bounded


@dataclass
class AuditNote:
    """What a handler says of the action it did, for its audit record (the request carries it)."""

    target: str = ""
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    detail: str = ""
    role: str = ""  # for a sign-in: the role of the user who signed in


def bound(value: Any, depth: int = 0) -> Any:
    """A JSON value cut to what an audit record keeps: nesting, items and text bounded (a 300-deep list or a 65 KB
    string in a request must not become a row the listing cannot serialise, nor 25 MB of rows)."""
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + f"… ({len(value)} characters)"
    if value is None or isinstance(value, bool | int):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else str(value)
    if depth >= MAX_DEPTH:
        return f"[{type(value).__name__} nested deeper than {MAX_DEPTH}]"
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k)[:100]: bound(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["…"] = f"{len(items) - MAX_ITEMS} more"
        return out
    if isinstance(value, list | tuple):
        kept = [bound(v, depth + 1) for v in list(value)[:MAX_ITEMS]]
        return kept + ([f"… {len(value) - MAX_ITEMS} more"] if len(value) > MAX_ITEMS else [])
    return str(value)[:MAX_TEXT]


def redact(value: Any) -> Any:
    """Secrets (passwords, tokens, keys) never reach the audit trail."""
    if isinstance(value, dict):
        return {k: "[redacted]" if SECRET_KEYS.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def generic_action(method: str, path: str) -> str:
    """The name of a mutating request that matched no route's declared action (a 404, a 405)."""
    return f"{method.lower()} {path[:200]}"


class AuditLog:
    def __init__(self, db: Database) -> None:
        self.db = db

    def record(self, *, actor: str, action: str, role: str = "", target: str = "",
               before: dict[str, Any] | None = None, after: dict[str, Any] | None = None, source: str = "",
               result: int = 0, detail: str = "", deployment: str | None = None) -> None:
        with self.db.session() as s:
            s.add(AuditRecord(actor=actor[:100], role=role[:20], action=action[:100], target=target[:300],
                              before=redact(bound(before)), after=redact(bound(after)), source=source[:100],
                              result=result, detail=detail[:2000],
                              deployment=deployment[:128] if deployment else None))

    def query(self, *, actor: str | None = None, action: str | None = None, target: str | None = None,
              since: float | None = None, until: float | None = None, result: int | None = None,
              text_: str | None = None, limit: int = 200, offset: int = 0) -> Sequence[AuditRecord]:
        with self.db.session() as s:
            q = select(AuditRecord)
            if actor:
                q = q.where(AuditRecord.actor == actor)
            # case-insensitive and literal (no LIKE wildcards) on SQLite and PostgreSQL alike
            if action:
                q = q.where(col(AuditRecord.action).istartswith(action, autoescape=True))
            if target:
                q = q.where(col(AuditRecord.target).icontains(target, autoescape=True))
            if since is not None:
                q = q.where(AuditRecord.ts >= since)
            if until is not None:
                q = q.where(AuditRecord.ts < until)
            if result is not None:
                q = q.where(AuditRecord.result == result)
            if text_:
                q = q.where(cast(col(AuditRecord.after), String).icontains(text_, autoescape=True)
                            | cast(col(AuditRecord.before), String).icontains(text_, autoescape=True)
                            | col(AuditRecord.detail).icontains(text_, autoescape=True)
                            | col(AuditRecord.target).icontains(text_, autoescape=True))
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
        status = 0
        recorded = False

        async def record() -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            with anyio.CancelScope(shield=True):  # a client that hangs up still leaves its action on record
                try:
                    await anyio.to_thread.run_sync(self._write, scope, state, status or 500)
                except SQLAlchemyError:  # the action itself is done: say loudly that its record is missing
                    log.exception("audit: could not record %s %s", scope["method"], scope["path"])

        async def send_(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                await record()
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            await record()  # the app failed before it answered

    def _write(self, scope: Scope, state: dict[str, Any], status: int) -> None:
        """The request's record: who (the authenticated principal, else a sign-in's user name, else anonymous),
        the route's declared action, and what its handler said it did; never the request's bytes."""
        principal = state.get("principal")
        note: AuditNote = state.get("audit") or AuditNote()
        if principal is not None:
            actor, role = principal.name, principal.role
        elif state.get("audit_action") == "auth.login" and note.target.startswith("user "):
            actor, role = note.target.removeprefix("user "), note.role
        else:
            actor, role = "anonymous", ""
        client = scope.get("client")
        after = note.after
        if after is None:  # refused before its handler said anything: how much was sent, never what
            size = next((v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"content-length"), None)
            after = {"body": f"{size} bytes"} if size and size.isdigit() else None
        self.log.record(actor=actor, role=role, source=client[0] if client else "",
                        action=state.get("audit_action") or generic_action(scope["method"], scope["path"]),
                        target=note.target, before=note.before, after=after, result=status, detail=note.detail,
                        deployment=state.get("deployment"))
