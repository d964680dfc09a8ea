"""The gateway's admission gate: bounded waiting room, longest wait, drain."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import pytest

from engine.errors import QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway import Admission
from tests.support.wait import eventually


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


def test_open_gate_admits_at_once() -> None:
    async def go() -> None:
        gate = Admission(queue_size=2, queue_timeout_s=1)
        await gate.open("http://x")
        assert (await gate.acquire(time.monotonic() + 1)).url == "http://x"
        assert gate.in_flight == 1
        await gate.release()
        assert gate.in_flight == 0

    run(go())


def test_waiters_go_to_the_new_upstream_when_it_opens() -> None:
    async def go() -> None:
        gate = Admission(queue_size=4, queue_timeout_s=5)
        waiters = [asyncio.create_task(gate.acquire(time.monotonic() + 5)) for _ in range(3)]
        await eventually(lambda: gate.waiting == 3, 5, what="three waiters")
        await gate.open("http://new", revision=7)
        assert [(u.url, u.revision) for u in await asyncio.gather(*waiters)] == [("http://new", 7)] * 3
        assert gate.waiting == 0 and gate.in_flight == 3

    run(go())


def test_queue_is_bounded() -> None:
    async def go() -> None:
        gate = Admission(queue_size=1, queue_timeout_s=5)
        first = asyncio.create_task(gate.acquire(time.monotonic() + 5))
        await eventually(lambda: gate.waiting == 1, 5, what="the first waiter")
        with pytest.raises(QueueFullError):
            await gate.acquire(time.monotonic() + 5)
        assert gate.rejected == 1
        first.cancel()

    run(go())


def test_longest_wait_is_bounded() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=0.2)
        with pytest.raises(QueueTimeoutError):
            await gate.acquire(time.monotonic() + 0.2)
        assert gate.waiting == 0

    run(go())


def test_drain_waits_for_in_flight_requests() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://x")
        await gate.acquire(time.monotonic() + 1)
        await gate.close()

        draining = asyncio.create_task(gate.drain(timeout=5))
        await asyncio.sleep(0)  # the drain is under way ...
        assert not draining.done()
        await gate.release()  # ... and ends when the last request does
        assert await draining == 0

    run(go())


def test_drain_gives_up_after_its_timeout() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://x")
        await gate.acquire(time.monotonic() + 1)
        assert await gate.drain(timeout=0.1) == 1

    run(go())


def test_refusal_turns_waiting_into_an_immediate_503() -> None:
    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=10)
        waiter = asyncio.create_task(gate.acquire(time.monotonic() + 10))
        await eventually(lambda: gate.waiting == 1, 5, what="the waiter")
        await gate.refuse("stopped by an operator")
        with pytest.raises(UpstreamUnavailableError, match="operator"):
            await waiter
        with pytest.raises(UpstreamUnavailableError):
            await gate.acquire(time.monotonic() + 10)
        await gate.open("http://x")
        assert gate.refusal is None
        assert (await gate.acquire(time.monotonic() + 1)).url == "http://x"

    run(go())


def test_stream_slot_is_released_when_the_client_is_gone() -> None:
    """However the stream ends (even if its body never starts, as when the client left while queued), the slot
    is released exactly once."""
    from starlette.types import Message

    from engine.gateway.proxy import _TrackedStream

    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://x")
        await gate.acquire(time.monotonic() + 1)

        async def body() -> AsyncIterator[bytes]:
            while True:
                yield b"data: {}\n\n"
                await asyncio.sleep(0.01)

        response = _TrackedStream(body(), gate.release, status_code=200)

        async def receive() -> Message:
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            return None

        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        assert gate.in_flight == 0  # released, and only once (twice would leave -1)

    run(go())


def test_an_unreadable_answer_is_a_502_and_frees_its_slot() -> None:
    """Fault injection through a scripted upstream (not vLLM, which cannot garble its answer on demand): an error
    that is neither a retry nor a timeout must still leave the request's slot free for the next drain."""
    import httpx

    from engine.gateway import Gateway

    def garbled(request: httpx.Request) -> httpx.Response:
        raise httpx.DecodingError("the answer's gzip is garbled", request=request)

    async def go() -> None:
        gate = Admission(queue_size=5, queue_timeout_s=1)
        await gate.open("http://vllm", 1)
        gateway = Gateway(gate, 5.0)
        gateway.client = httpx.AsyncClient(transport=httpx.MockTransport(garbled))
        resp = await gateway.forward("POST", "/v1/completions", {}, {}, b'{"prompt": "hi"}')
        await gateway.client.aclose()
        assert resp.status_code == 502 and b"DecodingError" in bytes(resp.body)
        assert gate.in_flight == 0

    run(go())
