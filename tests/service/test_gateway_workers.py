"""The data path across cores (issue 32, item 3): gateway worker processes on the data port, the engine keeping
what they share. Real worker processes (``python -m engine.gateway.worker``) against a stub upstream, with the
engine's coordinator and admission in the test's loop: one cap for all workers, one rate limit per key, every
request in the ledger, a worker killed mid-stream replaced while the other's streams finish, and nothing left
behind when the pool stops."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from engine.access import GatewayKeys, Principal, RateLimiter
from engine.gateway import Admission, Coordinator, KeyLimits, Policy, WorkerPool, WorkerSpec
from engine.gateway.limits import Bounds
from engine.gateway.steering import Steering
from engine.gateway.wire import Steer
from tests.testkit.ledger import Records
from tests.testkit.served import read_until_closed
from tests.testkit.stub_upstream import stub_upstream
from tests.testkit.wait import eventually

pytestmark = pytest.mark.one_database  # the engine's store plays no part: keys and the ledger are stand-ins


class Keys:
    """Stands in for Auth: 'good' (any deployment), 'limited' (3 requests a minute), 'only-b' (deployment b)."""

    changes = 0

    def authenticate(self, token: str) -> Principal | None:
        if token == "boom":
            raise RuntimeError("the store failed in a way no one planned for")
        return {"good": Principal("k", "prompter", "gateway", 1),
                "limited": Principal("l", "prompter", "gateway", 2, rate_limit_per_min=3),
                "only-b": Principal("b", "prompter", "gateway", 3, deployments=("b",))}.get(token)


def spec(keys_required: bool = False, max_bytes: int = 1 << 20) -> WorkerSpec:
    return WorkerSpec(index=0, engine_port=8000, hosts=[], head_bytes=16384, line_bytes=4096, head_timeout_s=5.0,
                      body_max_bytes=max_bytes, body_timeout_s=5.0, json_max_depth=64, body_budget_bytes=8 << 20,
                      body_share_bytes=None, body_first_byte_s=5.0, max_n=16, max_prompts=64, max_asked_tokens=4096,
                      upstream_timeout_s=30.0, ledger_sample_rate=0.0, keys_required=keys_required, graceful_s=5.0)


@asynccontextmanager
async def pool_of(url: str, count: int = 2, limit: int | None = None, keys_required: bool = False,
                  events: list[tuple[str, dict[str, object]]] | None = None, limits: KeyLimits | None = None,
                  tokens_per_event: int = 1, busy_share: float = 0.0
                  ) -> AsyncIterator[tuple[WorkerPool, Admission, Records, str]]:
    """``count`` workers on a free data port, before one deployment ("a", model "m") whose one instance is ``url``
    (held to ``limit`` requests at once; its vLLM's --stream-interval ``tokens_per_event``)."""
    admission = Admission(16, 10.0, deployment_id=1, deployment="a")
    await admission.open(url, revision=1, instance="a", limit=limit, tokens_per_event=tokens_per_event)
    records = Records()

    def route(model: str | None) -> Admission | None:
        return admission if model in ("m", None) else None

    def models() -> list[dict[str, Any]]:
        return [{"id": "m", "object": "model", "deployment": "a"}, {"id": "mb", "object": "model", "deployment": "b"}]

    keys = GatewayKeys(Keys(), RateLimiter(), keys_required)  # type: ignore[arg-type]
    coordinator = Coordinator(route, keys, records, models, limits)
    pool = WorkerPool(count, "127.0.0.1", 0, spec(keys_required), coordinator,
                      emit=lambda kind, _m, _s, data: events.append((kind, data)) if events is not None else None,
                      stop_timeout_s=10, busy_share=busy_share)
    await pool.start()
    base = f"http://127.0.0.1:{pool.port}"
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            async def up() -> bool:
                try:
                    return (await client.get(f"{base}/v1/models")).status_code in (200, 401)
                except httpx.TransportError:
                    return False
            deadline = time.monotonic() + 30
            while not await up():
                assert time.monotonic() < deadline, "the gateway workers did not answer within 30 s"
                await asyncio.sleep(0.1)
        await eventually(lambda: all(w.pid for w in pool.workers), 30, what="every worker started")
        yield pool, admission, records, base
    finally:
        await pool.stop()


async def stream(base: str, tokens: int, headers: dict[str, str] | None = None, model: str = "m"
                 ) -> tuple[int, bytes]:
    """One streamed completion on a connection of its own (so the kernel may hand it to any worker)."""
    async with httpx.AsyncClient(timeout=30) as client, client.stream(
            "POST", f"{base}/v1/completions", headers=headers,
            json={"model": model, "prompt": "hello", "max_tokens": tokens, "stream": True}) as resp:
        return resp.status_code, b"".join([chunk async for chunk in resp.aiter_bytes()])


def raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        return read_until_closed(sock, 10)


def run(coro: Callable[[], Any]) -> None:
    asyncio.run(asyncio.wait_for(coro(), 120))


def test_every_worker_holds_to_the_one_cap_of_an_instance_and_every_request_is_answered_and_recorded() -> None:
    async def body() -> None:
        with stub_upstream(token_s=0.004) as (stub, url):
            async with pool_of(url, count=2, limit=3) as (pool, admission, records, base):
                answers = await asyncio.gather(*(stream(base, 25) for _ in range(24)))
                assert [status for status, _ in answers] == [200] * 24
                assert all(text.endswith(b"data: [DONE]\n\n") and text.count(b'"text":" tok"') == 25
                           for _, text in answers)
                assert stub.peak <= 3, f"{stub.peak} requests at once on an instance held to 3"
                # a forwarded address is believed only from trusted_proxies (none here): the ledger has the peer's
                status, _ = await stream(base, 2, {"x-forwarded-for": "203.0.113.9"})
                assert status == 200
                await eventually(lambda: stub.served == 25, 5, what="the stub counted every request")
                await eventually(lambda: len(records.records) == 25, 5, what="every request in the ledger")
                assert {r.client for r in records.records} == {"127.0.0.1"}
                assert {r.status for r in records.records} == {200}
                assert sorted(r.output_tokens or 0 for r in records.records) == [2] + [25] * 24
                assert all(r.deployment_id == 1 and r.instance == "a" for r in records.records)
                await eventually(lambda: admission.in_flight == 0, 5, what="every slot given back")
                assert sum(w.tally.requests for w in pool.workers) == 25
    run(body)


def test_a_worker_killed_mid_stream_is_replaced_its_slots_freed_and_the_other_workers_streams_go_on() -> None:
    events: list[tuple[str, dict[str, object]]] = []

    async def body() -> None:
        with stub_upstream(token_s=0.02) as (_, url):
            async with pool_of(url, count=2, events=events) as (pool, admission, _, base):
                tasks: list[asyncio.Task[tuple[int, bytes]]] = []
                deadline = time.monotonic() + 20
                while not all(w.tally.held for w in pool.workers):  # a stream on each worker
                    assert time.monotonic() < deadline and len(tasks) < 60, "the streams all went to one worker"
                    tasks.append(asyncio.ensure_future(stream(base, 150)))  # 3 s each
                    await asyncio.sleep(0.05)
                victim, survivor = pool.workers
                old_pid, on_survivor = victim.pid, survivor.tally.held
                assert old_pid is not None
                os.kill(old_pid, signal.SIGKILL)
                # the dead worker's slots are free at once, not when its streams would have ended
                await eventually(lambda: admission.in_flight == survivor.tally.held, 2,
                                 what="the dead worker's slots given back")
                results = await asyncio.gather(*tasks, return_exceptions=True)
                whole = [r for r in results if isinstance(r, tuple) and r[0] == 200
                         and r[1].endswith(b"data: [DONE]\n\n")]
                assert len(whole) >= on_survivor, f"{len(whole)} whole streams; the other worker held {on_survivor}"
                assert len(whole) < len(tasks), "no stream was lost with the killed worker: it held none?"
                await eventually(lambda: victim.pid not in (None, old_pid), 10, what="the worker started again")
                assert victim.restarts == 1 and victim.last_exit == -signal.SIGKILL
                assert [kind for kind, _ in events] == ["gateway_worker_exited"]
                # and the data port serves as before, on both workers
                answers = await asyncio.gather(*(stream(base, 5) for _ in range(8)))
                assert [status for status, _ in answers] == [200] * 8
                await eventually(lambda: admission.in_flight == 0, 5, what="every slot given back")
    run(body)


def test_keys_their_rate_limit_and_their_deployments_are_the_engines_for_every_worker() -> None:
    async def body() -> None:
        with stub_upstream() as (_, url):
            async with pool_of(url, count=2, keys_required=True) as (_, _a, _r, base):
                status, text = await stream(base, 3)
                assert status == 401 and b"API key" in text
                status, _ = await stream(base, 3, {"authorization": "Bearer good"})
                assert status == 200
                # 3 a minute for the key, whichever worker each connection reaches
                statuses = [(await stream(base, 2, {"authorization": "Bearer limited"}))[0] for _ in range(6)]
                assert statuses == [200, 200, 200, 429, 429, 429]
                async with httpx.AsyncClient(timeout=10) as client:
                    listed = (await client.get(f"{base}/v1/models", headers={"authorization": "Bearer only-b"})).json()
                    assert [m["id"] for m in listed["data"]] == ["mb"]
                    assert "deployment" not in listed["data"][0]
                    listed = (await client.get(f"{base}/v1/models", headers={"authorization": "Bearer good"})).json()
                    assert [m["id"] for m in listed["data"]] == ["m", "mb"]
                # a key limited to b does not see a's model; a model nobody serves is not found
                status, text = await stream(base, 2, {"authorization": "Bearer only-b"})
                assert status == 404 and b"does not exist" in text
                status, text = await stream(base, 2, {"authorization": "Bearer good"}, model="nobody")
                assert status == 404 and b"nobody" in text
                # the engine failing on a key is a 503 at once, not a request that waits for ever; the link lives
                status, text = await asyncio.wait_for(stream(base, 2, {"authorization": "Bearer boom"}), 10)
                assert status == 503 and b"RuntimeError" in text
                assert (await stream(base, 2, {"authorization": "Bearer good"}))[0] == 200
    run(body)


def test_the_data_port_serves_only_v1_within_the_engines_bounds_and_closes_with_the_pool() -> None:
    async def body() -> None:
        with stub_upstream() as (stub, url):
            async with pool_of(url, count=1) as (pool, _, _r, base):
                port = pool.port
                async with httpx.AsyncClient(timeout=10) as client:
                    resp = await client.get(f"{base}/api/status")
                    assert resp.status_code == 404 and "port 8000" in resp.json()["error"]["message"]
                    # a body past the limit is refused from its declared length, before a byte of it is read
                    answer = await asyncio.to_thread(raw, port, b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                                                     b"content-type: application/json\r\ncontent-length: 2097152"
                                                     b"\r\n\r\n")
                    assert answer.startswith(b"HTTP/1.1 413") and b"body_limit_v1_bytes" in answer
                    resp = await client.get(f"{base}/v1/models", headers={"x-long": "y" * 20000})
                    assert resp.status_code == 431
                    resp = await client.post(f"{base}/v1/completions", content=b'{"model": "m", "prompt": [[[[',
                                             headers={"content-type": "application/json"})
                    assert resp.status_code == 400
                assert stub.served == 0  # none of it reached vLLM
                pid = pool.workers[0].pid
                assert pid is not None
        # the pool stopped: its workers are gone and the port refuses connections
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    run(body)


class Budgeted(KeyLimits):
    """Key 1 ('good') has a budget of ``tokens`` a day; the store plays no part."""

    def __init__(self, tokens: int) -> None:
        super().__init__(None)
        self.tokens = tokens

    def _read_policy(self, key_id: int) -> Policy:
        return Policy(key_id, Bounds(token_budget=self.tokens, budget_period="day"))


def test_sixty_four_clients_on_one_key_through_two_workers_never_pass_its_budget() -> None:
    """Issue 34's goal: 64 clients on one key with a budget of N tokens; used <= N + what was admitted when it ran
    out. Each request is reserved its body's bytes and max_tokens, so what was admitted fits: the overshoot is 0
    (the test prints what was used and what the last reservations left unused)."""
    budget = 20_000

    async def body() -> None:
        with stub_upstream(token_s=0.001) as (_, url):
            async with pool_of(url, count=2, limit=8, keys_required=True, limits=Budgeted(budget)) as (
                    _, admission, records, base):
                async def client() -> list[int]:
                    statuses = []
                    while True:
                        status, _ = await stream(base, 50, {"authorization": "Bearer good"})
                        statuses.append(status)
                        if status != 200:
                            return statuses
                outcomes = await asyncio.gather(*(client() for _ in range(64)))
                await eventually(lambda: len(records.records) == sum(map(len, outcomes)), 10,
                                 what="every request in the ledger")
                assert {o[-1] for o in outcomes} == {429}
                assert all(status == 200 for o in outcomes for status in o[:-1])
                ok = [r for r in records.records if r.status == 200]
                used = sum((r.input_tokens or 0) + (r.output_tokens or 0) for r in ok)
                print(f"\nbudget {budget:,}: {len(ok)} requests admitted used {used:,} tokens "
                      f"(overshoot {max(0, used - budget)}; {budget - used:,} left unused by the last reservations)")
                assert used <= budget, f"{used - budget} tokens past the budget"
                assert used > budget - 64 * 200, "the budget refused long before it ran out"
                await eventually(lambda: admission.in_flight == 0, 5, what="every slot given back")
    run(body)


def test_a_stream_a_client_left_through_a_worker_is_metered_at_its_instance_s_tokens_per_event() -> None:
    """An instance started with vLLM's --stream-interval=4 sends the first token alone, then 4 an event: a stream its
    client left before the usage chunk is metered so by the events relayed, in the worker as in the engine's own
    port (the worker learns it from the engine's grant). An event every 20 ms: metered at one an event, the 10 the
    client read would need 27 more relayed after it left (540 ms) to pass."""
    async def body() -> None:
        with stub_upstream(token_s=0.02) as (_, url):
            async with pool_of(url, count=1, tokens_per_event=4) as (_, admission, records, base):
                seen = 0
                async with httpx.AsyncClient(timeout=30) as client, client.stream(
                        "POST", f"{base}/v1/completions",
                        json={"model": "m", "prompt": "hello", "max_tokens": 2000, "stream": True}) as resp:
                    async for chunk in resp.aiter_bytes():
                        seen += chunk.count(b"data: {")
                        if seen >= 10:
                            break  # the client leaves mid-stream
                await eventually(lambda: len(records.records) == 1, 10, what="the request in the ledger")
                tokens = records.records[0].output_tokens
                assert records.records[0].error == "the client disconnected"
                assert tokens is not None and tokens >= 1 + 4 * (seen - 1) and (tokens - 1) % 4 == 0, tokens
                await eventually(lambda: admission.in_flight == 0, 5, what="the slot given back")
    run(body)


def doing(pool: WorkerPool) -> list[tuple[bool | None, float]]:
    """What each worker said it does (its last report): takes new connections, the share of responses it lets go."""
    return [(w.tally.accepting, w.tally.shedding) if w.alive else (None, 0.0) for w in pool.workers]


class Forced(Steering):
    """The engine's steering, told what to say whatever the load."""

    def __init__(self, says: list[Steer]) -> None:
        super().__init__(0.5)
        self.says = says

    def decide(self, loads: Sequence[float | None]) -> list[Steer]:
        return list(self.says)


def test_a_light_load_stays_on_the_first_worker_and_the_next_takes_over_at_once_when_it_dies() -> None:
    async def body() -> None:
        with stub_upstream(token_s=0.002) as (_, url):
            # (a whole core's share: twelve streams back to back on a 2-core host may well take half of one, and
            # the next worker would then rightly take some: engine/gateway/steering.py's rules are unit-tested)
            async with pool_of(url, count=3, busy_share=1.0) as (pool, admission, _, base):
                await eventually(lambda: doing(pool) == [(True, 0.0), (False, 0.0), (False, 0.0)], 20,
                                 what="the first worker alone taking connections")
                answers = [await stream(base, 5) for _ in range(12)]  # each on a connection of its own
                assert [status for status, _ in answers] == [200] * 12
                assert [w.tally.requests for w in pool.workers] == [12, 0, 0]  # not spread over three processes
                first, second, _ = pool.workers
                assert first.pid is not None
                os.kill(first.pid, signal.SIGKILL)
                await eventually(lambda: not first.alive, 5, what="the first worker seen dead")
                answers = await asyncio.gather(*(stream(base, 5) for _ in range(4)))
                assert [status for status, _ in answers] == [200] * 4
                assert second.tally.requests == 4  # the next one took them, without waiting for the restart
                await eventually(lambda: doing(pool) == [(True, 0.0), (False, 0.0), (False, 0.0)], 20,
                                 what="the first worker back, alone taking connections again")
                answers = [await stream(base, 5) for _ in range(3)]
                assert [status for status, _ in answers] == [200] * 3
                assert first.tally.requests == 3 and second.tally.requests == 4  # and the first has them again
                await eventually(lambda: admission.in_flight == 0, 5, what="every slot given back")
    run(body)


def test_a_worker_told_to_shed_lets_a_kept_alive_connection_go_and_its_client_reconnects_to_one_with_room() -> None:
    async def body() -> None:
        with stub_upstream(token_s=0.002) as (_, url):
            async with pool_of(url, count=2, busy_share=0.5) as (pool, _, _, base):
                await eventually(lambda: doing(pool) == [(True, 0.0), (False, 0.0)], 10,
                                 what="the first worker alone taking connections")
                body = {"model": "m", "prompt": "hello", "max_tokens": 3}
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:  # one kept-alive connection
                    first_answer = await client.post("/v1/completions", json=body)
                    assert first_answer.status_code == 200 and "close" not in first_answer.headers.get(
                        "connection", "")
                    assert [w.tally.requests for w in pool.workers] == [1, 0]
                    pool.steering = Forced([Steer(accept=False, shed=1.0), Steer(accept=True, shed=0.0)])
                    await eventually(lambda: doing(pool) == [(False, 1.0), (True, 0.0)], 5,
                                     what="the first worker shedding, the second taking connections")
                    let_go = await client.post("/v1/completions", json=body)  # on the kept-alive connection
                    assert let_go.status_code == 200 and let_go.headers["connection"] == "close"
                    assert [w.tally.requests for w in pool.workers] == [2, 0]
                    again = await client.post("/v1/completions", json=body)  # the client reconnects
                    assert again.status_code == 200
                    assert [w.tally.requests for w in pool.workers] == [2, 1]
    run(body)
