"""The one sink of serving's bookkeeping: events, the audit entries the engine writes itself (an automatic
rollback, a halt), and the revision marks (applied, rejected). Every write runs on a thread (no SQLite on the event
loop); a database that cannot take one (down, a full disk, a lock held too long) loses it, loudly in the engine's
log and counted in ``unrecorded``, and nothing else: vLLM keeps serving and the loop goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from engine.access import AuditLog
from engine.events import EventLog
from engine.revisions import DeploymentRef, RevisionStore

log = logging.getLogger("llmops.serving")


class Recorder:
    def __init__(self, events: EventLog, revisions: RevisionStore, audit: AuditLog | None,
                 deployment: DeploymentRef) -> None:
        self.events = events
        self.revisions = revisions
        self.audit_log = audit
        self.deployment = deployment
        self.unrecorded = 0  # writes the database could not take

    async def event(self, kind: str, message: str, severity: str = "info", revision_id: int | None = None,
                    data: dict[str, Any] | None = None) -> None:
        try:
            await self.events.emit(kind, message, severity=severity, revision_id=revision_id, data=data)
        except SQLAlchemyError as exc:
            self.unrecorded += 1
            log.error("serving: could not record the event %s (%s): %s", kind, message, exc)

    async def write(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            await asyncio.to_thread(fn, *args)
        except SQLAlchemyError as exc:
            self.unrecorded += 1
            log.error("serving: could not record %s: %s", what, exc)

    async def mark_applied(self, revision_id: int) -> None:
        await self.write(f"revision {revision_id} as applied", self.revisions.mark_applied, revision_id)

    async def mark_rejected(self, revision_id: int, reason: str) -> None:
        await self.write(f"revision {revision_id} as rejected", self.revisions.mark_rejected, revision_id, reason)

    async def audit(self, what: str, *, action: str, target: str, detail: str,
                    before: dict[str, Any] | None = None, after: dict[str, Any] | None = None) -> None:
        """An entry of the engine's own in the audit log (``what``: how the log line names it if it is lost)."""
        if self.audit_log is None:
            return
        await self.write(what, functools.partial(self.audit_log.record, actor="engine", action=action, target=target,
                                                 deployment=self.deployment.name, before=before, after=after,
                                                 detail=detail))
