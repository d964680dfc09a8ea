"""Writing settings: one use case for the API, the CLI and benchmarks. Validate, pre-flight, create the revision
(compare-and-set on its base), record the change as an event, wake the controller; and the audit entry of it.

Pre-flight is capacity's: it is handed in (``Checker``), so that revisions do not depend on the capacity model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from engine.db import Revision
from engine.errors import PreflightError
from engine.events import EventLog
from engine.revisions.settings import EngineSettings, FlagSource, merge_values, validate_settings
from engine.revisions.store import RevisionStore


class FindingLike(Protocol):
    code: str
    field: str
    message: str
    fit: dict[str, Any]

    def as_dict(self) -> dict[str, Any]: ...


class CheckLike(Protocol):
    @property
    def errors(self) -> Sequence[FindingLike]: ...

    @property
    def warnings(self) -> Sequence[FindingLike]: ...


class Checker(Protocol):
    def check(self, settings: EngineSettings) -> CheckLike: ...


@dataclass
class Change:
    """A revision just written, and what the audit keeps of it."""

    revision: Revision
    forced: bool
    target: str
    before: dict[str, Any]
    after: dict[str, Any]
    detail: str
    diff: dict[str, dict[str, Any]] = field(default_factory=dict)


class SettingsWriter:
    def __init__(self, revisions: RevisionStore, events: EventLog, checker: Checker, data_dir: Path,
                 model_roots: list[Path], wake: Callable[[], None] = lambda: None,
                 flags: FlagSource | None = None) -> None:
        self.revisions = revisions
        self.events = events
        self.checker = checker
        self.data_dir = data_dir
        self.model_roots = model_roots
        self.wake = wake
        self.flags = flags

    def validate(self, values: dict[str, Any]) -> EngineSettings:
        return validate_settings(values, self.data_dir, self.model_roots, self.flags)

    def write(self, base_revision: int | None, changes: dict[str, Any], *, author: str, note: str = "",
              force: bool = False) -> Change:
        """A new desired revision: the base's values with ``changes``. ``base_revision=None`` writes on top of
        the desired revision without the stale check (benchmarks)."""
        base = self.revisions.get_revision(base_revision) if base_revision is not None else \
            self.revisions.desired_revision()
        base_values = base.values if base is not None else {}
        settings = self.validate(merge_values(base_values, changes))
        forced, findings = self._preflight(settings, force)
        rev = self.revisions.create_revision(settings.model_dump(), base_revision=base_revision, author=author,
                                             note=note, forced=forced, warnings=findings)
        detail = (f"base {base_revision}" if base_revision is not None else "on the desired revision") + \
            (" (forced)" if forced else "") + (f"; note: {note}" if note else "")
        return self._changed(rev, base_values, detail, forced)

    def rollback(self, target_id: int, *, author: str, note: str = "", force: bool = False,
                 base_revision: int | None = None) -> Change:
        """A new desired revision equal to an earlier one. ``base_revision``: the desired revision it was decided
        on, if that matters (StaleRevisionError if another is desired by the time it is written)."""
        target = self.revisions.get_revision(target_id)
        current = self.revisions.desired_revision()
        settings = self.validate(target.values)
        forced, findings = self._preflight(settings, force)
        rev = self.revisions.create_revision(settings.model_dump(), base_revision=base_revision, author=author,
                                             note=note or f"rollback to revision {target_id}", forced=forced,
                                             warnings=findings)
        return self._changed(rev, current.values if current else {},
                             f"rollback to revision {target_id}" + (" (forced)" if forced else ""), forced)

    def _preflight(self, settings: EngineSettings, force: bool) -> tuple[bool, list[dict[str, Any]]]:
        """Refuse on pre-flight errors unless forced. Returns (forced, findings to record with the revision)."""
        result = self.checker.check(settings)
        errors: list[dict[str, object]] = [
            {"type": "preflight", "loc": ["body", "values", f.field], "msg": f.message, "code": f.code, "fit": f.fit}
            for f in result.errors]
        if errors and not force:
            raise PreflightError(errors)
        recorded = [{**f.as_dict(), "severity": "warning"} for f in result.warnings]
        recorded += [{**f.as_dict(), "severity": "error", "forced": True} for f in result.errors]
        return bool(errors), recorded

    def _changed(self, rev: Revision, before: dict[str, Any], detail: str, forced: bool) -> Change:
        """Record the change as an event, wake the controller; the audit entry (target, before, after, detail)."""
        diff = {k: {"from": before.get(k), "to": v} for k, v in rev.values.items() if before.get(k) != v}
        self.events.add("settings_changed", f"revision {rev.id} by {rev.author}: "
                        + (", ".join(f"{k}={d['to']}" for k, d in diff.items()) or "no change")
                        + (f" ({rev.note})" if rev.note else ""), revision_id=rev.id, data={"diff": diff})
        self.wake()
        return Change(rev, forced, f"revision {rev.id}", {k: d["from"] for k, d in diff.items()},
                      {k: d["to"] for k, d in diff.items()}, detail, diff)
