"""Limits per key and per team (issue 34, item 1): tokens per minute and budgets per day or month, reserved at
admission and settled with what was used; 429 that names the limit and when it resets; budgets that a restart
reads back from the store; concurrent requests that cannot overshoot."""

from __future__ import annotations

import asyncio
import calendar
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from engine.gateway import KeyLimits, LimitExceededError, Policy, period_bounds
from engine.gateway.limits import WINDOW_S, Bounds, asked_tokens

T = TypeVar("T")
NOON = float(calendar.timegm((2026, 12, 5, 12, 0, 0)))


class Clock:
    def __init__(self, now: float = NOON) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Limits(KeyLimits):
    """The limits with policies and stored usage given by the test (the store's reading is the service tier's)."""

    def __init__(self, policies: dict[int, Policy], stored: dict[tuple[str, int], int] | None = None,
                 clock: Clock | None = None) -> None:
        super().__init__(None, cache_s=60.0, clock=clock or Clock())
        self.policies = policies
        self.stored = stored or {}
        self.reads = 0

    def _read_policy(self, key_id: int) -> Policy:
        return self.policies.get(key_id, Policy(key_id))

    def _read_used(self, scope: str, scope_id: int, since: float) -> int:
        self.reads += 1
        return self.stored.get((scope, scope_id), 0)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def refused(limits: KeyLimits, key: int, tokens: int, prompt: int = 0) -> LimitExceededError:
    with pytest.raises(LimitExceededError) as caught:
        run(limits.claim(key, "c", prompt, tokens, True))
    return caught.value


def test_tokens_per_minute_are_reserved_at_admission_and_settled_with_what_was_used() -> None:
    clock = Clock()
    limits = Limits({1: Policy(1, Bounds(tokens_per_minute=1000))}, clock=clock)
    first = run(limits.claim(1, "c", 100, 600, True))
    # the first one's 600 are reserved: 600 more do not fit in the minute
    error = refused(limits, 1, 600)
    assert error.status == 429 and error.limit == "tokens_per_minute" and error.scope == "key"
    body = json.loads(error.body())["error"]
    assert body["limit"] == "tokens_per_minute" and body["limit_value"] == 1000 and body["used"] == 600
    assert ("retry-after", "60") in [(k.decode(), v.decode()) for k, v in error.headers()]
    # it used 150: the rest of its reservation is free at once
    limits.settle(first, 150)
    run(limits.claim(1, "c", 100, 600, True))
    # the first one's entry leaves the window a minute after it came: the retry-after said when
    clock.now += 30
    error = refused(limits, 1, 400)
    assert error.retry_after_s == 30
    clock.now += 30
    run(limits.claim(1, "c", 100, 400, True))


def test_a_request_larger_than_the_limit_alone_is_told_so() -> None:
    limits = Limits({1: Policy(1, Bounds(tokens_per_minute=500))})
    error = refused(limits, 1, 800)
    assert "more than the key's tokens_per_minute of 500" in str(error) and "fewer max_tokens" in str(error)


def test_a_budget_admits_only_what_fits_and_tells_when_it_resets() -> None:
    clock = Clock()
    limits = Limits({1: Policy(1, Bounds(token_budget=1000, budget_period="day"))}, clock=clock)
    grants = [run(limits.claim(1, "c", 10, 300, True)) for _ in range(3)]
    error = refused(limits, 1, 300)  # 900 reserved: 300 more would pass 1,000
    midnight = period_bounds("day", NOON)[1]
    assert error.limit == "token_budget" and error.resets_at == midnight
    assert error.retry_after_s == int(midnight - NOON)
    assert json.loads(error.body())["error"]["type"] == "insufficient_quota"
    assert "100 left" in str(error) and "2026-12-06 00:00 UTC" in str(error)
    for grant in grants:
        limits.settle(grant, 200)
    last = run(limits.claim(1, "c", 10, 300, True))  # 600 used: 300 more fit
    limits.settle(last, 300)
    refused(limits, 1, 101)
    # the next day the budget starts again
    clock.now = midnight + 1
    assert run(limits.claim(1, "c", 10, 1000, True))


