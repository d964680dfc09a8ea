"""The notifier: every ``interval_s`` it reads the rules, the signals (the event log's new events, the serving
figures of each deployment, the queue's wait, the budgets) and says to the channels what fired and what resolved
(engine/notify/rules.py says when). Deliveries run beside the next looks: a slow webhook holds nothing up. An alert
that was firing when the engine stopped is picked up again at start (its resolve is still sent)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import col, func, select

from engine.aio import cancel_and_wait
from engine.db import AlertChannel, AlertRule, Database, Event
from engine.notify.channels import Alert, send
from engine.notify.rules import KINDS, WINDOW_S, Change, Tracker
from engine.notify.store import AlertStore

log = logging.getLogger("llmops.notify")
SERVING_EVERY_S = 30.0  # how often the serving figures (TTFT, latency, errors) are read from the ledger
MAX_SENDING = 256  # deliveries under way at once; past it, the oldest undelivered wait for the next look
EVENT_KINDS = ("crash_loop", "rollback", "instance_failed", "instance_exited", "start_lost", "diagnosis", "ready",
               "woken", "alert_raised", "alert_cleared")


@dataclass
class Serving:
    """A deployment's serving figures over the last WINDOW_S."""

    requests: int
    ttft_p95_s: float | None
    latency_p95_s: float | None
    error_rate: float | None


@dataclass
class Sources:
    """Where the signals come from (the engine's parts, given by engine/app.py). The sync ones run on a thread."""

    serving: Callable[[float], dict[str, Serving]]  # by deployment name, over a window
    queue_waits: Callable[[], dict[str, float]]  # by deployment name, now (on the loop)
    budgets: Callable[[], list[tuple[str, int, int]]]  # (subject, used, limit) of every budget
    deployment_names: Callable[[], dict[int, str]]


@dataclass
class _Rules:
    rules: list[AlertRule] = field(default_factory=list)
    channels: dict[int, AlertChannel] = field(default_factory=dict)
    changes: int = -1


