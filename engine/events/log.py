"""The engine's events: what it did and why (settings changes, starts, failures, rollbacks, alerts), in order.

Written from threads with ``add``, from the event loop with ``await emit(...)`` (the write runs on a thread: no
SQLite on the event loop). A log may be one deployment's (``of``): what it writes is that deployment's, and what
it reads is that deployment's and the engine's own (GPU alerts, the engine starting), which concern every one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, true
from sqlmodel import col, select

from engine.db import Database, Event


class EventLog:
    def __init__(self, db: Database, deployment_id: int | None = None) -> None:
        self.db = db
        self.session = db.session
        self.deployment_id = deployment_id

    def of(self, deployment_id: int | None) -> EventLog:
        """The log of one deployment (None: the engine's own, and reading every deployment's)."""
        return EventLog(self.db, deployment_id)

    async def emit(self, kind: str, message: str, *, severity: str = "info", revision_id: int | None = None,
                   data: dict[str, Any] | None = None) -> Event:
        """Record an event from the event loop: the SQLite write runs on a thread."""
        return await asyncio.to_thread(self.add, kind, message, severity=severity, revision_id=revision_id,
                                       data=data)

    def add(
        self,
        kind: str,
        message: str,
        *,
        severity: str = "info",
        revision_id: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> Event:
        with self.session() as s:
            ev = Event(kind=kind, message=message, severity=severity, revision_id=revision_id, data=data or {},
                       deployment_id=self.deployment_id)
            s.add(ev)
            s.flush()
            return ev

    def _scope(self) -> Any:
        if self.deployment_id is None:
            return true()
        return (col(Event.deployment_id) == self.deployment_id) | col(Event.deployment_id).is_(None)

    def event_counts(self, kinds: Sequence[str]) -> dict[str, int]:
        with self.db.read() as s:
            rows = s.exec(select(Event.kind, func.count()).where(col(Event.kind).in_(list(kinds)), self._scope())
                          .group_by(col(Event.kind))).all()
        return {k: int(n) for k, n in rows}

    def events(
        self, since: int = 0, limit: int = 200, kinds: Sequence[str] | None = None, newest_first: bool = False
    ) -> Sequence[Event]:
        with self.db.read() as s:
            q = select(Event).where(col(Event.id) > since, self._scope())
            if kinds:
                q = q.where(col(Event.kind).in_(list(kinds)))
            q = q.order_by(col(Event.id).desc() if newest_first else col(Event.id)).limit(limit)
            return s.exec(q).all()
