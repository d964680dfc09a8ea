"""The request ledger: one row per /v1 request through the gateway, and the KPIs operators track from it.

Each row: when, the revision that served it, model, endpoint, input and output tokens, time to first token, total
latency (queueing in the gateway included), status and client. No prompt text unless ``sample_rate`` > 0.
Rows are buffered and written once a second, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import delete, func, insert
from sqlalchemy import select as sa_select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import defer
from sqlmodel import col, select

from engine.aio import cancel_and_wait
from engine.db import (
    DEFAULT_DEPLOYMENT,
    READ_FLUSH_WAIT_S,
    UNAVAILABLE,
    Database,
    Event,
    RequestLog,
    UsageDay,
    json_true,
)
from engine.metrics import RequestMetrics

log = logging.getLogger("llmops.ledger")


def day_of(ts: float) -> str:
    """The UTC day of ``ts`` as usage_day names it (YYYY-MM-DD)."""
    return time.strftime("%Y-%m-%d", time.gmtime(ts))
MAX_BUFFER = 100_000  # records kept in memory while the database cannot be written


@dataclass
class Record:
    ts: float
    revision_id: int | None
    model: str
    endpoint: str
    stream: bool
    status: int
    latency_s: float
    client: str
    input_tokens: int | None = None
    output_tokens: int | None = None
    ttft_s: float | None = None
    error: str | None = None
    prompt: str | None = None
    instance: str | None = None
    deployment_id: int | None = None
    max_tokens: int | None = None  # what the request asked for (max_tokens or max_completion_tokens), if it did
    key_id: int | None = None  # the gateway key that sent it
    team_id: int | None = None  # its team (the engine's ledger fills it in)


class RecordSink(Protocol):
    """Where the gateway's records go: the ledger, or a gateway worker's link to the engine's ledger."""

    def record(self, rec: Record) -> None: ...

    def sample_prompt(self) -> bool: ...


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


