"""A gateway worker's link to its engine (engine/gateway/worker.py's EngineLink over a socket pair, the engine's end
played by the test): what it sends and when, when the engine is slow, when a request's client leaves while it waits,
and when a slot is granted to a request that is gone."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from engine.errors import UpstreamUnavailableError
from engine.gateway import wire
from engine.gateway.worker import EngineLink


def _acquire(i: int) -> wire.Acquire:
    return wire.Acquire(i, "m", "default", None, 5.0)


async def _linked(body: Callable[[EngineLink, asyncio.StreamReader, asyncio.StreamWriter],
                                 Coroutine[Any, Any, None]]) -> None:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    engine_reader, engine_writer = await asyncio.open_connection(sock=theirs)
    link = EngineLink(reader, writer)
    running = asyncio.ensure_future(link.run())
    try:
        await body(link, engine_reader, engine_writer)
    finally:
        engine_writer.close()
        await asyncio.wait_for(running, 5)
        writer.close()


async def _next(reader: asyncio.StreamReader) -> wire.Ask:
    return await asyncio.wait_for(wire.read_ask(reader), 5)


async def _asked(reader: asyncio.StreamReader) -> wire.Acquire:
    asked = await _next(reader)
    assert isinstance(asked, wire.Acquire)
    return asked


def test_messages_of_one_turn_reach_the_engine_whole_in_order_and_in_one_write() -> None:
    async def body(link: EngineLink, engine: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        writes: list[bytes] = []
        write = link.writer.write

        def counted(data: bytes | bytearray | memoryview) -> None:
            writes.append(bytes(data))
            write(data)

        link.writer.write = counted  # type: ignore[method-assign]
        for permit in range(1, 51):  # fifty requests end in one turn of the loop
            link.tell(wire.Done(permit, used=permit * 10))
        got = [await _next(engine) for _ in range(50)]
        assert got == [wire.Done(p, used=p * 10) for p in range(1, 51)]
        assert len(writes) == 1  # one system call, not fifty

    asyncio.run(_linked(body))


def test_an_engine_that_does_not_answer_fails_the_request_and_its_wait_is_given_up() -> None:
    async def body(link: EngineLink, engine: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        with pytest.raises(UpstreamUnavailableError, match=r"did not answer within 0\.2 s"):
            await link.ask(_acquire, timeout=0.2)
        asked = await _asked(engine)
        assert await _next(engine) == wire.Cancel(asked.id)  # the engine does not keep a slot for it

    asyncio.run(_linked(body))


def test_a_client_that_leaves_while_it_waits_for_a_slot_gives_up_its_wait() -> None:
    async def body(link: EngineLink, engine: asyncio.StreamReader, _: asyncio.StreamWriter) -> None:
        waiting = asyncio.ensure_future(link.ask(_acquire))
        asked = await _asked(engine)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await _next(engine) == wire.Cancel(asked.id)

    asyncio.run(_linked(body))


@pytest.mark.parametrize("when", ["before it leaves", "after it left"])
def test_a_slot_granted_to_a_request_whose_client_left_goes_back(when: str) -> None:
    async def body(link: EngineLink, engine: asyncio.StreamReader, engine_out: asyncio.StreamWriter) -> None:
        waiting = asyncio.ensure_future(link.ask(_acquire))
        asked = await _asked(engine)
        granted = wire.Granted(asked.id, 7, "http://127.0.0.1:1", 1, "a", 1, None, 1)
        if when == "before it leaves":  # the answer is in (as the link's reader gives it), the request not yet
            # woken when it is cancelled: it never sees the slot
            link._waiting.pop(asked.id).set_result(granted)
            waiting.cancel()
        else:
            waiting.cancel()
            await asyncio.sleep(0)
            engine_out.write(wire.frame(granted))
        with pytest.raises(asyncio.CancelledError):
            await waiting
        told = [await _next(engine)]
        if isinstance(told[0], wire.Cancel):  # (it left first: its wait is given up, then the late grant back)
            told.append(await _next(engine))
        assert told[-1] == wire.Done(7, used=0)

    asyncio.run(_linked(body))


def test_a_lost_engine_fails_the_questions_waiting_at_once() -> None:
    async def body(link: EngineLink, engine: asyncio.StreamReader, engine_out: asyncio.StreamWriter) -> None:
        waiting = asyncio.ensure_future(link.ask(_acquire))
        await _next(engine)
        engine_out.close()
        with pytest.raises(UpstreamUnavailableError, match="the engine is gone"):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(_linked(body))


def test_an_engine_that_dies_with_the_worker_s_messages_unread_ends_the_link_as_a_close_would() -> None:
    """A killed engine leaves what its workers sent unread: the kernel resets the socket instead of closing it, and
    a reset the link took for something else left the worker serving on the data port for ever, its engine gone."""

    async def body() -> None:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        link = EngineLink(reader, writer)
        running = asyncio.ensure_future(link.run())
        for _ in range(20):
            link.tell(wire.Busy(0.1))  # what the engine never reads
        await asyncio.sleep(0)  # (the outbox writes at the end of the turn)
        link.out.flush()
        theirs.close()
        await asyncio.wait_for(running, 5)  # ended, not raised
        assert link.lost is not None and "broke" in link.lost
        writer.close()

    asyncio.run(body())