class Notifier:
    def __init__(self, db: Database, store: AlertStore, sources: Sources, engine_url: str,
                 interval_s: float = 5.0, transport: httpx.AsyncBaseTransport | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.store = store
        self.sources = sources
        self.engine_url = engine_url
        self.interval_s = interval_s
        self.clock = clock
        self.tracker = Tracker()
        self._client = httpx.AsyncClient(transport=transport, follow_redirects=False)
        self._cursor: int | None = None  # the last event read
        self._loaded = _Rules()
        self._task: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.error: str | None = None  # the last look's failure (the console says it)
        self._serving: dict[str, Serving] = {}
        self._serving_at = float("-inf")
        self.looks = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="notifier")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        if self._sending:
            await asyncio.wait(self._sending, timeout=10)
        await self._client.aclose()

    async def _run(self) -> None:
        with contextlib.suppress(SQLAlchemyError):
            await asyncio.to_thread(self._resume)
        while True:
            try:
                await self.look()
                self.error = None
            except SQLAlchemyError as exc:  # the store is down: the next look tries again
                self.error = f"the alerts' store could not be read: {type(exc).__name__}"
                log.warning("alerts: %s", exc)
            except Exception as exc:  # a failure no one planned for ends this look, never the alerts for good
                self.error = f"the last look at the alert rules failed: {type(exc).__name__}"
                log.exception("alerts: a look at the rules failed")
            await asyncio.sleep(self.interval_s)

    def _resume(self) -> None:
        """Alerts firing when the engine stopped: firing again here (so that they resolve), none sent again."""
        for row in self.store.firing():
            self.tracker.resume(row.rule_id, row.subject, row.value, row.message, self.clock())

    # --- one look -------------------------------------------------------------------------------------------

    async def look(self) -> list[Change]:
        now = self.clock()
        loaded = self._loaded
        edits = self.store.changes  # noted before the read: an edit made during it is read again next look
        if loaded.changes != edits or self.looks % 12 == 0:  # (edits by another process: a minute)
            self._loaded = loaded = await asyncio.to_thread(self._read_rules, edits)
            self.tracker.forget({r.id for r in loaded.rules if r.id is not None})
        self.looks += 1
        cursor = self._cursor
        try:
            return await self._look(now, loaded)
        except BaseException:  # nothing of this look happened: its events are read again, its alerts decided again
            self._cursor = cursor
            raise

    def _read_rules(self, edits: int) -> _Rules:
        rules, channels = list(self.store.rules()), self.store.channels()
        return _Rules([r for r in rules if r.enabled], {c.id: c for c in channels if c.id is not None}, edits)

    async def _look(self, now: float, loaded: _Rules) -> list[Change]:
        events, names = await asyncio.to_thread(self._new_events)
        kinds = {r.kind for r in loaded.rules}
        serving: dict[str, Serving] = {}
        if kinds & {"ttft_p95", "latency_p95", "error_rate"}:
            # the ledger's figures are read every SERVING_EVERY_S (a read holds the GIL the data path needs; the
            # rules that use them hold for minutes), the same ones looked at in between
            if now - self._serving_at >= SERVING_EVERY_S:
                self._serving = await asyncio.to_thread(self.sources.serving, WINDOW_S)
                self._serving_at = now
            serving = self._serving
        budgets = await asyncio.to_thread(self.sources.budgets) if "budget" in kinds else []
        waits = self.sources.queue_waits() if "queue_wait" in kinds else {}
        changes: list[Change] = []
        for rule in loaded.rules:
            changes += self._evaluate(rule, now, events, names, serving, budgets, waits)
        by_id = {r.id: r for r in loaded.rules}
        channels = loaded.channels
        if changes and self.store.changes != loaded.changes:
            # edited while this look read its figures (their reads can wait for the database): what it decided goes
            # where the channels and rules say now, not where they said at its start (a channel made meanwhile
            # missed the alert for ever: it was firing already); a rule disabled or deleted meanwhile tells nothing
            # (its state goes at the next look, which takes the rules anew)
            try:
                now_read = await asyncio.to_thread(self._read_rules, self.store.changes)
            except BaseException:
                self._undo(changes, now)
                raise
            channels, by_id = now_read.channels, {r.id: r for r in now_read.rules}
        for n, change in enumerate(changes):
            now_rule = by_id.get(change.rule_id)
            if now_rule is None:
                continue
            try:
                await self._tell(now_rule, change, now, channels)
            except BaseException:
                self._undo(changes[n:], now)
                raise
        return changes

    def _undo(self, changes: list[Change], now: float) -> None:
        """These changes were neither recorded nor sent: as if they had not happened (decided again next look)."""
        for undone in changes:
            if undone.firing:
                self.tracker.states.pop((undone.rule_id, undone.subject), None)
            else:
                self.tracker.resume(undone.rule_id, undone.subject, undone.value, undone.message, now)

    def _new_events(self) -> tuple[list[Event], dict[int, str]]:
        with self.db.read() as s:
            if self._cursor is None:  # the first look: from now on
                self._cursor = int(s.exec(select(func.coalesce(func.max(col(Event.id)), 0))).one() or 0)
                return [], {}
            rows = list(s.exec(select(Event).where(col(Event.id) > self._cursor, col(Event.kind).in_(EVENT_KINDS))
                               .order_by(col(Event.id)).limit(5000)).all())
        if rows:
            self._cursor = rows[-1].id
        return rows, self.sources.deployment_names() if rows else {}

    def _evaluate(self, rule: AlertRule, now: float, events: list[Event], names: dict[int, str],
                  serving: dict[str, Serving], budgets: list[tuple[str, int, int]], waits: dict[str, float]
                  ) -> list[Change]:
        info = KINDS.get(rule.kind)
        rid = rule.id
        if info is None or rid is None:
            return []
        out: list[Change | None] = []
        def mine(deployment: str) -> bool:
            return rule.deployment is None or deployment == rule.deployment

        threshold = rule.threshold if rule.threshold is not None else info.default_threshold
        if info.level and threshold is not None:
            figures: list[tuple[str, float | None, str]] = []  # (subject, value, message) of each seen now
            if rule.kind in ("ttft_p95", "latency_p95", "error_rate"):
                attr = {"ttft_p95": "ttft_p95_s", "latency_p95": "latency_p95_s",
                        "error_rate": "error_rate"}[rule.kind]
                for deployment, serving_now in serving.items():
                    value = getattr(serving_now, attr)
                    if mine(deployment):
                        figures.append((f"deployment {deployment}", value,
                                        f"{info.title}: {value:g} {info.unit} over the last {WINDOW_S / 60:.0f} "
                                        f"min (target {threshold:g})" if value is not None else ""))
            elif rule.kind == "queue_wait":
                figures = [(f"deployment {d}", wait, f"requests waited {wait:.1f} s for a free slot (target "
                            f"{threshold:g} s)") for d, wait in waits.items() if mine(d)]
            elif rule.kind == "budget":
                for subject, used, limit in budgets:
                    share = used / limit if limit else 0.0
                    figures.append((subject, share, f"{subject} has used {used:,} of its {limit:,} tokens "
                                                    f"({100 * share:.0f} %; the rule's {100 * threshold:.0f} %)"))
            for subject, value, message in figures:
                out.append(self.tracker.level(rid, subject, value, threshold, rule.for_s, now, message))
            seen = {subject for subject, _, _ in figures}
            for (other, subject), state in list(self.tracker.states.items()):  # no longer seen (no traffic, a
                if other == rid and state.firing and subject not in seen:   # budget gone): it is gone
                    out.append(self.tracker.level(rid, subject, 0.0, threshold, rule.for_s, now,
                                                  f"{subject} is no longer seen"))
            return [c for c in out if c is not None]
        if info.gpu_alerts:
            for ev in events:
                data = ev.data or {}
                if data.get("alert") not in info.gpu_alerts:
                    continue
                subject = f"GPU {data.get('gpu')}" + (f" on {data['node']}" if data.get("node") else "")
                if ev.kind == "alert_raised":
                    out.append(self.tracker.fire(rid, subject, now, ev.message))
                elif ev.kind == "alert_cleared":
                    out.append(self.tracker.resolve(rid, subject, ev.message))
        elif info.events:
            for ev in events:
                deployment = names.get(ev.deployment_id or 1, f"deployment {ev.deployment_id}")
                if not mine(deployment):
                    continue
                subject = f"deployment {deployment}"
                happened = ev.kind in info.events or (rule.kind == "oom" and ev.kind == "diagnosis"
                                                      and bool((ev.data or {}).get("is_oom")))
                if happened:
                    out.append(self.tracker.fire(rid, subject, now, ev.message))
                elif ev.kind in ("ready", "woken"):  # it serves again
                    out.append(self.tracker.resolve(rid, subject, f"{deployment} serves again: {ev.message}"))
            out.extend(self.tracker.quiet(rid, rule.for_s, now))
        return [c for c in out if c is not None]

    # --- telling ----------------------------------------------------------------------------------------------

    async def _tell(self, rule: AlertRule, change: Change, now: float, channels: dict[int, AlertChannel]) -> None:
        if change.firing:
            alert_id = await asyncio.to_thread(self.store.fired, rule, change.subject, change.value, change.message,
                                               now)
            fired_at, resolved_at = now, None
        else:
            found = await asyncio.to_thread(self.store.resolved, change.rule_id, change.subject, change.value, now)
            if found is None:
                return
            (alert_id, fired_at), resolved_at = found, now
        info = KINDS[rule.kind]
        alert = Alert("firing" if change.firing else "resolved", rule.name, rule.kind, info.title, change.subject,
                      change.message, change.value, rule.threshold, fired_at, resolved_at, self.engine_url, alert_id)
        targets = [c for c in channels.values() if c.enabled and (rule.channels is None or c.id in rule.channels)]
        for channel in targets:
            if len(self._sending) >= MAX_SENDING:
                log.warning("alerts: %d deliveries under way; %s to %s not sent", len(self._sending), alert.status,
                            channel.name)
                continue
            task = asyncio.create_task(self._deliver(channel, alert, alert_id))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _deliver(self, channel: AlertChannel, alert: Alert, alert_id: int) -> None:
        outcome = await send(self._client, channel.kind, channel.url, alert)
        outcome = {"channel": channel.name, "status_sent": alert.status, **outcome}
        if not outcome["ok"]:
            log.warning("alerts: %s of %s to channel %s failed: %s", alert.status, alert.rule, channel.name,
                        outcome.get("detail") or outcome.get("status"))
        with contextlib.suppress(SQLAlchemyError):
            await asyncio.to_thread(self.store.delivered, alert_id, outcome)

    async def test(self, channel: AlertChannel, actor: str) -> dict[str, Any]:
        """A test message to one channel, sent now (once: its answer is the point)."""
        now = self.clock()
        alert = Alert("test", "test", "test", "Test message", "the engine", f"a test sent by {actor}: this channel "
                      "receives the engine's alerts", None, None, now, None, self.engine_url)
        return await send(self._client, channel.kind, channel.url, alert, tries=1)