class Ledger:
    def __init__(self, db: Database, sample_rate: float = 0.0, flush_interval_s: float = 1.0,
                 retention_s: float = 30 * 86400, metrics: RequestMetrics | None = None,
                 team_of: Callable[[int | None], tuple[int | None, str | None]] | None = None) -> None:
        self.db = db
        self.metrics = metrics
        self.team_of = team_of  # a key's team as its limits last read it (engine.gateway.Limits.team_of)
        self.sample_rate = sample_rate
        self.flush_interval_s = flush_interval_s
        self.retention_s = retention_s
        self._buffer: list[Record] = []
        self._lock = threading.Lock()
        self._pruned = 0.0
        self._task: asyncio.Task[None] | None = None
        self._longest: dict[tuple[float, float], tuple[float, int | None]] = {}
        self._need: dict[float, tuple[float, tuple[int, int, float] | None]] = {}

    def sample_prompt(self) -> bool:
        return self.sample_rate > 0 and random.random() < self.sample_rate

    def record(self, rec: Record) -> None:
        team = "anonymous" if rec.key_id is None else "none"
        if rec.key_id is not None and self.team_of is not None:
            team_id, name = self.team_of(rec.key_id)
            if rec.team_id is None:  # (a worker's record: its engine knows the key's team)
                rec.team_id = team_id
            team = name or team
        with self._lock:
            self._buffer.append(rec)
        if self.metrics is not None:
            self.metrics.observe(rec.revision_id, rec.status, rec.error, rec.latency_s, rec.ttft_s,
                                 rec.input_tokens, rec.output_tokens)
            self.metrics.observe_team(team, rec.status, rec.error, rec.input_tokens, rec.output_tokens)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="ledger")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        await asyncio.to_thread(self.flush)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            if self._buffer:
                try:
                    await asyncio.to_thread(self.flush)
                except SQLAlchemyError:  # a locked or full database: keep the records (bounded), retry later
                    log.exception("request ledger: could not write; keeping the records for the next try")

    def flush(self, wait_s: float | None = None) -> int:
        """Write buffered records (and, once an hour, drop rows older than the retention). ``wait_s``: the longest
        wait for the database's lock (Database.session); the records are kept for the next flush if it fails."""
        with self._lock:
            batch, self._buffer = self._buffer, []
        prune = time.time() - self._pruned > 3600
        if not batch and not prune:
            return 0
        try:
            with self.db.session(wait_s) as s:
                if batch:  # one executemany of plain rows: ORM objects cost 0.2 ms a row of the GIL the loop needs
                    s.execute(insert(RequestLog), [dict(vars(r)) for r in batch])  # (asdict: deep, slow)
                _add_usage(s, batch)
                if prune:
                    s.exec(delete(RequestLog).where(col(RequestLog.ts) < time.time() - self.retention_s))
        except SQLAlchemyError:
            with self._lock:  # put the batch back in front, keeping at most MAX_BUFFER records
                self._buffer = (batch + self._buffer)[-MAX_BUFFER:]
            raise
        if prune:
            self._pruned = time.time()
        return len(batch)

    def flush_for_read(self) -> None:
        """Before a read of the ledger (the KPIs): what was recorded until now, written if the database's lock can
        be had within READ_FLUSH_WAIT_S; else the read serves what is committed, and the records are written at the
        next flush. A page is not held up behind a write (an apply's, a burst's) for a second of requests."""
        try:
            self.flush(READ_FLUSH_WAIT_S)
        except UNAVAILABLE as exc:
            log.info("request ledger: not written before a read (%s); the read serves what is committed", exc)

    # --- reading ----------------------------------------------------------------------------------------------

    def rows(self, since: float, revision: int | None = None, client: str | None = None,
             deployment_id: int | None = None) -> Sequence[RequestLog]:
        """The window's rows for the KPIs (of one deployment's requests, when given; rows from before deployments
        existed are the default one's): sampled prompt texts are not read."""
        with self.db.read() as s:
            prompt: Any = RequestLog.prompt  # the mapped attribute (SQLModel types it as its value)
            q = select(RequestLog).options(defer(prompt)).where(RequestLog.ts >= since)
            if deployment_id is not None:
                mine = col(RequestLog.deployment_id) == deployment_id
                q = q.where(mine | col(RequestLog.deployment_id).is_(None) if deployment_id == DEFAULT_DEPLOYMENT
                            else mine)
            if revision is not None:
                q = q.where(RequestLog.revision_id == revision)
            if client is not None:
                q = q.where(RequestLog.client == client)
            return s.exec(q.order_by(col(RequestLog.id))).all()

    def count(self, since: float, client: str) -> int:
        with self.db.read() as s:
            return int(s.exec(select(func.count()).select_from(RequestLog).where(
                RequestLog.ts >= since, RequestLog.client == client)).one())

    def kpis(self, window_s: float, revision: int | None = None, now: float | None = None,
             client: str | None = None, deployment_id: int | None = None) -> list[dict[str, Any]]:
        """Per revision over the window: requests, average input and output tokens, P50/P95/P99 latency, P95 time
        to first token, output tokens/s, error rate, OOM failures and their rate per hour."""
        now = time.time() if now is None else now
        since = now - window_s
        by_rev: dict[int | None, list[RequestLog]] = defaultdict(list)
        for row in self.rows(since, revision, client, deployment_id):
            by_rev[row.revision_id].append(row)
        ooms = self._oom_counts(since, revision) if client is None else {}
        out = []
        for rev in sorted(set(by_rev) | set(ooms), key=lambda r: -1 if r is None else r):
            rows = by_rev.get(rev, [])
            ok = [r for r in rows if r.status < 400 and r.error is None]
            lat = [r.latency_s for r in ok]
            ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
            ins = [r.input_tokens for r in ok if r.input_tokens is not None]
            outs = [r.output_tokens for r in ok if r.output_tokens is not None]
            span = (max(r.ts + r.latency_s for r in rows) - min(r.ts for r in rows)) if rows else 0.0
            out.append({
                "revision": rev, "window_s": window_s, "requests": len(rows), "succeeded": len(ok),
                "avg_input_tokens": round(sum(ins) / len(ins), 2) if ins else None,
                "avg_output_tokens": round(sum(outs) / len(outs), 2) if outs else None,
                "latency_p50_s": _r(percentile(lat, 0.5)), "latency_p95_s": _r(percentile(lat, 0.95)),
                "latency_p99_s": _r(percentile(lat, 0.99)), "ttft_p95_s": _r(percentile(ttft, 0.95)),
                "output_tokens_per_s": round(sum(outs) / span, 2) if span > 0 and outs else None,
                "error_rate": round((len(rows) - len(ok)) / len(rows), 4) if rows else None,
                "oom_failures": ooms.get(rev, 0),
                "oom_per_hour": round(ooms.get(rev, 0) / (window_s / 3600), 3),
            })
        return out

    def by_deployment(self, window_s: float, max_rows: int = 5_000) -> dict[int, tuple[int, float | None,
                                                                                      float | None, float | None]]:
        """Each deployment's (requests, TTFT P95, latency P95 of the successful ones, error rate) over the window
        (what alert rules watch), from about ``max_rows`` of its requests at most: one in n across the window,
        chosen by the database (a busy window's 300,000 rows, built in Python, would hold the GIL the data path
        needs for a tenth of a second)."""
        since = time.time() - window_s
        columns: Any = (RequestLog.deployment_id, RequestLog.status, RequestLog.error, RequestLog.latency_s,
                        RequestLog.ttft_s)
        in_window = col(RequestLog.ts) >= since
        with self.db.read() as s:
            total = int(s.exec(select(func.count()).select_from(RequestLog).where(in_window)).one())
            every = max(1, -(-total // max_rows))
            q = sa_select(*columns).where(in_window)
            if every > 1:  # one in ``every``, by a hash of the id (every n-th id aliases with periodic traffic)
                q = q.where((col(RequestLog.id) * 1103515245 + 12345) // 65536 % every == 0)
            rows = s.execute(q.limit(max_rows)).all()
        grouped: dict[int, list[tuple[int, str | None, float, float | None]]] = defaultdict(list)
        for deployment, status, error, latency, ttft in rows:
            grouped[deployment or DEFAULT_DEPLOYMENT].append((status, error, latency, ttft))
        out: dict[int, tuple[int, float | None, float | None, float | None]] = {}
        for deployment, items in grouped.items():
            ok = [i for i in items if i[0] < 400 and i[1] is None]
            out[deployment] = (len(items), percentile([i[3] for i in ok if i[3] is not None], 0.95),
                               percentile([i[2] for i in ok], 0.95), (len(items) - len(ok)) / len(items))
        return out

    def _oom_counts(self, since: float, revision: int | None) -> dict[int | None, int]:
        with self.db.read() as s:
            q = select(Event.revision_id, func.count()).where(
                Event.kind == "diagnosis", Event.ts >= since,
                json_true(col(Event.data), "is_oom")).group_by(col(Event.revision_id))
            if revision is not None:
                q = q.where(Event.revision_id == revision)
            return {r: int(n) for r, n in s.exec(q).all()}

    def longest_request(self, window_s: float, q: float = 0.99, cache_s: float = 30.0) -> int | None:
        """The p99 of input + output tokens of recent successful requests (what traffic actually needs), as the
        nearest rank, computed by SQLite and kept for ``cache_s``: pre-flight asks on every capacity check, and
        reading a day of busy traffic row by row took 80-160 ms on the H200."""
        now = time.monotonic()
        key = (window_s, q)
        with self._lock:
            cached = self._longest.get(key)
            if cached is not None and now - cached[0] < cache_s:
                return cached[1]
        total = col(RequestLog.input_tokens) + func.coalesce(col(RequestLog.output_tokens), 0)
        with self.db.read() as s:
            ok = (RequestLog.ts >= time.time() - window_s, RequestLog.status < 400,
                  col(RequestLog.input_tokens).is_not(None))
            n = int(s.exec(select(func.count()).select_from(RequestLog).where(*ok)).one())
            value = None if n < 20 else s.exec(select(total).where(*ok).order_by(total)
                                               .offset(int((n - 1) * q)).limit(1)).first()
        result = None if value is None else int(value)
        with self._lock:
            self._longest[key] = (now, result)
        return result

    def longest_need(self, window_s: float, cache_s: float = 60.0) -> tuple[int, int, float] | None:
        """What the longest successful request of the window asked of max_model_len: (prompt tokens + the
        max_tokens it asked for, or its output tokens where it asked for none; the number of requests; seconds
        back to the oldest). The longest, not a percentile: any request above a max_model_len gets HTTP 400.
        One SQLite aggregate, kept for ``cache_s``."""
        now = time.monotonic()
        with self._lock:
            cached = self._need.get(window_s)
            if cached is not None and now - cached[0] < cache_s:
                return cached[1]
        need = col(RequestLog.input_tokens) + func.coalesce(col(RequestLog.max_tokens), col(RequestLog.output_tokens),
                                                            0)
        wall = time.time()
        with self.db.read() as s:
            row = s.exec(select(func.count(), func.max(need), func.min(col(RequestLog.ts))).where(
                RequestLog.ts >= wall - window_s, RequestLog.status < 400,
                col(RequestLog.input_tokens).is_not(None))).one()
        n, longest, oldest = row
        result = None if not n or longest is None or oldest is None else (int(longest), int(n), wall - float(oldest))
        with self._lock:
            self._need[window_s] = (now, result)
        return result


MODEL_CHARS = 256  # of a request's model name in usage_day (a name longer than any served one is cut)


def _add_usage(s: Any, batch: Sequence[Record]) -> None:
    """Add a batch of records to usage_day, in the ledger's own transaction (a row per day, key, team, deployment
    and model — a deployment's name or one of its LoRA adapters: read, then added to or made; the ledger is its only
    writer)."""
    sums: dict[tuple[str, int, int, int, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for r in batch:
        row = sums[(day_of(r.ts), r.key_id or 0, r.team_id or 0, r.deployment_id or 0, r.model[:MODEL_CHARS])]
        row[0] += 1
        row[1] += 1 if r.status >= 400 or r.error is not None else 0
        row[2] += r.input_tokens or 0
        row[3] += r.output_tokens or 0
    for (day, key, team, deployment, model), (requests, failed, ins, outs) in sums.items():
        usage = s.exec(select(UsageDay).where(UsageDay.day == day, UsageDay.key_id == key, UsageDay.team_id == team,
                                              UsageDay.deployment_id == deployment, UsageDay.model == model)).first()
        if usage is None:
            usage = UsageDay(day=day, key_id=key, team_id=team, deployment_id=deployment, model=model)
        usage.requests += requests
        usage.failed += failed
        usage.input_tokens += ins
        usage.output_tokens += outs
        s.add(usage)


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
