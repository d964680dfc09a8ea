"""Password hashing on a few threads of its own, with a bounded queue.

An argon2 hash takes 64 MiB and, with parallelism 4, four threads for a few hundred milliseconds. Run on the thread
pool that also serves the API, a flood of sign-ins held every one of its threads (and 64 MiB each): /healthz and
/readyz waited behind them, and the engine grew by gigabytes. Here at most ``workers`` hashes run at once, at most
``queue`` more wait, and past that a sign-in is refused at once (``HashBusyError``: 429 with Retry-After). The
threads run at a lower CPU priority than the rest of the engine (argon2's own lane threads inherit it), so the event
loop is scheduled ahead of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

from engine.errors import EngineError

T = TypeVar("T")
log = logging.getLogger("llmops.access")
NICER_BY = 10  # how much lower the hashing threads' CPU priority is than the engine's


class HashBusyError(EngineError):
    """Every hashing thread is busy and the queue is full: try again after ``retry_after_s``."""

    def __init__(self, retry_after_s: int) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"too many sign-ins at once: try again in {retry_after_s} s")


def _lower_priority() -> None:
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + NICER_BY))
    except OSError as exc:  # not Linux-like, or refused: hashing runs at the engine's priority
        log.info("password hashing runs at the engine's CPU priority (%s)", exc)


class HashPool:
    def __init__(self, workers: int = 2, queue: int = 16, per_source: int | None = None) -> None:
        self.workers = workers
        self.queue = queue
        # the most one source may hold of the workers and the queue (None: all): a flood from one address fills its
        # own share, not everyone's
        self.per_source = per_source
        self._by_source: dict[str, int] = {}
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llmops-hash",
                                            initializer=_lower_priority)
        self._lock = threading.Lock()
        self._admitted = 0  # running and waiting
        self._avg_s = 0.5  # a job's time, smoothed (for Retry-After)

    @property
    def admitted(self) -> int:
        """Jobs running or waiting now."""
        return self._admitted

    def retry_after(self) -> int:
        """Seconds until the jobs admitted now are likely done (at least 1)."""
        return max(1, math.ceil(self._admitted * self._avg_s / self.workers))

    def submit(self, fn: Callable[..., T], *args: object, bounded: bool = True, source: str | None = None
               ) -> Future[T]:
        """Run ``fn`` on a hashing thread. ``bounded``: refuse with HashBusyError when the queue is full, or when
        ``source`` holds its share of it already (an anonymous sign-in); else wait in line (an admin setting a
        password: authenticated, never refused)."""
        with self._lock:
            held = self._by_source.get(source, 0) if source is not None else 0
            if bounded and (self._admitted >= self.workers + self.queue
                            or (self.per_source is not None and source is not None and held >= self.per_source)):
                raise HashBusyError(self.retry_after())
            self._admitted += 1
            if source is not None:
                self._by_source[source] = held + 1

        def done() -> None:
            with self._lock:
                self._admitted -= 1
                if source is not None:
                    left = self._by_source.get(source, 1) - 1
                    if left > 0:
                        self._by_source[source] = left
                    else:
                        self._by_source.pop(source, None)

        def job() -> T:
            t0 = time.monotonic()
            try:
                return fn(*args)
            finally:
                with self._lock:
                    self._avg_s = 0.8 * self._avg_s + 0.2 * (time.monotonic() - t0)

        try:
            future = self._executor.submit(job)
        except RuntimeError:  # shut down: the engine is stopping
            done()
            raise
        # released when the job ends, or when it is cancelled before it ran (a sign-in whose caller went away):
        # its place in the queue, and its source's, never stays taken
        future.add_done_callback(lambda _: done())
        return future

    async def run(self, fn: Callable[..., T], *args: object, source: str | None = None) -> T:
        """``fn`` on a hashing thread, awaited (no thread of the shared pool is held meanwhile); ``source``: whose
        share of the queue it takes."""
        return await asyncio.wrap_future(self.submit(fn, *args, source=source))

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn`` on a hashing thread, waited for in line (from a thread that is not a hashing thread)."""
        return self.submit(fn, *args, bounded=False).result()
