"""Routing by prefix and load (engine/gateway/routing.py) through the gateway's admission: prompts that begin alike
go where that beginning was sent (its prefix cache holds it) while that instance has its share, a hot prefix
spreads, a new prompt goes to its home, and adding an instance moves as few prefixes as possible."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from engine.gateway import Admission
from engine.gateway.admission import Upstream
from engine.gateway.routing import BLOCK_BYTES, LOAD_FACTOR, LOAD_SLACK, PrefixIndex, blocks_of, keys_in, prefix_keys


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def system_prompt(i: int, size: int = 4000) -> str:
    """A long system prompt of its own (random text: no two share a block)."""
    rng = random.Random(i)
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(size))


def keys_of(prompt: str) -> list[int]:
    return prefix_keys(prompt.encode())


async def gate_of(n: int, policy: str = "prefix") -> Admission:
    gate = Admission(queue_size=8, queue_timeout_s=5)
    gate.routing = policy  # type: ignore[assignment]
    for i in range(n):
        await gate.open(f"http://r{i}", 1, instance=f"r{i}")
    return gate


async def take(gate: Admission, prompt: str) -> Upstream:
    return await gate.acquire(time.monotonic() + 5, keys_of(prompt))


def test_keys_are_chained_so_prompts_that_begin_alike_share_their_first_keys() -> None:
    base = system_prompt(1)
    a, b = keys_of(base + " question one"), keys_of(base + " a different question")
    shared = keys_in(len(base) // BLOCK_BYTES)
    assert a[:shared] == b[:shared] and len(a) >= shared
    assert keys_of(system_prompt(2))[0] != a[0]
    # the same block at another depth is another key (a prompt that repeats itself is not its own prefix)
    twice = keys_of("x" * BLOCK_BYTES * 2)
    assert twice[0] != twice[1]
    assert keys_of("short") == []  # shorter than a block: routed by load alone


def test_a_long_prompt_has_few_keys_and_its_shared_prefix_is_found_to_within_a_quarter() -> None:
    system = system_prompt(3, 60 * BLOCK_BYTES)  # a system prompt of 60 blocks (about 2,000 tokens)…
    a, b = keys_of(system + system_prompt(4, 3 * BLOCK_BYTES)), keys_of(system + system_prompt(5, 3 * BLOCK_BYTES))
    assert len(a) == len(b) <= 20  # …and a question: 63 blocks, a key per block only for the first eight
    shared = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    assert 0.75 * 60 <= blocks_of(shared) <= 60
    index = PrefixIndex(capacity=1000)
    index.add(a)
    assert index.size == blocks_of(len(a)) == 56 and index.longest(b) == shared
    huge = keys_of(system_prompt(6, 400_000))  # past MAX_BLOCKS: its first 256 KiB
    assert len(huge) == len(set(huge)) <= 40 and blocks_of(len(huge)) == 2048


def test_prompts_sharing_a_prefix_reach_the_same_instance_while_it_has_room() -> None:
    async def go() -> None:
        gate = await gate_of(2)
        prefixes = [system_prompt(i) for i in range(8)]
        seen: dict[int, set[str]] = {i: set() for i in range(8)}
        held = []
        for n in range(64):  # light load: each request ends before the next (the bound never bites)
            i = n % 8
            up = await take(gate, prefixes[i] + f" question {n}")
            seen[i].add(up.instance)
            held.append(up)
            await gate.release(up)
        assert all(len(where) == 1 for where in seen.values()), seen
        # and the prefixes are spread over both instances by their homes, not all on one
        assert {next(iter(w)) for w in seen.values()} == {"r0", "r1"}

    run(go())


def test_a_hot_prefix_spreads_when_its_instance_has_its_share() -> None:
    async def go() -> None:
        gate = await gate_of(2)
        hot = system_prompt(7)
        held = [await take(gate, hot + f" q{n}") for n in range(20)]  # all in flight at once
        where = Counter(u.instance for u in held)
        assert set(where) == {"r0", "r1"}, where
        # no instance over its bounded share (LOAD_FACTOR x the average, rounded up, and LOAD_SLACK) when chosen
        assert max(where.values()) <= int(LOAD_FACTOR * 20 / 2) + 1 + LOAD_SLACK, where
        for up in held:
            await gate.release(up)
        # once it spread, the prefix is found on both: the next requests go to whichever has fewer in flight
        first = await take(gate, hot + " later")
        second = await take(gate, hot + " later too")
        assert first.instance != second.instance

    run(go())


def test_least_outstanding_ignores_the_prompt() -> None:
    async def go() -> None:
        gate = await gate_of(2, "least_outstanding")
        p = system_prompt(3)
        a, b = await take(gate, p + " one"), await take(gate, p + " two")
        assert {a.instance, b.instance} == {"r0", "r1"}  # the second goes to the idle one, prefix or not
        assert gate.upstreams[0].routed.counts.load + gate.upstreams[1].routed.counts.load == 2

    run(go())


def test_an_instance_with_a_full_kv_cache_is_passed_over_while_another_can_take_the_prefix() -> None:
    async def go() -> None:
        gate = await gate_of(2)
        p = system_prompt(4)
        home = await take(gate, p + " one")
        await gate.release(home)
        home.kv_usage = 0.99  # vLLM's own metric: its KV cache is full
        other = await take(gate, p + " two")
        assert other.instance != home.instance
        await gate.release(other)
        home.kv_usage = 0.4
        assert (await take(gate, p + " three")).instance in {home.instance, other.instance}

    run(go())


def test_adding_an_instance_moves_only_the_prefixes_whose_home_it_becomes() -> None:
    async def go() -> None:
        three = await gate_of(3)
        four = await gate_of(4)
        prompts = [system_prompt(1000 + i, 600) for i in range(400)]
        moved = 0
        for p in prompts:  # each alone: its home decides (no index, no load)
            a = await take(three, p)
            await three.release(a)
            b = await take(four, p)
            await four.release(b)
            if a.instance != b.instance:
                assert b.instance == "r3", (a.instance, b.instance)  # moved only to the new one
                moved += 1
        assert 0.15 * 400 < moved < 0.35 * 400  # about a quarter: its share

    run(go())


def test_an_index_holds_what_the_kv_cache_holds_and_forgets_the_least_recently_used() -> None:
    index = PrefixIndex(capacity=10)
    a, b = keys_of(system_prompt(1, 6 * BLOCK_BYTES)), keys_of(system_prompt(2, 6 * BLOCK_BYTES))
    index.add(a)
    assert index.longest(a) == 6
    index.add(b)  # 12 keys in 10 places: a's tail goes first (as vLLM evicts), its beginning stays
    assert index.longest(b) == 6 and index.longest(a) == 4
    assert index.longest(a[:0]) == 0
    index.add(b)
    index.add(keys_of(system_prompt(3, 8 * BLOCK_BYTES)))  # a prompt of 8 blocks: only 2 of b's and none of a's stay
    assert index.longest(a) == 0 and index.longest(b) == 2
