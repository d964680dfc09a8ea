"""Time series in the database: raw rows for a short window, per-minute min/avg/max for a long one, pruned as they age.

One wide row per sample and key (a GPU index, a revision, …). Queries bucket the rows so a series never has more
than about 1,000 points, whatever the window. GPU telemetry and vLLM's serving metrics both keep their history
in one of these.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Table, func, insert, literal_column, select

from engine.db import Database, floor_int

MAX_POINTS = 1000


def _bucket(ts: Any, step: float) -> Any:
    """The start of the ``step``-wide bucket of ``ts``. The step is a literal, not a parameter: PostgreSQL groups
    by an expression only when the SELECT and the GROUP BY spell it the same, and two bound parameters are two
    different expressions to it."""
    width: Any = literal_column(repr(float(step)))
    return (floor_int(ts / width) * width).label("bucket")


class SeriesStore:
    """One series over its two tables (engine/db/tables.py): ``raw`` and its per-minute roll-up ``minute``."""

    def __init__(self, db: Database, raw: Table, minute: Table, key: str, metrics: Sequence[str],
                 raw_retention_s: float, minute_retention_s: float) -> None:
        self.db = db
        self.engine = db.engine
        self.key = key
        self.metrics = tuple(metrics)
        self.raw_retention_s = raw_retention_s
        self.minute_retention_s = minute_retention_s
        self.raw = raw
        self.minute = minute
        self._last_rollup = float(math.floor(time.time() / 60) * 60)

    def write(self, ts: float, rows: list[dict[str, Any]]) -> None:
        """Rows of one sample, each ``{key: …, metric: value, …}``; rolls up and prunes at minute boundaries."""
        boundary = float(math.floor(ts / 60) * 60)
        with self.engine.begin() as conn:
            if rows:
                conn.execute(insert(self.raw), [{"ts": ts, **r} for r in rows])
            if boundary > self._last_rollup:
                self._rollup(conn, self._last_rollup, boundary)
                conn.execute(self.raw.delete().where(self.raw.c.ts < ts - self.raw_retention_s))
                conn.execute(self.minute.delete().where(self.minute.c.ts < ts - self.minute_retention_s))
        # only once committed: a write the database refused (a full disk, a server restarting) rolls the minute
        # up again with the next one instead of leaving a hole in the history
        self._last_rollup = max(self._last_rollup, boundary)

    def _rollup(self, conn: Any, start: float, end: float) -> None:
        raw = self.raw
        bucket = _bucket(raw.c.ts, 60)
        cols: list[Any] = [bucket, raw.c[self.key], func.count().label("n")]
        for m in self.metrics:
            cols += [func.min(raw.c[m]).label(f"{m}_min"), func.avg(raw.c[m]).label(f"{m}_avg"),
                     func.max(raw.c[m]).label(f"{m}_max")]
        q = select(*cols).where(raw.c.ts >= start, raw.c.ts < end).group_by(bucket, raw.c[self.key])
        rows = [dict(r._mapping) for r in conn.execute(q)]
        for r in rows:
            r["ts"] = r.pop("bucket")
        if rows:
            conn.execute(insert(self.minute), rows)

    def history(self, window_s: float, step_s: float | None = None, keys: Sequence[int | str] | None = None,
                metrics: list[str] | None = None, now: float | None = None, key_prefix: str | None = None
                ) -> dict[str, Any]:
        """Series per key over the last ``window_s``: per bucket the min, avg and max of each metric (of ``keys``,
        or of the keys that start with ``key_prefix``, if given)."""
        now = time.time() if now is None else now
        metrics = [m for m in (metrics or list(self.metrics)) if m in self.metrics]
        use_raw = window_s <= self.raw_retention_s
        step = max(step_s or 0.0, 1.0 if use_raw else 60.0, math.ceil(window_s / MAX_POINTS))
        if not use_raw:
            step = math.ceil(step / 60) * 60
        table = self.raw if use_raw else self.minute
        key = table.c[self.key]
        bucket = _bucket(table.c.ts, step)
        cols: list[Any] = [bucket, key]
        for m in metrics:
            if use_raw:
                cols += [func.min(table.c[m]), func.avg(table.c[m]), func.max(table.c[m])]
            else:
                cols += [func.min(table.c[f"{m}_min"]),
                         func.sum(table.c[f"{m}_avg"] * table.c.n) / func.sum(table.c.n),
                         func.max(table.c[f"{m}_max"])]
        q = select(*cols).where(table.c.ts >= now - window_s).group_by(bucket, key).order_by(key, bucket)
        if keys:
            q = q.where(key.in_(keys))
        if key_prefix is not None:
            q = q.where(key.startswith(key_prefix, autoescape=True))
        out: dict[str, Any] = {}
        with self.db.read_connection() as conn:
            for row in conn.execute(q):
                series = out.setdefault(str(row[1]), {"t": [], **{m: {"min": [], "avg": [], "max": []}
                                                                  for m in metrics}})
                series["t"].append(float(row[0]))
                for i, m in enumerate(metrics):
                    lo, avg, hi = row[2 + 3 * i: 5 + 3 * i]
                    series[m]["min"].append(lo)
                    series[m]["avg"].append(None if avg is None else round(float(avg), 4))
                    series[m]["max"].append(hi)
        return {"window_s": window_s, "step_s": step, "source": "raw" if use_raw else "minute",
                "metrics": metrics, "series": out}
