"""The gateway's HTTP/1.1 reader of vLLM's answers (engine/gateway/upstream.py): a chunked stream read whole or cut
at any byte gives the same body, events taken whole from a read (the fast path) or through the state machine alike;
a chunk size that is not plain hex is an error, not a number int() happens to accept."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.gateway.upstream import Connection, Pool, UpstreamError

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"choices":[{"text":"%d"}]}\n\n' % i for i in range(12)]
STREAM = HEAD + b"".join(b"%x\r\n" % len(e) + e + b"\r\n" for e in EVENTS) + b"0\r\n\r\n"


class Sink:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def received(reads: list[bytes]) -> tuple[bytes, Any]:
    """The body a connection hands over for ``reads`` (as the socket delivered them), and its error if any."""

    async def run() -> tuple[bytes, Any]:
        conn = Connection(Pool("127.0.0.1", 1), 30.0)
        conn.connection_made(Sink())  # type: ignore[arg-type]
        conn.send(b"POST / HTTP/1.1\r\n\r\n", b"")
        for data in reads:
            conn.data_received(data)
        out = []
        try:
            await conn.head()
            while part := await conn.read():
                out.append(part)
        except UpstreamError as exc:
            return b"".join(out), exc
        finally:
            conn._cancel_timer()
        return b"".join(out), None

    return asyncio.run(run())


def test_a_stream_read_whole_or_cut_at_any_byte_gives_the_same_events() -> None:
    whole = b"".join(EVENTS)
    assert received([STREAM]) == (whole, None)
    assert received([HEAD, STREAM[len(HEAD):]]) == (whole, None)  # the fast path: reads of whole chunks
    for cut in range(len(HEAD), len(STREAM)):
        assert received([STREAM[:cut], STREAM[cut:]]) == (whole, None), cut
    assert received([bytes([b]) for b in STREAM]) == (whole, None)


@pytest.mark.parametrize("size", [b"-1", b"1_0", b"+a", b" ", b"zz", b"1" * 17])
def test_a_chunk_size_that_is_not_plain_hex_is_an_error(size: bytes) -> None:
    for reads in ([HEAD + size + b"\r\nabcdefghijklmnopq\r\n0\r\n\r\n"],
                  [HEAD, size + b"\r\nabcdefghijklmnopq\r\n0\r\n\r\n"]):
        body, error = received(reads)
        assert isinstance(error, UpstreamError) and "malformed chunk size" in str(error), (size, body)


def test_a_chunk_without_its_crlf_is_an_error_on_either_path() -> None:
    for reads in ([HEAD + b"3\r\nabcXY0\r\n\r\n"], [HEAD, b"3\r\nabcXY0\r\n\r\n"]):
        _, error = received(reads)
        assert isinstance(error, UpstreamError) and "CRLF" in str(error)


class Transport(Sink):
    """A socket's transport that says whether reading is paused."""

    def __init__(self) -> None:
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False


def test_an_answer_that_ends_while_its_client_is_full_goes_back_to_the_pool_reading() -> None:
    """Its last read came while the sink's client could take no more: reading paused, the answer done. Pooled so, the
    next request on the connection never read its answer (a review found it: a 504 after upstream_timeout_s)."""

    async def run() -> None:
        pool = Pool("127.0.0.1", 1)
        conn = Connection(pool, 30.0)
        transport = Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.send(b"POST / HTTP/1.1\r\n\r\n", b"")
        got: list[bytes] = []

        def full_after_each(data: bytes) -> bool:  # a client that is full after every read
            got.append(data)
            return False

        conn.relay_to(full_after_each)
        conn.data_received(STREAM)
        assert transport.paused and conn.relay_full
        assert await conn.relay_wait()  # ended
        conn.relay_to(None)
        conn.finish()
        assert b"".join(got) == b"".join(EVENTS)
        assert pool.idle == [conn] and not transport.paused

    asyncio.run(run())


def test_a_body_buffered_past_the_pause_mark_is_read_on_once_a_sink_takes_it() -> None:
    async def run() -> None:
        conn = Connection(Pool("127.0.0.1", 1), 30.0)
        transport = Transport()
        conn.connection_made(transport)  # type: ignore[arg-type]
        conn.send(b"POST / HTTP/1.1\r\n\r\n", b"")
        big = b"data: " + b"x" * (5 << 20) + b"\n\n"
        conn.data_received(HEAD + b"%x\r\n" % len(big) + big + b"\r\n")
        assert transport.paused  # read()'s buffer is past PAUSE_AT
        got: list[bytes] = []

        def takes_all(data: bytes) -> bool:
            got.append(data)
            return True

        conn.relay_to(takes_all)
        assert got == [big] and not transport.paused
        conn._cancel_timer()

    asyncio.run(run())


