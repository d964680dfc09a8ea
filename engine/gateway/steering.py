"""Which gateway workers take new connections: as few as their load needs (gateway_worker_busy_share).

Every worker used to accept on the shared data port, so the kernel spread connections over all of them. A process
that relays a few streams wakes for each event on its own, where one that relays many handles several a wake-up:
against a stub paced like vLLM (64 streams) four workers cost 1.6x the CPU per token of one (docs/routing.md). So
the engine keeps new connections on the first workers while they have room: each worker says how busy it was (its
share of a core, every BUSY_EVERY_S), and the first ``n`` running workers accept, ``n`` the fewest whose share each
stays under ``share``. ``n`` grows at once and shrinks one worker at a time, after the load has stayed under
SHRINK_AT of what ``n - 1`` could take for HOLD_S (no flapping). Connections a worker has keep going to it (HTTP
keep-alive): a worker clearly busier than one that accepts (by SHED_GAP of a core) therefore *sheds*, answering
``connection: close`` after a share of its responses (enough to move half the gap), so that those clients reconnect
to one with room; it takes no new connection meanwhile. A worker that no longer accepts sheds all of them while it
still relays (a burst spread the clients, the load fell back): they gather again on the first. ``share`` 0: every
worker accepts, as before."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from engine.gateway.wire import Steer

BUSY_EVERY_S = 0.5  # how often a worker says how busy it was
HOLD_S = 5.0  # the load stays this long under what one worker fewer could take before one stops accepting
SHRINK_AT = 0.7  # ... under this share of share, on each of the fewer
SHED_GAP = 0.25  # a worker this much of a core busier than one that accepts lets its connections go
IDLE = 0.02  # a worker busier than this has streams to relay (an idle one takes about 0.003 of a core)


class Steering:
    def __init__(self, share: float, hold_s: float = HOLD_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self.hold_s = hold_s
        self.clock = clock
        self.n = 1  # workers that accept (the first n that run)
        self._under_since: float | None = None

    def decide(self, loads: Sequence[float | None]) -> list[Steer]:
        """``loads``: each worker's share of a core lately (None: it does not run, or has not said yet)."""
        running = [i for i, load in enumerate(loads) if load is not None]
        if self.share <= 0 or not running:
            return [Steer(load is not None, 0.0) for load in loads]
        busy = {i: float(loads[i] or 0.0) for i in running}
        total = sum(busy.values())
        need = min(len(running), max(1, math.ceil(total / self.share)))
        now = self.clock()
        if need >= self.n:
            self.n, self._under_since = need, None
        elif total > SHRINK_AT * self.share * (self.n - 1):  # n - 1 would be too near full: keep n
            self._under_since = None
        elif self._under_since is None:
            self._under_since = now
        elif now - self._under_since >= self.hold_s:
            self.n, self._under_since = self.n - 1, now
        accepting = set(running[:min(self.n, len(running))])
        shed: dict[int, float] = {}
        for i in running:
            if i not in accepting:  # no longer accepts, connections still busy on it: they go to those that do
                if busy[i] > IDLE:
                    shed[i] = 1.0
            elif busy[i] > self.share:
                least = min((busy[j] for j in accepting if j != i), default=busy[i])
                if least < busy[i] - SHED_GAP:  # half the gap moves
                    shed[i] = round(min(1.0, (busy[i] - least) / (2 * busy[i])), 3)
        if accepting - shed.keys():
            accepting -= shed.keys()
        return [Steer(i in accepting, shed.get(i, 0.0)) for i in range(len(loads))]
