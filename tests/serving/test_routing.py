"""Routing among replicas, over fake vLLM children through the gateway's data path: under streaming clients whose
prompts share long system prompts, each system prompt reaches one replica (whose prefix cache holds it); switching
the deployment to least_outstanding takes effect without a restart and spreads them again."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from tests.testkit.serving import Scenario


def shared_prefix_prompts(prefixes: int, seed: int = 0) -> tuple[list[str], Callable[[], str]]:
    """Long system prompts, and a source of requests: one of them at random and a fresh question."""
    rng = random.Random(seed)
    systems = ["".join(rng.choice("abcdefghij klmnop") for _ in range(3000)) for _ in range(prefixes)]
    count = itertools.count()
    return systems, lambda: f"{rng.choice(systems)}\nQuestion {next(count)}: why?"


def where_each_went(sc: Scenario, systems: list[str]) -> dict[int, set[str]]:
    """For each system prompt, the replicas that served a request beginning with it."""
    went: dict[int, set[str]] = defaultdict(set)
    for fake in sc.fakes:
        for prompt in fake.served.prompts:
            for i, system in enumerate(systems):
                if prompt.startswith(system):
                    went[i].add(fake.name)
    return went


async def test_requests_sharing_a_system_prompt_reach_the_replica_that_holds_it(tmp_path: Path) -> None:
    async with Scenario(tmp_path, values={"replicas": 2, "max_num_seqs": 16}) as sc:
        await sc.until(sc.serving_revision(1, instances=2))
        systems, prompt = shared_prefix_prompts(12)
        async with sc.clients(4, prompt=prompt) as clients:  # well under each replica's share: no spreading
            await sc.until(lambda: len(clients.results) >= 120)
        assert clients.failed == []
        went = where_each_went(sc, systems)
        assert len(went) == 12 and all(len(names) == 1 for names in went.values()), dict(went)
        homes = {next(iter(names)) for names in went.values()}
        assert homes == {"a", "b"}  # the system prompts are spread over both replicas, each on one
        counts = [u.routed.counts for u in sc.admission.upstreams]
        assert sum(c.prefix for c in counts) > 100  # most were routed by a prefix already sent there

        # least_outstanding, without a restart: the same prompts go wherever fewer requests are in flight
        started = len(sc.event_list("starting"))
        rev = sc.write({"routing": "least_outstanding"})
        await sc.until(sc.serving_revision(rev.id, instances=2))
        assert len(sc.event_list("starting")) == started
        assert sc.event_list("applied_soft")[-1].data["routing"] == "least_outstanding"
        for fake in sc.fakes:
            fake.served.prompts.clear()
        async with sc.clients(4, prompt=prompt) as clients:
            await sc.until(lambda: len(clients.results) >= 120)
        assert clients.failed == []
        assert sum(len(names) == 2 for names in where_each_went(sc, systems).values()) >= 6


async def test_the_gateway_knows_each_instance_s_tokens_per_event_from_its_revision(tmp_path: Path) -> None:
    """vLLM's --stream-interval=4 (4 tokens an event) reaches the gateway's upstream of every instance started with
    it (a stream cut before its usage is metered by it), and a revision without it puts it back to 1."""
    async with Scenario(tmp_path, values={"replicas": 2, "extra_args": ["--stream-interval=4"]}) as sc:
        await sc.until(sc.serving_revision(1, instances=2))
        assert [u.tokens_per_event for u in sc.admission.upstreams] == [4, 4]
        rev = sc.write({"extra_args": []})  # a vLLM flag: each instance is replaced
        await sc.until(sc.serving_revision(rev.id, instances=2))
        assert [u.tokens_per_event for u in sc.admission.upstreams] == [1, 1]
