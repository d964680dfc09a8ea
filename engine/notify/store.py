"""Alert channels, rules and what fired, in the store. Every change is audited by the route that asks for it
(engine/api/routes/alerts.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy import delete
from sqlmodel import col, select

from engine.db import AlertChannel, AlertFired, AlertRule, Database
from engine.errors import EngineError
from engine.notify.channels import check_url
from engine.notify.rules import KINDS
from engine.schemas import check_name

Row = TypeVar("Row", AlertChannel, AlertRule)
HISTORY_KEPT_S = 90 * 86400  # what fired is kept this long


class AlertStoreError(EngineError):
    """A change refused: ``field`` names what is wrong (422), or the channel or rule does not exist (404)."""

    def __init__(self, message: str, field: str | None = None, missing: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.missing = missing


def _name(name: str) -> None:
    try:
        check_name(name)
    except ValueError as exc:
        raise AlertStoreError(f"name: {exc}", "name") from None


class AlertStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        self.changes = 0  # edits: the notifier reads rules and channels again
        self._delivered = threading.Lock()
        self._edits = threading.Lock()

    def _edited(self) -> None:
        """An edit committed (by one of the API's threads): counted once each, none lost to another's."""
        with self._edits:
            self.changes += 1

    # --- channels -------------------------------------------------------------------------------------------

    def channels(self) -> Sequence[AlertChannel]:
        with self.db.read() as s:
            return s.exec(select(AlertChannel).order_by(col(AlertChannel.id))).all()

    def channel(self, channel_id: int) -> AlertChannel:
        with self.db.read() as s:
            row = s.get(AlertChannel, channel_id)
            if row is None:
                raise AlertStoreError(f"no channel {channel_id}", missing=True)
            return row

    def create_channel(self, name: str, kind: str, url: str, enabled: bool, created_by: str) -> AlertChannel:
        _name(name)
        check_url(url)
        with self.db.session() as s:
            if s.exec(select(AlertChannel.id).where(AlertChannel.name == name)).first() is not None:
                raise AlertStoreError(f"a channel named {name!r} exists", "name")
            row = AlertChannel(name=name, kind=kind, url=url, enabled=enabled, created_by=created_by)
            s.add(row)
            s.flush()
        self._edited()
        return row

    def update_channel(self, channel_id: int, changes: dict[str, Any]) -> tuple[dict[str, Any], AlertChannel]:
        if "url" in changes:
            check_url(changes["url"])
        return self._update(AlertChannel, "channel", channel_id, changes)

    def delete_channel(self, channel_id: int) -> AlertChannel:
        return self._delete(AlertChannel, "channel", channel_id)

    def _update(self, table: type[Row], what: str, row_id: int, changes: dict[str, Any],
                check: Callable[[Row], None] | None = None) -> tuple[dict[str, Any], Row]:
        """Set ``changes`` on row ``row_id`` (``check``ed first): (its fields before, the row after)."""
        with self.db.session() as s:
            row = s.get(table, row_id)
            if row is None:
                raise AlertStoreError(f"no {what} {row_id}", missing=True)
            if check is not None:
                check(row)
            before = {f: getattr(row, f) for f in changes}
            for field, value in changes.items():
                setattr(row, field, value)
            s.add(row)
            s.flush()
        self._edited()
        return before, row

    def _delete(self, table: type[Row], what: str, row_id: int) -> Row:
        with self.db.session() as s:
            row = s.get(table, row_id)
            if row is None:
                raise AlertStoreError(f"no {what} {row_id}", missing=True)
            s.delete(row)
        self._edited()
        return row

    # --- rules ----------------------------------------------------------------------------------------------

    def rules(self) -> Sequence[AlertRule]:
        with self.db.read() as s:
            return s.exec(select(AlertRule).order_by(col(AlertRule.id))).all()

    def _check_channels(self, channels: list[int] | None) -> None:
        if channels is None:
            return
        known = {c.id for c in self.channels()}
        if unknown := [c for c in channels if c not in known]:
            raise AlertStoreError(f"no channel {unknown[0]} (GET /api/alerts/channels lists them)", "channels")

    def create_rule(self, values: dict[str, Any], created_by: str) -> AlertRule:
        _name(values["name"])
        info = KINDS[values["kind"]]
        if info.level and values.get("threshold") is None:
            values["threshold"] = info.default_threshold
        if values.get("for_s") is None:
            values["for_s"] = info.default_for_s
        self._check_channels(values.get("channels"))
        with self.db.session() as s:
            if s.exec(select(AlertRule.id).where(AlertRule.name == values["name"])).first() is not None:
                raise AlertStoreError(f"a rule named {values['name']!r} exists", "name")
            row = AlertRule(**values, created_by=created_by)
            s.add(row)
            s.flush()
        self._edited()
        return row

    def update_rule(self, rule_id: int, changes: dict[str, Any]) -> tuple[dict[str, Any], AlertRule]:
        self._check_channels(changes.get("channels"))

        def threshold_kept(row: AlertRule) -> None:
            if KINDS[row.kind].level and "threshold" in changes and changes["threshold"] is None:
                raise AlertStoreError(f"threshold: a {row.kind} rule compares a figure with one", "threshold")

        return self._update(AlertRule, "rule", rule_id, changes, threshold_kept)

    def delete_rule(self, rule_id: int) -> AlertRule:
        return self._delete(AlertRule, "rule", rule_id)

    # --- what fired -----------------------------------------------------------------------------------------

    def fired(self, rule: AlertRule, subject: str, value: float | None, message: str, at: float) -> int:
        with self.db.session() as s:
            row = AlertFired(rule_id=rule.id or 0, rule=rule.name, kind=rule.kind, subject=subject, value=value,
                             message=message, fired_at=at)
            s.add(row)
            s.flush()
            assert row.id is not None
            return row.id

    def resolved(self, rule_id: int, subject: str, value: float | None, at: float) -> tuple[int, float] | None:
        """The firing alert of ``rule_id`` and ``subject``, resolved now: its id and when it fired (None: none
        was firing)."""
        with self.db.session() as s:
            row = s.exec(select(AlertFired).where(AlertFired.rule_id == rule_id, AlertFired.subject == subject,
                                                  AlertFired.state == "firing").order_by(
                col(AlertFired.id).desc())).first()
            if row is None:
                return None
            row.state, row.resolved_at = "resolved", at
            if value is not None:
                row.value = value if row.value is None else max(row.value, value)
            s.add(row)
            assert row.id is not None
            return row.id, row.fired_at

    def delivered(self, alert_id: int, outcome: dict[str, Any]) -> None:
        with self._delivered, self.db.session() as s:  # (one at a time: each adds to what the others wrote)
            row = s.get(AlertFired, alert_id)
            if row is not None:
                row.deliveries = [*row.deliveries, outcome][-20:]
                s.add(row)

    def history(self, limit: int = 200, state: str | None = None) -> Sequence[AlertFired]:
        with self.db.read() as s:
            q = select(AlertFired)
            if state is not None:
                q = q.where(AlertFired.state == state)
            return s.exec(q.order_by(col(AlertFired.id).desc()).limit(limit)).all()

    def firing(self) -> Sequence[AlertFired]:
        with self.db.read() as s:
            return s.exec(select(AlertFired).where(AlertFired.state == "firing")).all()

    def prune(self) -> None:
        with self.db.session() as s:
            s.execute(delete(AlertFired).where(col(AlertFired.fired_at) < time.time() - HISTORY_KEPT_S,
                                               col(AlertFired.state) == "resolved"))
