"""Settings revisions in the database: numbered, immutable apart from their status.

The *desired* revision is the newest one whose status is ``pending`` or ``applied``: a row inserted straight into
the table (status defaults to pending) becomes desired, and a rejected revision hands the role back to the last
applied one. Each deployment has its own history: a store is the view of one deployment's revisions (a row
inserted without a deployment is the default deployment's).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func
from sqlmodel import col, select

from engine.db import ACTIVE, DEFAULT_DEPLOYMENT, Database, Event, Revision, RevisionStatus, json_true
from engine.errors import RevisionNotFoundError, StaleRevisionError


class RevisionStore:
    def __init__(self, db: Database, deployment_id: int = DEFAULT_DEPLOYMENT) -> None:
        self.db = db
        self.session = db.session
        self.deployment_id = deployment_id

    def of(self, deployment_id: int) -> RevisionStore:
        """The same store, for another deployment's revisions."""
        return RevisionStore(self.db, deployment_id)

    def _mine(self) -> Any:
        return Revision.deployment_id == self.deployment_id

    def ensure_initial(self, values: dict[str, Any], author: str = "system") -> bool:
        """Create the deployment's first revision on an empty history; True when it did."""
        with self.session() as s:
            if s.exec(select(Revision.id).where(self._mine()).limit(1)).first() is not None:
                return False
            s.add(Revision(deployment_id=self.deployment_id, values=values, author=author, note="initial settings"))
            return True

    def desired_revision(self) -> Revision | None:
        with self.db.read() as s:
            return s.exec(select(Revision).where(self._mine(), col(Revision.status).in_(ACTIVE))
                          .order_by(col(Revision.id).desc()).limit(1)).first()

    def desired_revision_id(self) -> int | None:
        with self.db.read() as s:
            return s.exec(select(Revision.id).where(self._mine(), col(Revision.status).in_(ACTIVE))
                          .order_by(col(Revision.id).desc()).limit(1)).first()

    def head_revision_id(self) -> int | None:
        with self.db.read() as s:
            return s.exec(select(Revision.id).where(self._mine()).order_by(col(Revision.id).desc()).limit(1)).first()

    def get_revision(self, revision_id: int) -> Revision:
        """One of this deployment's revisions (another deployment's is not found here)."""
        with self.db.read() as s:
            rev = s.get(Revision, revision_id)
            if rev is None or rev.deployment_id != self.deployment_id:
                raise RevisionNotFoundError(revision_id)
            return rev

    def history(self, limit: int = 50, before: int | None = None) -> Sequence[Revision]:
        with self.db.read() as s:
            q = select(Revision).where(self._mine()).order_by(col(Revision.id).desc()).limit(limit)
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
            current = s.exec(select(Revision.id).where(self._mine(), col(Revision.status).in_(ACTIVE))
                             .order_by(col(Revision.id).desc()).limit(1)).first()
            if current is None:
                current = s.exec(select(Revision.id).where(self._mine()).order_by(col(Revision.id).desc())
                                 .limit(1)).first()
            if base_revision is not None and base_revision != current:
                raise StaleRevisionError(base_revision, current)
            now = time.time()
            for old in s.exec(select(Revision).where(self._mine(),
                                                     Revision.status == RevisionStatus.PENDING.value)).all():
                old.status = RevisionStatus.SUPERSEDED.value
                old.status_reason = "replaced before it was applied"
                old.status_at = now
                s.add(old)
            rev = Revision(deployment_id=self.deployment_id, values=values, author=author, note=note,
                           parent_id=current, forced=forced, warnings=warnings or [], created_at=now)
            s.add(rev)
            s.flush()
            return rev

    def mark_applied(self, revision_id: int, reason: str = "ready") -> None:
        """The revision is now running and ready: it is the one applied; earlier applied ones are superseded."""
        with self.session() as s:
            now = time.time()
            for old in s.exec(select(Revision).where(self._mine(), Revision.status == RevisionStatus.APPLIED.value,
                                                     Revision.id != revision_id)).all():
                old.status = RevisionStatus.SUPERSEDED.value
                old.status_reason = f"superseded by revision {revision_id}"
                old.status_at = now
                s.add(old)
            for older in s.exec(select(Revision).where(self._mine(), Revision.status == RevisionStatus.PENDING.value,
                                                       col(Revision.id) < revision_id)).all():
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
        with self.db.read() as s:
            rows = s.exec(
                select(Event.revision_id, func.count()).where(
                    Event.kind == "diagnosis", col(Event.revision_id).in_(list(revision_ids)),
                    json_true(col(Event.data), "is_oom")).group_by(col(Event.revision_id))
            ).all()
        return {int(r): int(n) for r, n in rows if r is not None}
