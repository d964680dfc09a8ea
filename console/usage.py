"""The usage page's logic (pages/usage.py renders it): the window a choice means, and the rows as a table."""

from __future__ import annotations

from datetime import date, timedelta

from engine.schemas import BudgetOut, UsageOut

WINDOWS = ("Today", "7 days", "30 days", "This month", "Last month", "Custom")


def window(choice: str, today: date, custom: tuple[date, date] | None = None) -> tuple[date, date]:
    """(first, last) UTC day of a window's choice (both included)."""
    if choice == "Today":
        return today, today
    if choice == "7 days":
        return today - timedelta(days=6), today
    if choice == "This month":
        return today.replace(day=1), today
    if choice == "Last month":
        last = today.replace(day=1) - timedelta(days=1)
        return last.replace(day=1), last
    if choice == "Custom" and custom is not None:
        first, last = sorted(custom)
        return first, last
    return today - timedelta(days=29), today


def table(usage: UsageOut) -> list[dict[str, object]]:
    """One row per group and the total, as the page shows them."""
    priced = any(r.cost is not None for r in usage.rows)
    out: list[dict[str, object]] = []
    for r in [*usage.rows, usage.total]:
        row: dict[str, object] = {usage.group_by: r.group, "requests": r.requests, "failed": r.failed,
                                  "prompt tokens": r.input_tokens, "completion tokens": r.output_tokens,
                                  "tokens": r.input_tokens + r.output_tokens}
        if priced:
            row["cost"] = round(r.cost, 4) if r.cost is not None else None
        out.append(row)
    return out


def budget_text(budget: BudgetOut) -> str:
    """'12,345 of 50,000 tokens this day (24.7 %), 310 reserved'."""
    share = 100 * budget.used / budget.limit if budget.limit else 0.0
    reserved = f", {budget.reserved:,} reserved by requests in flight" if budget.reserved else ""
    return f"{budget.used:,} of {budget.limit:,} tokens this {budget.period} ({share:.1f} %){reserved}"
