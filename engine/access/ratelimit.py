"""Per-key rate limits of the /v1 gateway: a sliding window of one minute per token, in memory."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque


class RateLimiter:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._windows: dict[int, deque[float]] = defaultdict(deque)
        self._lock = threading.Lock()  # checks come from threads and the event loop

    def take(self, key: int, limit: int, now: float | None = None) -> int:
        """Count one request of ``key`` if it is under ``limit`` per window: 0; else the seconds to wait (nothing
        counted). Check and count are one step, or a burst slips past the limit."""
        now = time.monotonic() if now is None else now
        with self._lock:
            window = self._windows[key]
            while window and now - window[0] > self.window_s:
                window.popleft()
            if len(window) >= limit:
                return max(1, int(self.window_s - (now - window[0])) + 1)
            window.append(now)
            return 0
