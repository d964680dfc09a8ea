"""The audit trail: every mutating action, who did it, from where, what it changed and how it ended.

Append-only by construction: the database's triggers (engine/db/database.py) abort any UPDATE or DELETE of the
table, and no route edits it. A pure ASGI middleware records each mutating ``/api`` request after its response (its
status is the result); handlers add the before/after of what they changed through ``request.state.audit``; the
engine records its own automatic actions (rollbacks, crash-loop halts) directly.

What an authenticated caller does, and each sign-in, is a row of its own. A mutating request refused without a
valid credential (401, 403, 404, 405, 413, 422, 429…, a failed sign-in too) is counted instead, per minute, source,
action, target and result (``AuditTally``, bounded rows): one anonymous client sending as fast as it can no longer
writes a row per request into a table nobody can trim.

The source is the connection's peer (a proxy's X-Forwarded-For only from ``trusted_proxies``, which uvicorn reads),
or, for the console's own requests, the browser's address it passes with the console's key.
"""

from __future__ import annotations

import asyncio
import csv
import hmac
import io
import ipaddress
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
from sqlalchemy import String, cast, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import col, delete, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.aio import cancel_and_wait
from engine.db import READ_FLUSH_WAIT_S, UNAVAILABLE, AuditRecord, AuditTally, Database, portable
from engine.schemas import CONSOLE_CLIENT_HEADER, CONSOLE_KEY_HEADER

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


def ensure_console_key(path: Path) -> str:
    """The console's key: made on first use (0600, in the engine's private run folder), read afterwards."""
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # made meanwhile by another process (`llmops up` and the engine)
        return path.read_text().strip()
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def source_of(scope: Scope, console_key: str | None) -> str:
    """Where a request came from: the browser's address when the console passed it with the console's key (only
    the console holds it), else the connection's peer."""
    client = scope.get("client")
    peer = str(client[0]) if client else ""
    if not console_key:
        return peer
    headers = {k: v for k, v in scope.get("headers") or [] if k in (CONSOLE_KEY_HEADER.encode(),
                                                                    CONSOLE_CLIENT_HEADER.encode())}
    key, claimed = headers.get(CONSOLE_KEY_HEADER.encode()), headers.get(CONSOLE_CLIENT_HEADER.encode())
    if key is None or claimed is None or not hmac.compare_digest(key, console_key.encode()):
        return peer
    try:
        return str(ipaddress.ip_address(claimed.decode("ascii")))
    except (UnicodeDecodeError, ValueError):
        return peer


class TallyKey(NamedTuple):
    minute: float
    source: str
    action: str
    target: str
    result: int


OTHERS = "(others)"  # the source (and action) a minute's keys past its bound are counted under


