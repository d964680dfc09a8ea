"""Limits per key and per team on the /v1 path: requests per minute (a team's; a key's own is checked with the key,
before its body is read), tokens per minute and a token budget per UTC day or month — and the flow each request
belongs to in a deployment's fair queue (its team, else its key, else its client).

A request's tokens are reserved when it is admitted — its prompt, estimated from its body's size (``bytes_per_token``: 1
never reserves too few for the byte-level tokenizers of Llama 3, Qwen, Mistral, GPT-2…), and the completion tokens it
may ask for (``max_tokens``, ``max_completion_tokens`` or ``max_output_tokens``, times ``n`` and its prompts;
``unasked_max_tokens`` when it names none) — and settled with what vLLM says it used when it ends. A request is admitted
only when what is used and reserved, with it, fits every limit: concurrent requests cannot overshoot a budget by more
than what their reservations under-estimated. Refused: ``LimitExceededError`` (HTTP 429, with Retry-After, the limit
named and when it resets).

What was used lives in the store (table usage_day, written with the request ledger): a budget's state is read from
it the first time a key or team is seen in a period, and counted here since, so budgets survive restarts. The
per-minute windows are in memory (a restart forgets the last minute). Everything here runs on the event loop and
never touches the database there: a key's limits and its budget's usage are read once on a thread and kept.
"""

from __future__ import annotations

import asyncio
import calendar
import json
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import func
from sqlmodel import col, select

from engine.access.ratelimit import RateLimiter
from engine.db import UNAVAILABLE, ApiToken, Database, Team, UsageDay, unavailable_message
from engine.errors import EngineError
from engine.gateway.ledger import day_of

WINDOW_S = 60.0
PERIODS = ("day", "month")
MAX_SCOPES = 100_000  # keys and teams whose windows and budgets are kept (the least recently used go first)


def period_bounds(period: str, now: float) -> tuple[float, float]:
    """The UTC day or month holding ``now``: (its start, the next one's start), Unix seconds."""
    t = datetime.fromtimestamp(now, UTC)
    if period == "day":
        start = calendar.timegm((t.year, t.month, t.day, 0, 0, 0))
        return float(start), float(start + 86400)
    start = calendar.timegm((t.year, t.month, 1, 0, 0, 0))
    year, month = (t.year + 1, 1) if t.month == 12 else (t.year, t.month + 1)
    return float(start), float(calendar.timegm((year, month, 1, 0, 0, 0)))


@dataclass(frozen=True)
class Bounds:
    """The limits of a key or a team (None: no such limit)."""

    rate_limit_per_min: int | None = None
    tokens_per_minute: int | None = None
    token_budget: int | None = None
    budget_period: str | None = None  # day | month, with token_budget


@dataclass(frozen=True)
class Policy:
    """One key's limits and its team's, as the store had them."""

    key_id: int
    key: Bounds = Bounds()
    team_id: int | None = None
    team: str | None = None
    team_bounds: Bounds = Bounds()
    weight: float = 1.0  # its flow's share at capacity (its team's weight, else its own)

    @property
    def flow(self) -> str:
        return f"team:{self.team_id}" if self.team_id is not None else f"key:{self.key_id}"


class LimitExceededError(EngineError):
    """A request over a limit of its key or its team: HTTP 429, to try again in ``retry_after_s``."""

    status = 429

    def __init__(self, message: str, *, scope: str, limit: str, value: int, retry_after_s: float,
                 resets_at: float | None = None, used: int | None = None, asked: int | None = None) -> None:
        super().__init__(message)
        self.scope = scope  # key | team
        self.limit = limit  # rate_limit_per_min | tokens_per_minute | token_budget
        self.value = value
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        self.resets_at = resets_at
        self.used = used
        self.asked = asked

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [(b"retry-after", str(self.retry_after_s).encode())]
        if self.limit == "tokens_per_minute":  # as OpenAI names them
            headers.append((b"x-ratelimit-limit-tokens", str(self.value).encode()))
            headers.append((b"x-ratelimit-reset-tokens", f"{self.retry_after_s}s".encode()))
        return headers

    def body(self) -> bytes:
        return json.dumps({"error": {
            "message": str(self), "type": "insufficient_quota" if self.limit == "token_budget" else "rate_limit",
            "code": 429, "param": None, "limit": self.limit, "scope": self.scope, "limit_value": self.value,
            "used": self.used, "asked": self.asked, "retry_after_s": self.retry_after_s,
            "resets_at": self.resets_at}}).encode()


class LimitsUnavailableError(EngineError):
    """A key's limits or its budget's usage could not be read (the database is down): HTTP 503."""


