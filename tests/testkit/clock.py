"""A clock a test moves by hand (engine/clock.py Clock): what it says is what the test made it say, and what is
due at a time runs when the clock passes it."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


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
