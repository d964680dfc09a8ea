"""Polling with a deadline: the one way a test waits (never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(check: Callable[[], T | None], timeout: float, *, every: float = 0.2, what: str = "",
               explain: Callable[[], str] | None = None) -> T:
    """Call ``check`` until it returns something truthy, and return that; fail after ``timeout`` seconds saying
    ``what`` was awaited, the last value seen and what ``explain`` says then (the state behind it, for a failure
    seen once in CI to say why)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or getattr(check, '__name__', 'condition')} did not hold within "
                                 f"{timeout:.0f} s (last: {value!r})" + (f"; {explain()}" if explain else ""))
        time.sleep(every)


async def eventually(check: Callable[[], object], timeout: float, *, every: float = 0.01, what: str = "") -> None:
    """The asyncio form: await until ``check()`` is truthy (other tasks run meanwhile), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or getattr(check, '__name__', 'condition')} did not hold within "
                                 f"{timeout:.1f} s")
        await asyncio.sleep(every)
