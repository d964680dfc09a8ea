"""Usage you can bill: requests and tokens per key, team, deployment or day, from table usage_day (the request
ledger adds to it as it writes), priced by each deployment's price per 1,000 tokens when it has one."""

from __future__ import annotations

import csv
import io
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, or_
from sqlalchemy import select as sa_select
from sqlmodel import col, select

from engine.db import ApiToken, Database, Deployment, Team, UsageDay

GROUPS = ("key", "team", "deployment", "day")
MAX_ROWS = 100_000  # groups one answer holds (keys by days: a year of 270 keys)


@dataclass
class UsageSum:
    group: str
    id: int | None
    requests: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost: float | None = None

    def add(self, requests: int, failed: int, ins: int, outs: int, cost: float | None) -> None:
        self.requests += requests
        self.failed += failed
        self.input_tokens += ins
        self.output_tokens += outs
        if cost is not None:
            self.cost = (self.cost or 0.0) + cost


class Usage:
    def __init__(self, db: Database) -> None:
        self.db = db

    def query(self, group_by: str, since: str, until: str, keys: Collection[int] | None = None,
              teams: Collection[int] | None = None) -> tuple[list[UsageSum], UsageSum]:
        """Sums per group over the days ``since``..``until`` (YYYY-MM-DD, inclusive), largest first by tokens
        (days in order); ``keys``/``teams``: only these keys' usage, and these teams' (None: every one)."""
        column: Any = {"key": col(UsageDay.key_id), "team": col(UsageDay.team_id),
                       "deployment": col(UsageDay.deployment_id), "model": col(UsageDay.model),
                       "day": col(UsageDay.day)}[group_by]
        with self.db.read() as s:
            q = sa_select(column, col(UsageDay.deployment_id), func.sum(UsageDay.requests), func.sum(UsageDay.failed),
                       func.sum(UsageDay.input_tokens), func.sum(UsageDay.output_tokens)).where(
                col(UsageDay.day) >= since, col(UsageDay.day) <= until)
            if keys is not None or teams is not None:
                q = q.where(or_(col(UsageDay.key_id).in_(list(keys or [])),
                                col(UsageDay.team_id).in_(list(teams or []))))
            rows = s.execute(q.group_by(column, col(UsageDay.deployment_id)).limit(MAX_ROWS)).all()
            prices = {d.id: (d.price_input_per_1k, d.price_output_per_1k, d.name)
                      for d in s.exec(select(Deployment)).all()}
            names: dict[int, str] = {}
            if group_by == "key":
                names = {i: n for i, n in s.exec(select(ApiToken.id, ApiToken.name)).all() if i is not None}
            elif group_by == "team":
                names = {i: n for i, n in s.exec(select(Team.id, Team.name)).all() if i is not None}
        sums: dict[object, UsageSum] = {}
        total = UsageSum("total", None)
        for value, deployment, requests, failed, ins, outs in rows:
            price_in, price_out, _ = prices.get(deployment, (None, None, ""))
            cost = None
            if price_in is not None or price_out is not None:
                cost = int(ins or 0) / 1000 * (price_in or 0.0) + int(outs or 0) / 1000 * (price_out or 0.0)
            if value not in sums:
                sums[value] = UsageSum(*_label(group_by, value, names, prices))
            for row in (sums[value], total):
                row.add(int(requests or 0), int(failed or 0), int(ins or 0), int(outs or 0), cost)
        ordered = sorted(sums.values(), key=(lambda r: r.group) if group_by == "day" else
                         (lambda r: -(r.input_tokens + r.output_tokens)))
        return ordered, total


def _label(group_by: str, value: object, names: dict[int, str],
           prices: dict[int | None, tuple[float | None, float | None, str]]) -> tuple[str, int | None]:
    if group_by in ("day", "model"):  # a model: a deployment's served name, or a LoRA adapter's
        return (str(value) or "(none)"), None
    ident = int(value) if isinstance(value, int) else 0
    if ident == 0:
        return ("(no key)" if group_by == "key" else "(no team)" if group_by == "team" else "(none)"), None
    if group_by == "deployment":
        return prices.get(ident, (None, None, f"deleted deployment {ident}"))[2], ident
    return names.get(ident, f"deleted {group_by} {ident}"), ident


def to_csv(rows: list[UsageSum], total: UsageSum, group_by: str) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([group_by, "id", "requests", "failed", "input_tokens", "output_tokens", "cost"])
    for row in [*rows, total]:
        # a name that starts like a formula is not run by a spreadsheet that opens the file
        group = "'" + row.group if row.group[:1] in ("=", "+", "-", "@", "\t", "\r") else row.group
        writer.writerow([group, "" if row.id is None else row.id, row.requests, row.failed, row.input_tokens,
                         row.output_tokens, "" if row.cost is None else f"{row.cost:.6f}"])
    return out.getvalue()
