"""What time it is, as one object the serving core is handed: the system's clock in the engine, a fake one that a
test moves by hand in tests/serving (a start of minutes then runs in milliseconds, and the same way every time)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines, durations)."""
        ...

    def time(self) -> float:
        """Seconds since the epoch (what events and the API show)."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


SYSTEM_CLOCK: Clock = SystemClock()