class _Window:
    """Tokens of the last minute, reserved or used: a request's entry is its arrival and its tokens, kept in two
    deques of numbers (no object per request for the collector to walk: 60,000 of them, at 500 requests/s on a key
    and its team, made the engine's full collections stall the path for 90 ms)."""

    __slots__ = ("amounts", "first", "times", "total")

    def __init__(self) -> None:
        self.times: deque[float] = deque()
        self.amounts: deque[int] = deque()
        self.first = 0  # the number of the oldest entry (entries are numbered as they come)
        self.total = 0

    def add(self, now: float, tokens: int) -> int:
        self.times.append(now)
        self.amounts.append(tokens)
        self.total += tokens
        return self.first + len(self.times) - 1

    def settle(self, entry: int, tokens: int) -> None:
        """Entry ``entry`` used ``tokens`` (nothing, once it has left the window)."""
        index = entry - self.first
        if 0 <= index < len(self.amounts):  # (from the right: it is one of the newest)
            self.total += tokens - self.amounts[index]
            self.amounts[index] = tokens

    def expire(self, now: float) -> None:
        while self.times and now - self.times[0] >= WINDOW_S:
            self.times.popleft()
            self.total -= self.amounts.popleft()
            self.first += 1

    def wait(self, need: int, now: float) -> float:
        """Seconds until ``need`` tokens of the window have left it."""
        gone = 0
        for at, tokens in zip(self.times, self.amounts, strict=True):
            gone += tokens
            if gone >= need:
                return at + WINDOW_S - now
        return WINDOW_S


@dataclass(eq=False)
class _Budget:
    """A key's or team's tokens in its current period: used (settled) and reserved (in flight)."""

    period: str
    start: float
    ends: float
    used: int
    reserved: int = 0

    def roll(self, now: float) -> None:
        if now >= self.ends:
            self.start, self.ends = period_bounds(self.period, now)
            self.used = 0


@dataclass(eq=False)
class Grant:
    """What one admitted request holds: the flow it waits in, and the tokens reserved for it until ``settle``."""

    flow: str
    weight: float = 1.0
    policy: Policy | None = None
    tokens: int = 0  # reserved
    prompt: int = 0  # of which its prompt (estimated)
    entries: list[tuple[_Window, int]] = field(default_factory=list)
    budgets: list[tuple[_Budget, float]] = field(default_factory=list)  # and the start of the period it was in
    settled: bool = False


def asked_tokens(body_bytes: int, max_tokens: int | None, n: object, best_of: object, prompts: int,
                 bytes_per_token: float, unasked_max_tokens: int) -> tuple[int, int]:
    """(the prompt's tokens, all tokens) a request may use, as reserved at admission."""
    prompt = math.ceil(body_bytes / bytes_per_token)
    choices = max((v for v in (n, best_of) if isinstance(v, int) and not isinstance(v, bool) and v > 0), default=1)
    completion = (max_tokens if max_tokens is not None else unasked_max_tokens) * choices * max(1, prompts)
    return prompt, prompt + completion


