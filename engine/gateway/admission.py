"""Admission: who may send to vLLM now. The open upstreams (one per instance that serves), a bounded waiting room
while none is open (an apply, a crash) or every one is at its limit of requests, and the requests in flight. A
request goes to the open upstream that routing picks (engine/gateway/routing.py: by prefix and load, or the fewest
requests outstanding); the serving controller opens, relabels, closes and drains upstreams (engine/serving/gate.py),
and waits for their requests to end before it stops an instance.

The waiting room is a fair queue: each request belongs to a flow (its team, else its key, else its client:
engine/gateway/limits.py) with a weight, and a free slot goes to the waiting request with the smallest virtual start
(start-time fair queueing): a flow that sends ten times as many requests as another waits behind its own requests,
not in front of the other's. With one flow it is first come, first served.

Fair order alone still makes a light flow wait for a slot to free when a heavy one holds them all. So while more
than one flow has sent in the last ACTIVE_S, a flow that holds its share of the slots (by weight, among those
flows) or more leaves free what the others below their share held at their busiest in that time (at least one
each, each up to its share, all together at most RESERVE_MAX of the slots, at least one): a light flow's request
finds a slot free and goes at once. The heavy flow loses at most that, and only while another flow is about; alone
it has every slot."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.errors import QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway.routing import PrefixIndex, Routed, RoutingPolicy, instance_salt, pick

CAPACITY_QUEUE = 65_536  # requests that wait for a free slot (every instance at its max_num_seqs), as vLLM's queue
FLOWS_KEPT = 4096  # flows whose virtual finish is remembered (one behind the system's virtual time needs none)
ACTIVE_S = 30.0  # a flow that sent within this long is about: the others leave it room
RESERVE_MAX = 1 / 4  # of the slots (at least one), the most a flow at its share leaves free for the others about
RECHECK_S = 1.0  # a slot left free for the others: looked at again this often (they may have gone quiet)

Flow = tuple[str, float]  # (name, weight) of the flow a request waits in


@dataclass(eq=False)
class _Ticket:
    """A request waiting for a slot: served in order of ``tag`` (its virtual start), then arrival."""

    tag: float
    seq: int
    flow: str
    weight: float
    keys: Sequence[int] | None
    future: asyncio.Future[Upstream]
    began: float
    for_slot: bool  # waits for a free slot (load), not for an instance to come
    dead: bool = False  # gave up (timed out, cancelled): skipped


@dataclass(eq=False)
class Upstream:
    """One vLLM instance the gateway may send to."""

    url: str
    revision: int | None
    instance: str = "a"
    outstanding: int = 0
    finished: int = 0  # requests it has ended (answered, failed or given up), since it opened
    auth: tuple[bytes, bytes] | None = None  # the instance's own API key, as the header the gateway adds
    admission: Admission | None = None  # whose upstream it is (set when opened)
    down_until: float = 0.0  # monotonic: it refused a connection; the others take new requests until then
    limit: int | None = None  # most requests in flight to it (its max_num_seqs under a higher ceiling); None: vLLM's
    kv_usage: float | None = None  # its KV cache's use, 0-1, by vLLM's own metrics (the serving monitor's scrape)
    cache_hit_pct: float | None = None  # vLLM's prefix-cache hit rate between the monitor's last two scrapes, %
    tokens_per_event: int = 1  # tokens one event of its streams carries at most (its --stream-interval)
    routed: Routed = field(default_factory=Routed, repr=False)  # what routing knows of it (its index, counts)
    salt: int = field(init=False, repr=False)  # its weight's seed in rendezvous hashing (from the instance's name)

    def __post_init__(self) -> None:
        self.salt = instance_salt(self.instance)

    def route_tally(self) -> tuple[int, int]:
        """Its requests routed by prefix, and all its requests routed, since it opened (the monitor's history)."""
        counts = self.routed.counts
        return counts.prefix, counts.total


class Admission:
    """Who may send to vLLM now: the open upstreams, a bounded waiting room, and the requests in flight."""

    def __init__(self, queue_size: int, queue_timeout_s: float, deployment_id: int | None = None,
                 deployment: str | None = None) -> None:
        self.deployment_id = deployment_id  # whose admission this is (the request ledger records it)
        self.deployment = deployment  # and its name (a gateway key may be limited to some deployments)
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self._open: list[Upstream] = []
        self._cond = asyncio.Condition()
        self._watchers = 0  # drains and waiters that want to hear of every change
        self._notes: set[asyncio.Task[None]] = set()  # release_nowait's notices on their way
        self.in_flight = 0
        self._queues: dict[str, deque[_Ticket]] = {}  # each flow's waiting requests, in order (some gave up)
        self._vtime = 0.0  # the fair queue's virtual time: the tag of the last request it let through
        self._finish: dict[str, float] = {}  # each flow's virtual finish (its last queued request's tag + 1/weight)
        self._held: dict[str, int] = {}  # slots each flow holds now
        self._peaks: dict[str, list[float]] = {}  # each flow's most slots held: [since, this ACTIVE_S, the one before]
        # each flow's last request (monotonic) and its weight, oldest first; with the weights of those about
        self._seen: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._about_weight = 0.0
        self._recheck: asyncio.TimerHandle | None = None  # a dispatch when a flow stops being about
        self.admitted = 0  # requests ever let through (autoscaling's activity: one between two looks counts)
        self.waiting = 0
        self._wait_starts: dict[int, float] = {}  # requests waiting for a slot now: when each began (oldest first)
        self._waits: deque[tuple[float, float]] = deque(maxlen=1024)  # (when it ended, how long) of recent waits
        self._wait_ids = itertools.count()
        self.rejected = 0
        self.refusal: str | None = None  # set while vLLM is down on purpose: refuse at once, do not queue
        self.routing: RoutingPolicy = "prefix"  # the deployment's (its revision's ``routing``, set by the gate)
        # told when a request begins to wait with nothing open (serving wakes a deployment scaled to zero)
        self.on_wait: Callable[[], None] | None = None

    @property
    def upstreams(self) -> list[Upstream]:
        return list(self._open)

    @property
    def upstream(self) -> str | None:
        return self._open[0].url if self._open else None

    @property
    def upstream_headers(self) -> dict[str, str]:
        """The key of ``upstream``, as a header (the engine's own requests to it send it too)."""
        auth = self._open[0].auth if self._open else None
        return {auth[0].decode(): auth[1].decode()} if auth else {}

    @property
    def revision(self) -> int | None:
        return self._open[0].revision if self._open else None

    @property
    def by_prefix(self) -> bool:
        """Whether a request's prompt chooses where it goes (the policy ``prefix`` and more than one open)."""
        return self.routing == "prefix" and len(self._open) > 1

    def _room(self) -> bool:
        """Whether an open upstream can take one more request now (its limit, if it has one, not reached)."""
        return any(u.limit is None or u.outstanding < u.limit for u in self._open)

    def _take(self, keys: Sequence[int] | None, flow: str = "") -> Upstream:
        if len(self._open) > 1:
            now = time.monotonic()  # one that just failed to connect is passed over while others answer
            free = [u for u in self._open if u.limit is None or u.outstanding < u.limit]
            best = pick(self.routing, [u for u in free if u.down_until <= now] or free, self.in_flight,
                        len(self._open), keys)
        else:
            best = self._open[0]
        best.outstanding += 1
        self.in_flight += 1
        self.admitted += 1
        held = self._held[flow] = self._held.get(flow, 0) + 1
        now = time.monotonic()
        peak = self._peaks.get(flow)
        if peak is None or now - peak[0] >= 2 * ACTIVE_S:
            self._peaks[flow] = [now, held, 0]
        else:
            if now - peak[0] >= ACTIVE_S:  # a new window: this one becomes the one before
                peak[:] = [now, 0, peak[1]]
            peak[1] = max(peak[1], held)
        if len(self._peaks) > 2 * FLOWS_KEPT:  # (rare: those older than two windows count for nothing)
            self._peaks = {f: p for f, p in self._peaks.items() if now - p[0] < 2 * ACTIVE_S}
        return best

    async def acquire(self, deadline: float, keys: Sequence[int] | None = None, flow: Flow | None = None,
                      claim: object = None) -> Upstream:
        """The upstream routing picks for a prompt of prefix ``keys`` (routing.prefix_keys; None: by load alone),
        counted in flight; waits (until ``deadline``, monotonic) while none is open, or every one has its limit of
        requests, in ``flow``'s place of the fair queue (None: one flow for all). ``claim``: a worker's (its
        engine's admission reads it; here it is unused)."""
        name, weight = flow if flow is not None else ("", 1.0)
        weight = max(weight, 1e-3)
        now = time.monotonic()
        self._arrive(name, weight, now)
        if self._open and not self.waiting and self._may(name, now):  # nearly every request: no lock, no await
            return self._take(keys, name)
        if not self._open and self.refusal is not None:
            self.rejected += 1
            raise UpstreamUnavailableError(self.refusal)
        # nothing serves: the waiting room is bounded (queue_size); all at their limit is load, queued as vLLM
        # would queue it, within a bound of its own
        bound = self.queue_size if not self._open else CAPACITY_QUEUE
        if self.waiting >= bound:
            self.rejected += 1
            raise QueueFullError(f"{self.waiting} requests already wait for vLLM (queue_size)"
                                 if not self._open else f"{self.waiting} requests wait for a free slot")
        # its virtual start: after its flow's last waiting request, else where its flow's last one let through
        # ended (a request that gave up moves nothing: a burst that timed out does not push its flow back)
        queue = self._queues.get(name)
        last = next((t for t in reversed(queue) if not t.dead), None) if queue else None
        tag = last.tag + 1.0 / weight if last is not None else max(self._vtime, self._finish.get(name, 0.0))
        # a wait for a free slot is load (autoscaling's queue wait); one for an instance to come is not
        ticket = _Ticket(tag, next(self._wait_ids), name, weight, keys, asyncio.get_running_loop().create_future(),
                         time.monotonic(), bool(self._open))
        self._queues.setdefault(name, deque()).append(ticket)
        self.waiting += 1
        if ticket.for_slot:
            self._wait_starts[ticket.seq] = ticket.began
        if not self._open and self.on_wait is not None:
            self.on_wait()
        self._dispatch()  # (room may have come between the look above and now: never wait beside a free slot)
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                return await asyncio.shield(ticket.future)
        except BaseException as exc:
            if not ticket.future.done():  # still waiting: it leaves the queue
                self._leave(ticket)
                ticket.future.cancel()
            elif not ticket.future.cancelled() and ticket.future.exception() is None:
                upstream = ticket.future.result()
                if isinstance(exc, TimeoutError):  # granted as its time ran out: it goes
                    return upstream
                self.release_nowait(upstream, name)  # granted as it was cancelled: the slot goes back
                raise
            if isinstance(exc, TimeoutError):
                self.rejected += 1
                raise QueueTimeoutError("vLLM did not become ready within queue_timeout_s") from None
            raise

    def _leave(self, ticket: _Ticket) -> None:
        """``ticket`` stops waiting (let through, or gave up)."""
        if ticket.dead:
            return
        ticket.dead = True
        self.waiting -= 1
        if ticket.for_slot:
            self._wait_starts.pop(ticket.seq, None)
            ended = time.monotonic()
            self._waits.append((ended, ended - ticket.began))
        queue = self._queues.get(ticket.flow)
        if queue is not None:
            while queue and queue[0].dead:
                queue.popleft()
            if not queue:
                del self._queues[ticket.flow]
            elif len(queue) > 1024 and sum(1 for t in queue if t.dead) > len(queue) // 2:  # many gave up
                self._queues[ticket.flow] = deque(t for t in queue if not t.dead)

    def _free(self) -> int | None:
        """Slots free on the open upstreams (None: one of them has no limit)."""
        free = 0
        for u in self._open:
            if u.limit is None:
                return None
            free += max(0, u.limit - u.outstanding)
        return free

    def _peak(self, flow: str, now: float) -> float:
        """The most slots ``flow`` held at once in the last ACTIVE_S or so."""
        peak = self._peaks.get(flow)
        if peak is None or now - peak[0] >= 2 * ACTIVE_S:
            return 0.0
        return max(peak[1], peak[2]) if now - peak[0] < ACTIVE_S else peak[1]

    def _may(self, flow: str, now: float) -> bool:
        """Whether ``flow`` may take a slot now: one is free, and it leaves the others about their room (above)."""
        if not self._room():
            return False
        free = self._free()
        if free is None:
            return True
        self._forget_quiet(now)
        mine = self._seen.get(flow)
        own = mine[1] if mine is not None else 1.0
        total = self._about_weight + (0.0 if mine is not None else own)
        if total <= own + 1e-9:  # no other flow about
            return True
        slots = free + sum(u.outstanding for u in self._open)
        if self._held.get(flow, 0) < slots * own / total:
            return True  # below its share: any free slot
        cap = max(1, int(slots * RESERVE_MAX))
        if free - 1 >= cap:
            return True
        reserve = 0.0
        for other, (_, weight) in reversed(self._seen.items()):  # (the most recent first; enough once at the cap)
            if other == flow:
                continue
            share, held = slots * weight / total, self._held.get(other, 0)
            if held < share:
                reserve += min(share, max(self._peak(other, now), held + 1)) - held
                if reserve >= cap:
                    break
        return free - 1 >= min(reserve, cap)

    def _arrive(self, flow: str, weight: float, now: float) -> None:
        """``flow`` sent a request now: it is about (the most recent), with ``weight``."""
        before = self._seen.pop(flow, None)
        if before is not None:
            self._about_weight -= before[1]
        self._seen[flow] = (now, weight)
        self._about_weight += weight
        self._forget_quiet(now)
        while len(self._seen) > FLOWS_KEPT:  # the least recent go first
            _, (_, gone) = self._seen.popitem(last=False)
            self._about_weight -= gone

    def _forget_quiet(self, now: float) -> None:
        """Flows quiet for ACTIVE_S are no longer about (oldest first: stops at the first one that is)."""
        while self._seen:
            flow, (at, weight) = next(iter(self._seen.items()))
            if now - at < ACTIVE_S:
                break
            del self._seen[flow]
            self._about_weight -= weight
        if not self._seen:
            self._about_weight = 0.0  # (no drift of the running sum)

    def _dispatch(self) -> None:
        """Let waiting requests through while an open upstream has room, in fair order; refuse them all when
        nothing is open and vLLM is down on purpose."""
        if not self._open:
            if self.refusal is None:
                return
            for queue in list(self._queues.values()):
                for ticket in list(queue):
                    if not ticket.dead:
                        self._leave(ticket)
                        self.rejected += 1
                        ticket.future.set_exception(UpstreamUnavailableError(self.refusal))
            self._queues.clear()
            return
        now = time.monotonic()
        held_back = False
        while self._room():
            best: _Ticket | None = None
            for queue in self._queues.values():
                head = queue[0]
                if (best is None or (head.tag, head.seq) < (best.tag, best.seq)) and self._may(head.flow, now):
                    best = head
            if best is None:
                held_back = bool(self._queues)
                break
            self._leave(best)
            self._vtime = max(self._vtime, best.tag)
            if len(self._finish) >= FLOWS_KEPT:  # flows at or behind the virtual time start there anyway
                self._finish = {f: t for f, t in self._finish.items() if t > self._vtime}
            self._finish[best.flow] = max(self._finish.get(best.flow, 0.0), best.tag + 1.0 / best.weight)
            best.future.set_result(self._take(best.keys, best.flow))
        if held_back and self._recheck is None:  # a slot left free for flows about: look again in a moment
            self._recheck = asyncio.get_running_loop().call_later(RECHECK_S, self._look_again)

    def _look_again(self) -> None:
        self._recheck = None
        self._dispatch()

    def queue_wait(self, now: float, window_s: float = 5.0) -> float:
        """The longest a request waited in the queue for a free slot (every instance at its limit) among those
        that ended their wait in the last ``window_s``, or the age of the oldest one still waiting (``now``:
        monotonic). A wait for an instance to come (a start, a wake) is not counted: that is not load."""
        oldest = now - next(iter(self._wait_starts.values()), now)
        recent = max((waited for ended, waited in self._waits if ended >= now - window_s), default=0.0)
        return max(oldest, recent, 0.0)

    def _ended(self, upstream: Upstream, flow: str | None) -> None:
        upstream.outstanding -= 1
        upstream.finished += 1
        self.in_flight -= 1
        name = flow or ""
        held = self._held.get(name, 0) - 1
        if held > 0:
            self._held[name] = held
        else:
            self._held.pop(name, None)
        self._dispatch()

    async def release(self, upstream: Upstream, used: int | None = None, flow: str | None = None) -> None:
        """``upstream``'s request of ``flow`` (as it was acquired) ended (``used``: its tokens, which a worker's
        admission tells its engine)."""
        self._ended(upstream, flow)
        if self._watchers:
            await self._notify()

    def release_nowait(self, upstream: Upstream, flow: str | None = None, used: int | None = None) -> None:
        """``release`` from code that cannot or need not wait (a worker's message, a request's end): those who wait
        hear of it in a moment."""
        self._ended(upstream, flow)
        if self._watchers:
            task = asyncio.ensure_future(self._notify())
            self._notes.add(task)
            task.add_done_callback(self._notes.discard)

    async def _notify(self) -> None:
        async with self._cond:
            self._cond.notify_all()

    def mark_down(self, upstream: Upstream, seconds: float) -> None:
        """``upstream`` refused a connection: it takes no new request for ``seconds`` while another can."""
        upstream.down_until = time.monotonic() + seconds

    async def open(self, url: str, revision: int | None = None, instance: str = "a", api_key: str | None = None,
                   limit: int | None = None, cache_tokens: int | None = None, tokens_per_event: int = 1) -> Upstream:
        """Send to ``url`` (instance ``instance``, replacing an upstream of the same instance), with the instance's
        own API key when it has one; ``cache_tokens``: its KV cache's size, when known (routing's index);
        ``tokens_per_event``: its vLLM's --stream-interval (a stream cut before its usage is metered by it)."""
        async with self._cond:
            old = next((u for u in self._open if u.instance == instance), None)
            same = old is not None and old.url == url  # the same vLLM: its requests and its cache go on
            routed = old.routed if same and old else Routed(PrefixIndex.for_tokens(cache_tokens))
            up = Upstream(url, revision, instance, old.outstanding if same and old else 0,
                          auth=(b"authorization", b"Bearer " + api_key.encode()) if api_key else None, admission=self,
                          limit=limit, routed=routed, tokens_per_event=tokens_per_event)
            self._open = [u for u in self._open if u.instance != instance] + [up]
            self.refusal = None
            self._dispatch()
            self._cond.notify_all()
            return up

    async def relabel(self, instance: str, revision: int | None, limit: int | None) -> None:
        """The instance serves ``revision`` now, held to ``limit`` requests at once (a change of max_num_seqs within
        its ceiling, or a scale, adopted it): in effect for the next request, those in flight counted as before."""
        async with self._cond:
            for upstream in self._open:
                if upstream.instance == instance:
                    upstream.revision, upstream.limit = revision, limit
            self._dispatch()  # a higher limit lets waiting requests in
            self._cond.notify_all()

    async def close(self, instance: str | None = None) -> list[Upstream]:
        """Stop admitting to ``instance`` (None: every upstream); new requests go to the others, or wait (bounded)
        for the next open. Returns the upstreams closed, whose requests may still be in flight."""
        async with self._cond:
            closed = [u for u in self._open if instance is None or u.instance == instance]
            self._open = [u for u in self._open if u not in closed]
            self._dispatch()  # (nothing open and vLLM down on purpose: those waiting are refused at once)
            self._cond.notify_all()
            return closed

    async def refuse(self, refusal: str | None) -> None:
        """While closed, refuse new requests at once with ``refusal`` instead of queueing them (None: queue)."""
        async with self._cond:
            self.refusal = refusal
            if refusal is not None:
                self._dispatch()
                self._cond.notify_all()

    async def finished(self, upstream: Upstream, n: int, timeout: float) -> bool:
        """Wait until ``upstream`` has ended ``n`` requests, it closes, or ``timeout``; whether it ended them."""
        async with self._cond:
            self._watchers += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._cond.wait_for(
                        lambda: upstream.finished >= n or upstream not in self._open), timeout)
            finally:
                self._watchers -= 1
            return upstream.finished >= n

    async def drain(self, timeout: float, upstreams: list[Upstream] | None = None) -> int:
        """Wait until no request is in flight (on ``upstreams``, if given), or ``timeout``; return how many still
        are."""
        def left() -> int:
            return self.in_flight if upstreams is None else sum(u.outstanding for u in upstreams)

        async with self._cond:
            self._watchers += 1
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._cond.wait_for(lambda: left() == 0), timeout)
            finally:
                self._watchers -= 1
            return left()