class AuditTallies:
    """Refused anonymous requests, counted in memory and written once a second (``run``): one upsert per key, not
    a row per request. Bounded three ways: keys waiting in memory (``max_pending``), keys per minute
    (``keys_per_minute``; the rest count under source "(others)"), and rows in all (``max_rows``; the oldest minutes
    go)."""

    def __init__(self, db: Database, keys_per_minute: int = 200, max_rows: int = 100_000,
                 max_pending: int = 10_000, flush_s: float = 1.0) -> None:
        self.db = db
        self.keys_per_minute = keys_per_minute
        self.max_rows = max_rows
        self.max_pending = max_pending
        self.flush_s = flush_s
        self._pending: dict[TallyKey, tuple[int, float]] = {}
        self._lock = threading.Lock()  # counted on the event loop, written from a thread
        self._flush_lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        self._trimmed_at = 0.0

    def count(self, *, source: str, action: str, target: str, result: int, now: float | None = None) -> None:
        now = time.time() if now is None else now
        key = TallyKey(float(int(now // 60) * 60), source[:100], action[:100], target[:100], result)
        with self._lock:
            if key not in self._pending and len(self._pending) >= self.max_pending:
                key = TallyKey(key.minute, OTHERS, OTHERS, "", result)
            n, _ = self._pending.get(key, (0, 0.0))
            self._pending[key] = (n + 1, now)

    def flush(self, wait_s: float | None = None) -> int:
        """Write what was counted; returns the keys written. ``wait_s``: the longest wait for another flush and for
        the database's lock (none written if that runs out: they are counted again at the next flush)."""
        if not self._flush_lock.acquire(timeout=-1 if wait_s is None else wait_s):
            return 0
        try:
            with self._lock:
                pending, self._pending = self._pending, {}
            if not pending:
                return 0
            try:
                self._write(pending, wait_s)
            except SQLAlchemyError:
                with self._lock:  # counted again next time (bounded as before)
                    for key, (n, last) in pending.items():
                        m, t = self._pending.get(key, (0, 0.0))
                        self._pending[key] = (m + n, max(t, last))
                raise
            return len(pending)
        finally:
            self._flush_lock.release()

    def _write(self, pending: dict[TallyKey, tuple[int, float]], wait_s: float | None) -> None:
        # An upsert in either dialect (both spell it on_conflict_do_update); the larger of two values is max() in
        # SQLite and greatest() in PostgreSQL.
        pg = self.db.dialect == "postgresql"
        insert = postgresql.insert if pg else sqlite.insert
        newest = func.greatest if pg else func.max
        with self.db.session(wait_s) as s:
            room: dict[float, int] = {}
            for minute in {k.minute for k in pending}:
                room[minute] = self.keys_per_minute - s.exec(
                    select(func.count()).select_from(AuditTally).where(AuditTally.minute == minute)).one()
            for key, (n, last) in sorted(pending.items()):
                exists = s.exec(select(AuditTally.id).where(
                    AuditTally.minute == key.minute, AuditTally.source == key.source,
                    AuditTally.action == key.action, AuditTally.target == key.target,
                    AuditTally.result == key.result)).first()
                if exists is None:
                    if room[key.minute] <= 0 and key.source != OTHERS:
                        key = TallyKey(key.minute, OTHERS, OTHERS, "", key.result)
                    room[key.minute] -= 1
                s.execute(insert(AuditTally).values(**key._asdict(), count=n, last_ts=last).on_conflict_do_update(
                    index_elements=["minute", "source", "action", "target", "result"],
                    set_={"count": AuditTally.count + n, "last_ts": newest(AuditTally.last_ts, last)}))
            if time.monotonic() - self._trimmed_at > 60:
                self._trimmed_at = time.monotonic()
                excess = s.exec(select(func.count()).select_from(AuditTally)).one() - self.max_rows
                if excess > 0:
                    oldest = select(AuditTally.id).order_by(col(AuditTally.minute), col(AuditTally.id)).limit(excess)
                    s.execute(delete(AuditTally).where(col(AuditTally.id).in_(oldest)))

    def query(self, *, since: float | None = None, until: float | None = None, source: str | None = None,
              action: str | None = None, target: str | None = None, result: int | None = None,
              limit: int = 500) -> Sequence[AuditTally]:
        """Tallies newest minute first (what was counted until now included, when the database's lock can be had
        within READ_FLUSH_WAIT_S: else what is committed, and the rest at the next flush)."""
        try:
            self.flush(READ_FLUSH_WAIT_S)
        except UNAVAILABLE as exc:
            log.info("audit tallies: not written before a read (%s); the read serves what is committed", exc)
        source, action, target = (portable(v, self.db.dialect) for v in (source, action, target))
        with self.db.read() as s:
            q = select(AuditTally)
            if since is not None:
                q = q.where(AuditTally.minute >= since - 59)  # a minute that ends after since
            if until is not None:
                q = q.where(AuditTally.minute < until)
            if source:
                q = q.where(AuditTally.source == source)
            if action:
                q = q.where(col(AuditTally.action).startswith(action))
            if target:
                q = q.where(col(AuditTally.target).contains(target))
            if result is not None:
                q = q.where(AuditTally.result == result)
            return s.exec(q.order_by(col(AuditTally.minute).desc(), col(AuditTally.count).desc())
                          .limit(limit)).all()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_s)
            if self._pending:
                try:
                    await asyncio.to_thread(self.flush)
                except SQLAlchemyError:
                    log.exception("audit: could not write the tallies of refused requests (kept, tried again)")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="audit-tallies")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await asyncio.to_thread(self.flush)


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
        actor, action, target, text_ = (portable(v, self.db.dialect) for v in (actor, action, target, text_))
        with self.db.read() as s:
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


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # a spreadsheet reads a cell starting so as a formula


def cell(value: object) -> object:
    """A CSV cell a spreadsheet shows as text: one starting like a formula gets a leading ' (OWASP's advice)."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


def to_csv(rows: Sequence[AuditRecord]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["id", "time_utc", "actor", "role", "action", "target", "before", "after", "source", "result",
                     "detail"])
    for r in rows:
        writer.writerow([cell(v) for v in (
            r.id, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r.ts)), r.actor, r.role, r.action, r.target,
            json.dumps(r.before), json.dumps(r.after), r.source, r.result, r.detail)])
    return out.getvalue()


class AuditMiddleware:
    """Records every mutating /api request before its response's last bytes leave, so a client that has its answer
    finds the record (pure ASGI: /v1 streams pass untouched). The write runs on a thread: a busy database must not
    stall the event loop that also carries the gateway's streams."""

    def __init__(self, app: ASGIApp, log: AuditLog, tallies: AuditTallies | None = None,
                 console_key: str | None = None) -> None:
        self.app = app
        self.log = log
        self.tallies = tallies
        self.console_key = console_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in MUTATING or not scope["path"].startswith("/api/"):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["source"] = source_of(scope, self.console_key)  # who sent it (sign-ins share the hashing by it)
        status = 0
        recorded = False

        async def record() -> None:
            nonlocal recorded
            if recorded:
                return
            recorded = True
            if self._tallied(scope, state, status or 500):
                return
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

    def _tallied(self, scope: Scope, state: dict[str, Any], status: int) -> bool:
        """Count a refused request instead of writing its row (in memory: no thread, no write per request): one
        without a valid credential, and one the gate refused for what its credential is (403: a viewer's change, a
        gateway key on /api) — a key or a viewer token wrote 300-370 full rows a second of those (issue 31); the
        count's source names the credential. A change an authenticated caller may make stays a row of its own,
        refused or not, and so does a refusal its route made (an operator turning trust_remote_code on)."""
        principal = state.get("principal")
        if self.tallies is None or status < 400 or (principal is not None and not state.get("refused_by_gate")):
            return False
        note: AuditNote = state.get("audit") or AuditNote()
        source = source_of(scope, self.console_key)
        if principal is not None:
            source = f"{source} as {principal.kind} {principal.name}"[:200]
        self.tallies.count(source=source, target=note.target, result=status,
                           action=state.get("audit_action") or generic_action(scope["method"], scope["path"]))
        return True

    def _write(self, scope: Scope, state: dict[str, Any], status: int) -> None:
        """The request's record: who (the authenticated principal, else the user a sign-in signed in, else
        anonymous, with the name it tried as its target), the route's declared action, and what its handler said
        it did; never the request's bytes."""
        principal = state.get("principal")
        note: AuditNote = state.get("audit") or AuditNote()
        if principal is not None:
            actor, role = principal.name, principal.role
        elif state.get("audit_action") == "auth.login" and status < 400 and note.target.startswith("user "):
            actor, role = note.target.removeprefix("user "), note.role
        else:
            actor, role = "anonymous", ""
        after = note.after
        if after is None:  # refused before its handler said anything: how much was sent, never what
            size = next((v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"content-length"), None)
            after = {"body": f"{size} bytes"} if size and size.isdigit() else None
        self.log.record(actor=actor, role=role, source=source_of(scope, self.console_key),
                        action=state.get("audit_action") or generic_action(scope["method"], scope["path"]),
                        target=note.target, before=note.before, after=after, result=status, detail=note.detail,
                        deployment=state.get("deployment"))
