"""A clock a test moves by hand (engine/clock.py Clock): what it says is what the test made it say, and what is
due at a time runs when the clock passes it."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections.abc import Callable
from typing import Protocol


class ScriptClock(Protocol):
    """What a fake vLLM needs of a clock: the time, and running something when a time comes."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    def at(self, when: float, fn: Callable[[], None]) -> None: ...


class FakeClock:
    def __init__(self, start: float = 10_000.0, wall: float = 1_790_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall - start
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._now + self._wall_offset

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` when the clock passes ``when`` (at once, when it has)."""
        if when <= self._now:
            fn()
            return
        heapq.heappush(self._due, (when, next(self._order), fn))

    def after(self, seconds: float, fn: Callable[[], None]) -> None:
        self.at(self._now + seconds, fn)

    def advance(self, seconds: float) -> None:
        """Move on by ``seconds``, running what falls due on the way, in order, each at its own time."""
        end = self._now + seconds
        while self._due and self._due[0][0] <= end:
            when, _, fn = heapq.heappop(self._due)
            self._now = max(self._now, when)
            fn()
        self._now = end


class LiveClock:
    """The system's clock with the fake vLLM's ``at``: what is due runs on the event loop that asked, in real time
    (the console's tests run a fake vLLM in the engine's own loop, without a test moving time)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def at(self, when: float, fn: Callable[[], None]) -> None:
        asyncio.get_running_loop().call_later(max(0.0, when - time.monotonic()), fn)
