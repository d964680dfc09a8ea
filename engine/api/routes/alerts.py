"""Alerts that reach someone: channels (admins manage them; operators see them and send a test), rules (operators
manage them) and what fired (everyone signed in sees it)."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query
from fastapi import Path as PathParam

from engine.api.deps import NoteDep, PrincipalDep, ServicesDep, access
from engine.api.services import Services
from engine.db import AlertChannel, AlertFired, AlertRule
from engine.notify import KINDS, AlertStore, AlertStoreError, ChannelError, shown_url
from engine.schemas import (
    MAX_ID,
    ChannelIn,
    ChannelOut,
    ChannelPatch,
    DeliveryOut,
    FiredOut,
    RuleIn,
    RuleOut,
    RulePatch,
    TestOut,
)

router = APIRouter(tags=["alerts"])
# one Path() per name, in Annotated (one object as the default of two names reads the first name for both)
ChannelId = Annotated[int, PathParam(ge=1, le=MAX_ID)]
RuleId = Annotated[int, PathParam(ge=1, le=MAX_ID)]


def channel_out(c: AlertChannel) -> ChannelOut:
    return ChannelOut(id=c.id or 0, name=c.name, kind=c.kind, url=shown_url(c.url),
                      enabled=c.enabled, created_at=c.created_at, created_by=c.created_by)


def rule_out(r: AlertRule, firing: int = 0) -> RuleOut:
    info = KINDS[r.kind]
    return RuleOut(id=r.id or 0, name=r.name, kind=r.kind, title=info.title, level=info.level,
                   unit=info.unit, threshold=r.threshold, for_s=r.for_s, deployment=r.deployment,
                   channels=r.channels, enabled=r.enabled, firing=firing)


def fired_out(f: AlertFired) -> FiredOut:
    deliveries = []
    for d in f.deliveries or []:
        if isinstance(d, dict):
            deliveries.append(DeliveryOut(channel=str(d.get("channel", "")), status_sent=str(d.get("status_sent", "")),
                                          ok=bool(d.get("ok")), status=d.get("status"), detail=d.get("detail"),
                                          tries=int(d.get("tries") or 1), at=float(d.get("at") or 0.0)))
    return FiredOut(id=f.id or 0, rule=f.rule, kind=f.kind, subject=f.subject, state=f.state,
                    fired_at=f.fired_at, resolved_at=f.resolved_at, value=f.value, message=f.message,
                    deliveries=deliveries)


def _store(svc: Services) -> AlertStore:
    if svc.alert_store is None:
        raise HTTPException(503, detail="alerts are not set up in this engine")
    return svc.alert_store


def _refused(exc: AlertStoreError | ChannelError) -> HTTPException:
    if isinstance(exc, AlertStoreError) and exc.missing:
        return HTTPException(404, detail=str(exc))
    field = exc.field if isinstance(exc, AlertStoreError) and exc.field else str(exc).split(":", 1)[0]
    return HTTPException(422, detail=[{"loc": ["body", field], "msg": str(exc), "type": "value_error"}])


@router.get("/api/alerts/channels", response_model=list[ChannelOut], dependencies=access("operator"))
def channels(svc: ServicesDep) -> list[ChannelOut]:
    return [channel_out(c) for c in _store(svc).channels()]


@router.post("/api/alerts/channels", status_code=201, response_model=ChannelOut,
             dependencies=access("admin", "alerts.channels.create"))
def create_channel(body: ChannelIn, svc: ServicesDep, principal: PrincipalDep, note: NoteDep) -> ChannelOut:
    """A webhook the alerts are sent to (its URL is never shown again whole)."""
    try:
        row = _store(svc).create_channel(body.name, body.kind, body.url, body.enabled, principal.name)
    except (AlertStoreError, ChannelError) as exc:
        raise _refused(exc) from None
    note.target, note.after = f"channel {row.name}", {"kind": row.kind, "url": shown_url(row.url),
                                                      "enabled": row.enabled}
    return channel_out(row)


@router.patch("/api/alerts/channels/{channel_id}", response_model=ChannelOut,
              dependencies=access("admin", "alerts.channels.update"))
def update_channel(body: ChannelPatch, svc: ServicesDep, note: NoteDep, channel_id: ChannelId) -> ChannelOut:
    changes = {f: getattr(body, f) for f in body.model_fields_set if getattr(body, f) is not None}
    try:
        before, row = _store(svc).update_channel(channel_id, changes)
    except (AlertStoreError, ChannelError) as exc:
        raise _refused(exc) from None
    note.target = f"channel {row.name}"
    note.before = {k: shown_url(v) if k == "url" else v for k, v in before.items()}
    note.after = {k: shown_url(v) if k == "url" else v for k, v in changes.items()}
    return channel_out(row)


@router.delete("/api/alerts/channels/{channel_id}", response_model=ChannelOut,
               dependencies=access("admin", "alerts.channels.delete"))
def delete_channel(svc: ServicesDep, note: NoteDep, channel_id: ChannelId) -> ChannelOut:
    try:
        row = _store(svc).delete_channel(channel_id)
    except AlertStoreError as exc:
        raise _refused(exc) from None
    note.target, note.after = f"channel {row.name}", {"deleted": True}
    return channel_out(row)


@router.post("/api/alerts/channels/{channel_id}/test", response_model=TestOut,
             dependencies=access("operator", "alerts.channels.test"))
async def test_channel(svc: ServicesDep, principal: PrincipalDep, note: NoteDep, channel_id: ChannelId) -> TestOut:
    """Send a test message to the channel now, and say what it answered."""
    store = _store(svc)
    try:
        channel = await asyncio.to_thread(store.channel, channel_id)
    except AlertStoreError as exc:
        raise _refused(exc) from None
    if svc.notifier is None:
        raise HTTPException(503, detail="alerts are not set up in this engine")
    outcome = await svc.notifier.test(channel, principal.name)
    note.target, note.after = f"channel {channel.name}", {"ok": outcome["ok"], "status": outcome.get("status")}
    return TestOut(ok=bool(outcome["ok"]), status=outcome.get("status"), detail=outcome.get("detail"))


@router.get("/api/alerts/rules", response_model=list[RuleOut], dependencies=access("viewer"))
def rules(svc: ServicesDep) -> list[RuleOut]:
    store = _store(svc)
    firing: dict[int, int] = {}
    for f in store.firing():
        firing[f.rule_id] = firing.get(f.rule_id, 0) + 1
    return [rule_out(r, firing.get(r.id or 0, 0)) for r in store.rules()]


@router.post("/api/alerts/rules", status_code=201, response_model=RuleOut,
             dependencies=access("operator", "alerts.rules.create"))
def create_rule(body: RuleIn, svc: ServicesDep, principal: PrincipalDep, note: NoteDep) -> RuleOut:
    """A condition watched: GPU health, serving figures, events, budgets (the kinds: engine/notify/rules.py)."""
    try:
        row = _store(svc).create_rule(body.model_dump(), principal.name)
    except AlertStoreError as exc:
        raise _refused(exc) from None
    note.target, note.after = f"rule {row.name}", body.model_dump(exclude={"name"})
    return rule_out(row)


@router.patch("/api/alerts/rules/{rule_id}", response_model=RuleOut,
              dependencies=access("operator", "alerts.rules.update"))
def update_rule(body: RulePatch, svc: ServicesDep, note: NoteDep, rule_id: RuleId) -> RuleOut:
    """Only the fields sent change (deployment or channels null: every one)."""
    changes = {f: getattr(body, f) for f in body.model_fields_set}
    for field in ("for_s", "enabled"):
        if field in changes and changes[field] is None:
            raise HTTPException(422, detail=[{"loc": ["body", field], "type": "value_error",
                                              "msg": f"{field} cannot be null"}])
    try:
        before, row = _store(svc).update_rule(rule_id, changes)
    except AlertStoreError as exc:
        raise _refused(exc) from None
    note.target, note.before, note.after = f"rule {row.name}", before, changes
    return rule_out(row)


@router.delete("/api/alerts/rules/{rule_id}", response_model=RuleOut,
               dependencies=access("operator", "alerts.rules.delete"))
def delete_rule(svc: ServicesDep, note: NoteDep, rule_id: RuleId) -> RuleOut:
    try:
        row = _store(svc).delete_rule(rule_id)
    except AlertStoreError as exc:
        raise _refused(exc) from None
    note.target, note.after = f"rule {row.name}", {"deleted": True}
    return rule_out(row)


@router.get("/api/alerts/fired", response_model=list[FiredOut], dependencies=access("viewer"))
def fired(svc: ServicesDep, state: Literal["firing", "resolved"] | None = None,
          limit: int = Query(200, ge=1, le=5000)) -> list[FiredOut]:
    """What fired and when (newest first), and what each channel answered."""
    return [fired_out(f) for f in _store(svc).history(limit, state)]
