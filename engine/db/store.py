"""SQLite store (WAL) of settings revisions and events, through SQLModel. Only the engine touches it.

Revisions are immutable apart from their status. The *desired* revision is the newest one whose status is
``pending`` or ``applied``: a row inserted straight into the table (status defaults to pending) becomes
desired, and a rejected revision hands the role back to the last applied one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, Column, Engine, event, func, text
from sqlmodel import Field, Session, SQLModel, col, create_engine, select

from engine.db.migrate import add_missing_columns
from engine.errors import RevisionNotFoundError, StaleRevisionError

_NOW_SQL = "((julianday('now') - 2440587.5) * 86400.0)"


class RevisionStatus(StrEnum):
    PENDING = "pending"
    APPLIED = "applied"
    REJECTED = "rejected"
    SUPERSEDED = "superseded"


ACTIVE = (RevisionStatus.PENDING.value, RevisionStatus.APPLIED.value)


class Revision(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    values: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
    author: str = Field(default="unknown", sa_column_kwargs={"server_default": "unknown"})
    note: str = Field(default="", sa_column_kwargs={"server_default": ""})
    created_at: float = Field(default_factory=time.time, sa_column_kwargs={"server_default": text(_NOW_SQL)})
    parent_id: int | None = Field(default=None, foreign_key="revision.id")
    status: str = Field(default=RevisionStatus.PENDING.value, index=True,
                        sa_column_kwargs={"server_default": RevisionStatus.PENDING.value})
    status_reason: str = Field(default="", sa_column_kwargs={"server_default": ""})
    status_at: float | None = None
    forced: bool = Field(default=False, sa_column_kwargs={"server_default": "0"})
    warnings: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False,
                                                                                    server_default="[]"))


class Event(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    ts: float = Field(default_factory=time.time, index=True)
    kind: str = Field(index=True)
    severity: str = "info"
    message: str = ""
    revision_id: int | None = None
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False, server_default="{}"))


class SavedPrompt(SQLModel, table=True):
    __tablename__ = "saved_prompt"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(index=True)
    mode: str = "chat"  # chat | completion
    system: str = ""
    prompt: str = ""
    params: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False, server_default="{}"))
    author: str = "unknown"
    created_at: float = Field(default_factory=time.time)


def make_engine(path: Path) -> Engine:
    """A SQLAlchemy engine on a WAL-mode SQLite file; transactions take the write lock up front."""
    path.parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        f"sqlite:///{path}",
        connect_args={"check_same_thread": False, "timeout": 10, "isolation_level": None},
        json_serializer=lambda obj: json.dumps(obj, separators=(",", ":")),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=10000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        # pysqlite's own transaction handling is off (isolation_level=None): begin explicitly, and take the
        # write lock at once so that a compare-and-set on the desired revision cannot interleave.
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.engine = make_engine(path)
        add_missing_columns(self.engine, SQLModel.metadata)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def session(self) -> Iterator[Session]:
        with Session(self.engine, expire_on_commit=False) as session, session.begin():
            yield session

    # --- revisions ----------------------------------------------------------------------------------------

    def ensure_initial(self, values: dict[str, Any], author: str = "system") -> bool:
        """Create revision 1 on an empty store; True when it did."""
        with self.session() as s:
            if s.exec(select(Revision.id).limit(1)).first() is not None:
                return False
            s.add(Revision(values=values, author=author, note="initial settings"))
            return True

    def desired_revision(self) -> Revision | None:
        with self.session() as s:
            return s.exec(
                select(Revision).where(col(Revision.status).in_(ACTIVE)).order_by(col(Revision.id).desc()).limit(1)
            ).first()

    def desired_revision_id(self) -> int | None:
        with self.session() as s:
            return s.exec(
                select(Revision.id).where(col(Revision.status).in_(ACTIVE)).order_by(col(Revision.id).desc()).limit(1)
            ).first()

    def head_revision_id(self) -> int | None:
        with self.session() as s:
            return s.exec(select(Revision.id).order_by(col(Revision.id).desc()).limit(1)).first()

    def get_revision(self, revision_id: int) -> Revision:
        with self.session() as s:
            rev = s.get(Revision, revision_id)
            if rev is None:
                raise RevisionNotFoundError(revision_id)
            return rev

    def history(self, limit: int = 50, before: int | None = None) -> Sequence[Revision]:
        with self.session() as s:
            q = select(Revision).order_by(col(Revision.id).desc()).limit(limit)
            if before is not None:
                q = q.where(col(Revision.id) < before)
            return s.exec(q).all()

    def create_revision(
        self,
        values: dict[str, Any],
        *,
        base_revision: int | None,
        author: str,
        note: str = "",
        forced: bool = False,
        warnings: list[dict[str, Any]] | None = None,
    ) -> Revision:
        """Write a new desired revision if ``base_revision`` is still the desired one (else StaleRevisionError).

        ``base_revision=None`` skips the check (rollback, automatic writes). Pending revisions that never ran
        are superseded by the new one.
        """
        with self.session() as s:
            current = s.exec(
                select(Revision.id).where(col(Revision.status).in_(ACTIVE)).order_by(col(Revision.id).desc()).limit(1)
            ).first()
            if current is None:
                current = s.exec(select(Revision.id).order_by(col(Revision.id).desc()).limit(1)).first()
            if base_revision is not None and base_revision != current:
                raise StaleRevisionError(base_revision, current)
            now = time.time()
            for old in s.exec(select(Revision).where(Revision.status == RevisionStatus.PENDING.value)).all():
                old.status = RevisionStatus.SUPERSEDED.value
                old.status_reason = "replaced before it was applied"
                old.status_at = now
                s.add(old)
            rev = Revision(values=values, author=author, note=note, parent_id=current, forced=forced,
                           warnings=warnings or [], created_at=now)
            s.add(rev)
            s.flush()
            return rev

    def mark_applied(self, revision_id: int, reason: str = "ready") -> None:
        """The revision is now running and ready: it is the one applied; earlier applied ones are superseded."""
        with self.session() as s:
            now = time.time()
            for old in s.exec(
                select(Revision).where(Revision.status == RevisionStatus.APPLIED.value, Revision.id != revision_id)
            ).all():
                old.status = RevisionStatus.SUPERSEDED.value
                old.status_reason = f"superseded by revision {revision_id}"
                old.status_at = now
                s.add(old)
            for older in s.exec(
                select(Revision).where(Revision.status == RevisionStatus.PENDING.value, col(Revision.id) < revision_id)
            ).all():
                older.status = RevisionStatus.SUPERSEDED.value
                older.status_reason = f"superseded by revision {revision_id}"
                older.status_at = now
                s.add(older)
            rev = s.get(Revision, revision_id)
            if rev is None:
                raise RevisionNotFoundError(revision_id)
            rev.status = RevisionStatus.APPLIED.value
            rev.status_reason = reason
            rev.status_at = now
            s.add(rev)

    def mark_rejected(self, revision_id: int, reason: str) -> None:
        with self.session() as s:
            rev = s.get(Revision, revision_id)
            if rev is None:
                raise RevisionNotFoundError(revision_id)
            rev.status = RevisionStatus.REJECTED.value
            rev.status_reason = reason
            rev.status_at = time.time()
            s.add(rev)

    def oom_counts(self, revision_ids: Sequence[int]) -> dict[int, int]:
        """Failures diagnosed as out-of-memory, per revision (the OOM rate operators track)."""
        if not revision_ids:
            return {}
        with self.session() as s:
            rows = s.exec(
                select(Event.revision_id, func.count()).where(
                    Event.kind == "diagnosis", col(Event.revision_id).in_(list(revision_ids)),
                    func.json_extract(Event.data, "$.is_oom") == 1).group_by(col(Event.revision_id))
            ).all()
        return {int(r): int(n) for r, n in rows if r is not None}

    # --- saved prompts (the playground's) ------------------------------------------------------------------

    def prompts(self) -> Sequence[SavedPrompt]:
        with self.session() as s:
            return s.exec(select(SavedPrompt).order_by(col(SavedPrompt.id).desc())).all()

    def save_prompt(self, prompt: SavedPrompt) -> SavedPrompt:
        with self.session() as s:
            s.add(prompt)
            s.flush()
            return prompt

    def delete_prompt(self, prompt_id: int) -> bool:
        with self.session() as s:
            found = s.get(SavedPrompt, prompt_id)
            if found is None:
                return False
            s.delete(found)
            return True

    # --- events -------------------------------------------------------------------------------------------

    def add_event(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        revision_id: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Event:
        with self.session() as s:
            ev = Event(kind=kind, message=message, severity=severity, revision_id=revision_id, data=data or {})
            s.add(ev)
            s.flush()
            return ev

    def event_counts(self, kinds: Sequence[str]) -> dict[str, int]:
        with self.session() as s:
            rows = s.exec(select(Event.kind, func.count()).where(col(Event.kind).in_(list(kinds)))
                          .group_by(col(Event.kind))).all()
        return {k: int(n) for k, n in rows}

    def events(
        self, since: int = 0, limit: int = 200, kinds: Sequence[str] | None = None, newest_first: bool = False
    ) -> Sequence[Event]:
        with self.session() as s:
            q = select(Event).where(col(Event.id) > since)
            if kinds:
                q = q.where(col(Event.kind).in_(list(kinds)))
            q = q.order_by(col(Event.id).desc() if newest_first else col(Event.id)).limit(limit)
            return s.exec(q).all()