def relayed(reads: list[bytes], takes_whole: bool = True, wait: bool = True) -> tuple[list[bytes], list[bytes], bool]:
    """What a relay's ``whole`` (chunks, framing and all) and its ``sink`` got for ``reads``, in the order they got it
    (a tag each: b"W" or b"S" first), and whether the body ended (waited for, with ``wait``)."""

    async def run() -> tuple[list[bytes], list[bytes], bool]:
        conn = Connection(Pool("127.0.0.1", 1), 30.0)
        conn.connection_made(Sink())  # type: ignore[arg-type]
        conn.send(b"POST / HTTP/1.1\r\n\r\n", b"")
        order: list[bytes] = []
        framed: list[bytes] = []

        def whole(chunk: bytes) -> bool | None:
            if not takes_whole:
                return None
            framed.append(chunk)
            order.append(b"W" + _unframe(chunk))
            return True

        def sink(data: bytes) -> bool:
            order.append(b"S" + data)
            return True

        conn.data_received(reads[0])
        await conn.head()
        conn.relay_to(sink, whole)
        for data in reads[1:]:
            conn.data_received(data)
        ended = await conn.relay_wait() if wait else conn._state == "done"
        conn.relay_to(None)
        conn._cancel_timer()
        return order, framed, ended

    return asyncio.run(run())


def _unframe(chunk: bytes) -> bytes:
    size, _, rest = chunk.partition(b"\r\n")
    assert rest.endswith(b"\r\n") and len(rest) == int(size, 16) + 2, chunk
    return rest[:-2]


def test_a_relayed_stream_cut_at_any_byte_reaches_the_client_whole_and_in_order() -> None:
    """Reads that are one whole chunk go to ``whole`` as they came (vLLM's framing passed on); anything else (a chunk
    cut by the read, two in one read, the last chunk) to the sink, parsed; together, every event once, in order."""
    body = STREAM[len(HEAD):]
    order, framed, ended = relayed([HEAD, body])
    assert ended and b"".join(part[1:] for part in order) == b"".join(EVENTS)
    assert framed == []  # one read with every chunk: parsed
    chunks = [b"%x\r\n" % len(e) + e + b"\r\n" for e in EVENTS]
    order, framed, ended = relayed([HEAD, *chunks, b"0\r\n\r\n"])
    assert ended and framed == chunks  # each read one chunk: all passed on as they came
    for cut in range(len(body)):
        order, framed, ended = relayed([HEAD, body[:cut], body[cut:]])
        assert ended and b"".join(part[1:] for part in order) == b"".join(EVENTS), cut
    one_by_one = [HEAD, *chunks[:3], chunks[3] + chunks[4], chunks[5][:7], chunks[5][7:], *chunks[6:], b"0\r\n\r\n"]
    order, framed, ended = relayed(one_by_one)
    assert ended and b"".join(part[1:] for part in order) == b"".join(EVENTS)
    assert [p[:1] for p in order] == [b"W"] * 3 + [b"S"] + [b"S", b"S"] + [b"W"] * 6
    order, framed, ended = relayed(one_by_one, takes_whole=False)  # declined: the sink gets them, parsed
    assert ended and framed == [] and b"".join(part[1:] for part in order) == b"".join(EVENTS)


@pytest.mark.parametrize("read", [b"3\r\nabc\r\n", b"03\r\nabc\r\n", b"A\r\n0123456789\r\n"])
def test_a_read_of_one_plain_whole_chunk_is_passed_on_as_it_came(read: bytes) -> None:
    order, framed, ended = relayed([HEAD, read], wait=False)
    assert framed == [read] and [p[:1] for p in order] == [b"W"] and not ended


@pytest.mark.parametrize("read", [b"0\r\n\r\n", b"3;x=1\r\nabc\r\n", b"3\r\nab", b"3\r\nabc\r\n3\r\n", b"3\r\nabcXY",
                                  b"3\r\nabc\n\n"])
def test_a_read_that_is_not_one_plain_whole_chunk_is_parsed_not_passed_on(read: bytes) -> None:
    """The last chunk, one with an extension, a cut chunk, a chunk and a part, a chunk without its CRLF: none goes to
    ``whole``; the parser takes each as before (its errors: the tests above)."""
    order, framed, _ = relayed([HEAD, read], wait=False)
    assert framed == [] and all(p[:1] == b"S" for p in order)
