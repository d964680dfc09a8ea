"""Rows of the database as the API returns them (engine/schemas)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from engine.db import Event, Revision
from engine.schemas import EventOut, Finding, RevisionOut, SettingsValues


def when(ts: float | None) -> datetime | None:
    return None if ts is None else datetime.fromtimestamp(ts, UTC)


def revision_out(rev: Revision, oom_count: int = 0) -> RevisionOut:
    assert rev.id is not None
    return RevisionOut(revision=rev.id, values=SettingsValues.model_validate(rev.values), status=rev.status,
                       status_reason=rev.status_reason, author=rev.author, note=rev.note,
                       created_at=when(rev.created_at) or datetime.now(UTC), parent_revision=rev.parent_id,
                       forced=rev.forced,
                       warnings=[Finding.model_validate(w) for w in rev.warnings if isinstance(w, dict)],
                       oom_count=oom_count)


def event_out(ev: Event, deployments: Mapping[int, str] | None = None) -> EventOut:
    """``deployments``: names by id, to say whose event it is."""
    assert ev.id is not None
    data: dict[str, Any] = ev.data if isinstance(ev.data, dict) else {}
    name = (deployments or {}).get(ev.deployment_id) if ev.deployment_id is not None else None
    return EventOut(id=ev.id, ts=when(ev.ts) or datetime.now(UTC), kind=ev.kind, severity=ev.severity,
                    message=ev.message, revision=ev.revision_id, data=data, deployment=name)