def test_a_month_budget_ends_at_the_first_of_the_next_month() -> None:
    start, ends = period_bounds("month", float(calendar.timegm((2026, 12, 31, 23, 0, 0))))
    assert start == calendar.timegm((2026, 12, 1, 0, 0, 0)) and ends == calendar.timegm((2027, 1, 1, 0, 0, 0))


def test_a_team_s_limits_hold_for_all_its_keys_together_and_a_refusal_reserves_nothing() -> None:
    team = Bounds(token_budget=1000, budget_period="month")
    limits = Limits({1: Policy(1, team_id=7, team="research", team_bounds=team),
                     2: Policy(2, Bounds(tokens_per_minute=10_000), team_id=7, team="research", team_bounds=team)})
    run(limits.claim(1, "c", 0, 700, True))
    error = refused(limits, 2, 400)
    assert error.scope == "team" and "team token_budget of 1,000 per month" in str(error)
    # the refused request took nothing of key 2's own minute
    run(limits.claim(2, "c", 0, 300, True))
    assert limits.team_of(2) == (7, "research")


def test_a_budget_is_read_from_the_store_once_and_counted_in_memory_after() -> None:
    limits = Limits({1: Policy(1, Bounds(token_budget=1000, budget_period="day"))}, stored={("key", 1): 900})
    refused(limits, 1, 200)  # 900 were used before the restart
    grant = run(limits.claim(1, "c", 0, 100, True))
    limits.settle(grant, 100)
    refused(limits, 1, 1)
    assert limits.reads == 1


def test_unmetered_requests_count_no_tokens_but_keep_their_flow() -> None:
    limits = Limits({1: Policy(1, Bounds(token_budget=10, budget_period="day"), weight=3.0)})
    grant = run(limits.claim(1, "c", 500, 5000, False))  # an embedding or /tokenize: requests only
    assert grant.tokens == 0 and grant.flow == "key:1" and grant.weight == 3.0
    assert run(limits.claim(None, "10.0.0.1", 5, 50, True)).flow == "client:10.0.0.1"


def test_sixty_four_concurrent_requests_never_reserve_past_a_budget() -> None:
    async def body() -> tuple[int, int]:
        limits = Limits({1: Policy(1, Bounds(token_budget=10_000, budget_period="day"))})

        async def one() -> int:
            try:
                grant = await limits.claim(1, "c", 40, 296, True)
            except LimitExceededError:
                return 0
            await asyncio.sleep(0.001)
            limits.settle(grant, 296)
            return 296

        used = 0
        refusals = 0
        for _ in range(4):
            spent = await asyncio.gather(*(one() for _ in range(64)))
            used += sum(spent)
            refusals += spent.count(0)
        return used, refusals

    used, refusals = run(body())
    assert used <= 10_000 and used > 10_000 - 296, used  # every token that fits is used, none past the budget
    assert refusals == 256 - used // 296


def test_what_a_request_reserves_counts_every_completion_it_may_make() -> None:
    assert asked_tokens(400, 100, 2, None, 3, 1.0, 1024) == (400, 400 + 600)
    assert asked_tokens(400, None, None, None, 1, 4.0, 1024) == (100, 100 + 1024)
    assert asked_tokens(10, 5, True, "x", 1, 1.0, 1024) == (10, 15)  # (n as sent: checked elsewhere)


def test_the_window_forgets_what_is_older_than_a_minute() -> None:
    clock = Clock()
    limits = Limits({1: Policy(1, Bounds(tokens_per_minute=100))}, clock=clock)
    grant = run(limits.claim(1, "c", 0, 100, True))
    clock.now += WINDOW_S
    limits.settle(grant, 100)  # settled after its entry left the window: nothing comes back to it
    run(limits.claim(1, "c", 0, 100, True))