class KeyLimits:
    """Keys' and teams' limits, their windows and budgets; ``claim`` admits a request (or refuses it), ``settle``
    counts what it used."""

    def __init__(self, db: Database | None, cache_s: float = 5.0, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.cache_s = cache_s
        self.clock = clock
        self.changes = 0  # edits through this engine: cached policies are read again at once
        self._policies: dict[int, tuple[float, int, Policy]] = {}
        self._reading: dict[int, asyncio.Future[Policy]] = {}  # the one read of each key's limits under way
        self._windows: OrderedDict[tuple[str, int], _Window] = OrderedDict()
        self._budgets: OrderedDict[tuple[str, int, str], _Budget] = OrderedDict()
        self._loading: dict[tuple[str, int, str], asyncio.Future[_Budget]] = {}  # the one read of each under way
        self._team_rates = RateLimiter()
        self.refused: dict[tuple[str, str], int] = {}  # (scope, limit): requests refused since start

    def changed(self) -> None:
        """A key's or team's limits were edited: read them again before the next request."""
        self.changes += 1

    # --- the store (on a thread) ------------------------------------------------------------------------------

    def _read_policy(self, key_id: int) -> Policy:
        if self.db is None:
            return Policy(key_id)
        with self.db.read() as s:
            row = s.get(ApiToken, key_id)
            if row is None:
                return Policy(key_id)
            key = Bounds(row.rate_limit_per_min, row.tokens_per_minute, row.token_budget, row.budget_period)
            team = s.get(Team, row.team_id) if row.team_id is not None else None
            if team is None:
                return Policy(key_id, key, weight=row.weight)
            return Policy(key_id, key, team.id, team.name, Bounds(team.rate_limit_per_min, team.tokens_per_minute,
                                                                  team.token_budget, team.budget_period),
                          weight=team.weight)

    def _read_used(self, scope: str, scope_id: int, since: float) -> int:
        if self.db is None:
            return 0
        column = col(UsageDay.key_id) if scope == "key" else col(UsageDay.team_id)
        total = func.coalesce(func.sum(col(UsageDay.input_tokens) + col(UsageDay.output_tokens)), 0)
        with self.db.read() as s:
            return int(s.exec(select(total).where(column == scope_id, UsageDay.day >= day_of(since))).one())

    # --- what a key may do ------------------------------------------------------------------------------------

    async def policy(self, key_id: int) -> Policy:
        """A key's limits and its team's, read from the store at most every ``cache_s`` (at once after an edit
        here). One read at a time per key: the requests that find it old meanwhile go on with what was read
        before (the first ones, with nothing read yet, wait for that one read). At 500 requests/s a read by each
        that found the cache old took the API's threads and stalled the path for 50 ms every ``cache_s``."""
        now = time.monotonic()
        cached = self._policies.get(key_id)
        if cached is not None and now - cached[0] < self.cache_s and cached[1] == self.changes:
            return cached[2]
        reading = self._reading.get(key_id)
        if reading is None:
            reading = asyncio.ensure_future(self._refresh(key_id))
            self._reading[key_id] = reading
            reading.add_done_callback(lambda _: self._reading.pop(key_id, None))
        if cached is not None and cached[1] == self.changes:
            return cached[2]  # (read again meanwhile, off this request's path)
        return await asyncio.shield(reading)

    async def _refresh(self, key_id: int) -> Policy:
        now = time.monotonic()
        cached = self._policies.get(key_id)
        changes = self.changes
        try:
            policy = await asyncio.to_thread(self._read_policy, key_id)
        except UNAVAILABLE as exc:
            if cached is not None:  # the database is down: the limits last read hold, and are read again in
                self._policies[key_id] = (now, cached[1], cached[2])  # cache_s (not by every request meanwhile)
                return cached[2]
            raise LimitsUnavailableError(unavailable_message(exc, reading=True)) from exc
        if len(self._policies) >= MAX_SCOPES:
            self._policies.clear()
        self._policies[key_id] = (now, changes, policy)
        # a budget removed or moved to another period: its count here stops, and is read again from the store
        # when it comes back (what was used meanwhile was not counted here)
        for scope, scope_id, bounds in (("key", key_id, policy.key), ("team", policy.team_id, policy.team_bounds)):
            if scope_id is None:
                continue
            for period in PERIODS:
                if bounds.token_budget is None or bounds.budget_period != period:
                    self._budgets.pop((scope, scope_id, period), None)
        return policy

    def team_of(self, key_id: int | None) -> tuple[int | None, str | None]:
        """The team (id, name) of a key as last read (no database: for records and metrics)."""
        cached = self._policies.get(key_id) if key_id is not None else None
        return (None, None) if cached is None else (cached[2].team_id, cached[2].team)

    async def _budget(self, scope: str, scope_id: int, period: str) -> _Budget:
        key = (scope, scope_id, period)
        budget = self._budgets.get(key)
        if budget is not None:
            self._budgets.move_to_end(key)
            budget.roll(self.clock())
            return budget
        loading = self._loading.get(key)
        if loading is None:  # one read for all who ask meanwhile, in a task of its own (a caller that leaves
            # while it runs leaves it running for the others)
            loading = asyncio.ensure_future(self._load_budget(key))
            self._loading[key] = loading
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(loading)

    async def _load_budget(self, key: tuple[str, int, str]) -> _Budget:
        scope, scope_id, period = key
        start, ends = period_bounds(period, self.clock())
        try:
            used = await asyncio.to_thread(self._read_used, scope, scope_id, start)
        except UNAVAILABLE as exc:
            raise LimitsUnavailableError(unavailable_message(exc, reading=True)) from exc
        budget = self._budgets.setdefault(key, _Budget(period, start, ends, used))
        while len(self._budgets) > MAX_SCOPES:
            self._budgets.popitem(last=False)
        return budget

    def _window(self, scope: str, scope_id: int, now: float) -> _Window:
        key = (scope, scope_id)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window()
            while len(self._windows) > MAX_SCOPES:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
        window.expire(now)
        return window

    def _refuse(self, error: LimitExceededError) -> LimitExceededError:
        self.refused[(error.scope, error.limit)] = self.refused.get((error.scope, error.limit), 0) + 1
        return error

    async def claim(self, key_id: int | None, client: str, prompt: int, tokens: int, metered: bool) -> Grant:
        """Admit a request of ``key_id`` (None: keys are not required; its ``client`` is its flow) that may use
        ``tokens`` (``prompt`` of them its prompt's), counted against token limits when ``metered`` (completions
        and chat); LimitExceededError when it is over one, LimitsUnavailableError when they cannot be read."""
        if key_id is None:
            return Grant(f"client:{client[:200]}")
        policy = await self.policy(key_id)
        grant = Grant(policy.flow, policy.weight, policy)
        if not metered:
            tokens = prompt = 0
        scopes = [("key", key_id, policy.key)]
        if policy.team_id is not None:
            scopes.append(("team", policy.team_id, policy.team_bounds))
        budgets: list[tuple[str, _Budget, int]] = []
        for scope, scope_id, bounds in scopes:
            if tokens and bounds.token_budget is not None and bounds.budget_period in PERIODS:
                budgets.append((scope, await self._budget(scope, scope_id, bounds.budget_period), bounds.token_budget))
        now = self.clock()
        # every check before any count: a request refused by one limit takes nothing of the others
        windows: list[_Window] = []
        for scope, scope_id, bounds in scopes:
            if tokens and bounds.tokens_per_minute is not None:
                window = self._window(scope, scope_id, now)
                limit = bounds.tokens_per_minute
                if tokens > limit:
                    raise self._refuse(LimitExceededError(
                        f"this request may use {tokens:,} tokens (its prompt and max_tokens), more than the "
                        f"{scope}'s tokens_per_minute of {limit:,}: ask for fewer max_tokens or a shorter prompt",
                        scope=scope, limit="tokens_per_minute", value=limit, retry_after_s=WINDOW_S, asked=tokens))
                if window.total + tokens > limit:
                    wait = window.wait(window.total + tokens - limit, now)
                    raise self._refuse(LimitExceededError(
                        f"{scope} tokens_per_minute limit of {limit:,}: {window.total:,} used or reserved in the "
                        f"last minute, this request may use {tokens:,}; try again in {math.ceil(wait)} s",
                        scope=scope, limit="tokens_per_minute", value=limit, retry_after_s=wait,
                        resets_at=now + wait, used=window.total, asked=tokens))
                windows.append(window)
        for scope, budget, limit in budgets:
            if budget.used + budget.reserved + tokens > limit:
                left = max(0, limit - budget.used - budget.reserved)
                raise self._refuse(LimitExceededError(
                    f"{scope} token_budget of {limit:,} per {budget.period} (UTC): {budget.used:,} used and "
                    f"{budget.reserved:,} reserved, {left:,} left; this request may use {tokens:,} (its prompt and "
                    f"max_tokens). It resets at {datetime.fromtimestamp(budget.ends, UTC):%Y-%m-%d %H:%M} UTC",
                    scope=scope, limit="token_budget", value=limit, retry_after_s=budget.ends - now,
                    resets_at=budget.ends, used=budget.used + budget.reserved, asked=tokens))
        team_rpm = policy.team_bounds.rate_limit_per_min
        if policy.team_id is not None and team_rpm and (retry := self._team_rates.take(policy.team_id, team_rpm)):
            raise self._refuse(LimitExceededError(
                f"team rate limit of {team_rpm} requests per minute", scope="team", limit="rate_limit_per_min",
                value=team_rpm, retry_after_s=retry))
        grant.tokens, grant.prompt = tokens, prompt
        if tokens:
            for window in windows:
                grant.entries.append((window, window.add(now, tokens)))
            for _, budget, _ in budgets:
                budget.reserved += tokens
                grant.budgets.append((budget, budget.start))
        return grant

    def settle(self, grant: Grant | None, used: int | None) -> None:
        """The request of ``grant`` ended having used ``used`` tokens (None: unknown, its reservation counts);
        a second call does nothing."""
        if grant is None or grant.settled:
            return
        grant.settled = True
        spent = grant.tokens if used is None else max(0, used)
        for window, entry in grant.entries:
            window.settle(entry, spent)
        now = self.clock()
        for budget, start in grant.budgets:
            budget.reserved -= grant.tokens
            budget.roll(now)
            if budget.start == start:  # (one that began in the period before counts there, as the store has it)
                budget.used += spent

    def budget_now(self, scope: str, scope_id: int, period: str) -> tuple[int, int, float]:
        """(used, reserved, when the period ends) of a key's or team's budget: as counted here when the gateway
        has seen it this period, else as the store has it. Called from the API's threads: it changes nothing."""
        now = self.clock()
        start, ends = period_bounds(period, now)
        budget = self._budgets.get((scope, scope_id, period))
        if budget is not None and budget.start == start:
            return budget.used, max(0, budget.reserved), ends
        reserved = max(0, budget.reserved) if budget is not None else 0
        return self._read_used(scope, scope_id, start), reserved, ends
