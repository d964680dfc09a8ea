"""Query parameters that several routes share: durations of a window and of its buckets."""

from __future__ import annotations

import re

from fastapi import HTTPException

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, field: str) -> float:
    m = re.fullmatch(r"\s*(\d{1,9}(?:\.\d{1,6})?)\s*([smhd]?)\s*", text)
    if not m:
        raise HTTPException(422, detail=[{"loc": ["query", field], "type": "value_error",
                                          "msg": f"{text[:40]!r} is not a duration such as 300, 5m, 1h or 7d"}])
    return float(m.group(1)) * _UNITS[m.group(2) or "s"]


def window_of(text: str, limit_s: float) -> float:
    """The window asked for, in seconds, which must lie within (0, limit_s] (the history kept)."""
    seconds = parse_duration(text, "window")
    if seconds <= 0 or seconds > limit_s:
        raise HTTPException(422, detail=[{"loc": ["query", "window"], "type": "value_error",
                                          "msg": f"window must be within (0, {limit_s:.0f}] s"}])
    return seconds


def step_of(text: str | None, window_s: float) -> float | None:
    """The bucket size asked for, which must lie within (0, window]; None lets the store pick one."""
    if not text:
        return None
    step_s = parse_duration(text, "step")
    if step_s <= 0 or step_s > window_s:
        raise HTTPException(422, detail=[{"loc": ["query", "step"], "type": "value_error",
                                          "msg": f"step must be within (0, {window_s:.0f}] s, the window"}])
    return step_s
