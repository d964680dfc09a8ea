"""Settings revisions in the database: numbered, immutable apart from their status.

The *desired* revision is the newest one whose status is ``pending`` or ``applied``: a row inserted straight into
the table (status defaults to pending) becomes desired, and a rejected revision hands the role back to the last
applied one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func
from sqlmodel import col, select

from engine.db import ACTIVE, Database, Event, Revision, RevisionStatus, json_true
from engine.errors import RevisionNotFoundError, StaleRevisionError


class RevisionStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.session = db.session

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
                    json_true(col(Event.data), "is_oom")).group_by(col(Event.revision_id))
            ).all()
        return {int(r): int(n) for r, n in rows if r is not None}
