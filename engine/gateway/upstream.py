"""The gateway's HTTP/1.1 client to vLLM: keep-alive connections as asyncio protocols, the response body handed
over as it arrives, and nothing else.

Every token of every stream passes through here, so a read costs one event-loop wake-up: the protocol parses
what the socket delivered (chunked or sized), appends the payload to one buffer and wakes the reader, which takes
all of it at once. Measured against httpx and aiohttp by `python -m bench gateway-overhead`; aiohttp's C parser also
hung for good on a malformed chunk (it neither raised nor timed out), which this parser answers with an error.

A connection is reused only after its response was read to the end; one given up mid-body (a client that left)
is closed, which makes vLLM abort the request. Idle connections older than ``idle_s`` are dropped before vLLM's
own keep-alive timeout (5 s) can close them under a request.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, cast
from urllib.parse import urlsplit

from engine.errors import EngineError

MAX_HEAD = 64 * 1024
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")  # a chunk's size (no sign, no underscore: int() would take them)
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,8})\r\n")  # the size line of a chunk, no extension
PAUSE_AT = 4 << 20  # bytes buffered for a slow client before reading from vLLM pauses


class UpstreamError(EngineError):
    """vLLM's answer could not be had. ``before_response``: nothing of it arrived (safe to send elsewhere)."""

    def __init__(self, message: str, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class UpstreamTimeoutError(UpstreamError):
    pass


@dataclass
class Head:
    status: int
    headers: list[tuple[bytes, bytes]]
    chunked: bool
    length: int | None  # None with chunked, or read to the connection's end
    keep_alive: bool


@dataclass
class _Wait:
    future: asyncio.Future[None] | None = None


class Connection(asyncio.Protocol):
    """One keep-alive connection. ``request`` writes a request; ``head`` and ``read`` return its answer."""

    def __init__(self, pool: Pool, read_timeout_s: float) -> None:
        self.pool = pool
        self.read_timeout_s = read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = time.monotonic()
        self._buf = bytearray()  # raw bytes not yet parsed
        self._body: deque[bytes] = deque()
        self._body_size = 0
        self._head: Head | None = None
        self._state: Literal["idle", "head", "sized", "chunk_size", "chunk_data", "chunk_crlf", "trailer", "eof",
                             "done"] = "idle"
        self._left = 0
        self._error: UpstreamError | None = None
        self._wait = _Wait()
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False
        # relay_to's: the body goes to the sink from the socket's callback; full while its client cannot take more
        self._sink: Callable[[bytes], bool] | None = None
        self._sink_full = False
        self._whole: Callable[[bytes], bool | None] | None = None
        # Asked once: asyncio.get_running_loop() costs a getpid() call per use on Python 3.11, once per event
        # when asked in read() (3 % of the loop's samples under 64 streams, py-spy).
        self._loop = asyncio.get_running_loop()

    # --- asyncio.Protocol --------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self._state == "eof":  # a body that runs to the connection's end has ended
            self._state = "done"
        elif self._state not in ("idle", "done"):
            self._fail(UpstreamError(f"vLLM closed the connection ({exc or 'no reason given'})",
                                     before_response=self._head is None))
        self._wake()

    def data_received(self, data: bytes) -> None:
        self._last_data = time.monotonic()
        whole = self._whole
        if whole is not None and self._state == "chunk_size" and not self._buf and not self._body:
            # the common read of a stream: one whole chunk (vLLM writes each event as one), offered framing and all
            match = _CHUNK_SIZE.match(data)
            if match is not None:
                start = match.end()
                size = int(match[1], 16)
                if size and start + size + 2 == len(data) and data.endswith(b"\r\n"):
                    room = whole(data)
                    if room is not None:
                        if not room:
                            self._hold()
                            self._wake()
                        return
        if self._state == "idle":  # bytes nobody asked for: the connection cannot be trusted any more
            self._close()
            return
        try:
            if self._state == "chunk_size" and not self._buf:
                data = self._whole_chunks(data)
            if data:
                self._buf += data
                self._parse()
        except UpstreamError as exc:
            self._fail(exc)
            self._close()
        sink = self._sink
        if sink is not None:
            if self._body:
                body = self._body
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self._body_size = 0
                if not sink(data):
                    self._hold()
            if not (self._sink_full or self._error is not None or self._state == "done"):
                return  # the relay sleeps until something other than data happens
        self._wake()
        if self._body_size > PAUSE_AT and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    # --- parsing -----------------------------------------------------------------------------------------------

    def _whole_chunks(self, data: bytes) -> bytes:
        """The common case of a stream, at the cost of one slice per event: the read holds whole chunks (vLLM
        writes each event as one). They are taken straight from ``data``; what is left (a chunk cut by the read,
        the last chunk, anything odd) goes to ``_parse``."""
        pos, n = 0, len(data)
        while True:
            end = data.find(b"\r\n", pos, pos + 20)
            if end < 0 or _HEX.fullmatch(data, pos, end) is None:
                break
            size = int(data[pos:end], 16)
            stop = end + 2 + size
            if size == 0 or stop + 2 > n or data[stop:stop + 2] != b"\r\n":
                break
            self._push(data[end + 2:stop])
            pos = stop + 2
        return data[pos:] if pos else data

    def _parse(self) -> None:
        buf = self._buf
        while buf:
            state = self._state
            if state == "head":
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD:
                        raise UpstreamError("vLLM's response head is too large", before_response=True)
                    return
                self._head = _parse_head(bytes(buf[:end]))
                del buf[:end + 4]
                if self._head.chunked:
                    self._state = "chunk_size"
                elif self._head.length is not None:
                    self._left = self._head.length
                    self._state = "sized" if self._left else "done"
                else:
                    self._state = "eof"
            elif state == "sized" or state == "eof":
                take = len(buf) if state == "eof" else min(self._left, len(buf))
                self._push(bytes(buf[:take]))
                del buf[:take]
                if state == "sized":
                    self._left -= take
                    if self._left == 0:
                        self._state = "done"
            elif state == "chunk_size":
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 1024:
                        raise UpstreamError("vLLM sent a malformed chunk size", before_response=False)
                    return
                line = bytes(buf[:end]).split(b";", 1)[0].strip()
                if _HEX.fullmatch(line) is None:
                    raise UpstreamError(f"vLLM sent a malformed chunk size ({line[:20]!r})", before_response=False)
                size = int(line, 16)
                del buf[:end + 2]
                self._left = size
                self._state = "chunk_data" if size else "trailer"
            elif state == "chunk_data":
                take = min(self._left, len(buf))
                self._push(bytes(buf[:take]))
                del buf[:take]
                self._left -= take
                if self._left == 0:
                    self._state = "chunk_crlf"
            elif state == "chunk_crlf":
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise UpstreamError("vLLM sent a chunk without its CRLF", before_response=False)
                del buf[:2]
                self._state = "chunk_size"
            elif state == "trailer":
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[:end + 2]
                if end == 0:
                    self._state = "done"
            else:  # done: vLLM sent more than the answer
                raise UpstreamError("vLLM sent bytes past the end of its answer", before_response=False)

    def _push(self, data: bytes) -> None:
        if data:
            self._body.append(data)
            self._body_size += len(data)

    # --- waiting -----------------------------------------------------------------------------------------------

    def _wake(self) -> None:
        fut = self._wait.future
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _fail(self, exc: UpstreamError) -> None:
        if self._error is None:
            self._error = exc

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _arm_timer(self) -> None:
        self._cancel_timer()
        self._timer = self._loop.call_later(self.read_timeout_s, self._check_timeout)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_timeout(self) -> None:
        """One timer per request, pushed on while data flows (not re-armed per chunk: that costs)."""
        self._timer = None
        if self._state in ("idle", "done"):
            return
        if self._paused and self._sink is not None:  # paused for a client that takes nothing: the relay bounds that
            self._last_data = time.monotonic()
        idle = time.monotonic() - self._last_data
        if idle >= self.read_timeout_s:
            self._fail(UpstreamTimeoutError(f"vLLM sent nothing for {self.read_timeout_s:g} s",
                                            before_response=self._head is None))
            self._close()
            self._wake()
        else:
            self._timer = self._loop.call_later(self.read_timeout_s - idle, self._check_timeout)

    async def _until(self, ready: bool) -> None:
        if ready:
            return
        fut = self._loop.create_future()
        self._wait.future = fut
        try:
            await fut
        finally:
            self._wait.future = None

    # --- the request's side ------------------------------------------------------------------------------------

    def send(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._state = "head"
        self._head = None
        self._error = None
        self._left = 0
        self._last_data = time.monotonic()
        self._arm_timer()
        self.transport.write(head + body if len(body) < 65536 else head)
        if len(body) >= 65536:
            self.transport.write(body)

    async def head(self) -> Head:
        while self._head is None:
            if self._error is not None:
                raise self._error
            await self._until(self._head is not None or self._error is not None)
        return self._head

    async def read(self) -> bytes:
        """What has arrived of the body (waiting for some), b"" at its end; UpstreamError if it broke."""
        while True:
            if self._body:
                data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
                self._body.clear()
                self._body_size = 0
                if self._paused and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self._error is not None:
                raise self._error
            if self._ended():
                return b""
            await self._until(bool(self._body) or self._error is not None or self._ended())

    def _ended(self) -> bool:
        return self._state == "done"

    # --- a stream relayed from the socket's callback -------------------------------------------------------------

    def relay_to(self, sink: Callable[[bytes], bool] | None,
                 whole: Callable[[bytes], bool | None] | None = None) -> None:
        """While ``sink`` is set, the body goes to it from the socket's callback as each read arrives, with no
        wake-up of the task that relays (a turn of the loop per event less); ``sink`` returns False when its
        client can take no more, and reading from vLLM pauses until ``relay_resume``. ``relay_wait`` waits for
        what is not data. None ends it.

        ``whole``, if given, is offered first each read that is exactly one whole chunk of the body, its framing
        included (``b"1f\\r\\n" + payload + b"\\r\\n"``), as it came: it returns None to leave it to the parser
        and ``sink``, else what ``sink`` would (it took the chunk). It spares a stream's every event the parse,
        a copy and the re-framing."""
        self._sink = sink
        self._whole = whole if sink is not None else None
        self._sink_full = False
        if sink is not None and self._body:
            data = b"".join(self._body)
            self._body.clear()
            self._body_size = 0
            if not sink(data):
                self._hold()
                return
        self._resume()  # a pause of read()'s buffer, or of the sink's last read (an answer ended while it was full)

    def _resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    def _hold(self) -> None:
        self._sink_full = True
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    @property
    def relay_full(self) -> bool:
        """The sink's client could take no more: reading is paused."""
        return self._sink_full

    def relay_resume(self) -> None:
        self._sink_full = False
        self._resume()

    async def relay_wait(self) -> bool:
        """Until the body ended (True), the sink is full or ``wake`` was called (False); UpstreamError if the
        answer broke."""
        if self._error is None and not self._ended() and not self._sink_full:
            await self._until(False)
        if self._error is not None:
            raise self._error
        return self._ended()

    def wake(self) -> None:
        """Ends a ``relay_wait`` (its caller has something else to look at: a client that left)."""
        self._wake()

    def finish(self) -> None:
        """The caller is done with this response: back to the pool if it was read to its end, else closed."""
        self._cancel_timer()
        head = self._head
        if self._state == "done" and not self.closed and head is not None and head.keep_alive and not self._buf:
            self._resume()  # (an idle connection reads: bytes nobody asked for, or vLLM closing it)
            self._state = "idle"
            self.idle_since = time.monotonic()
            self.pool.put_back(self)
        else:
            self._close()


def _parse_head(raw: bytes) -> Head:
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise UpstreamError(f"vLLM sent a malformed status line ({lines[0][:40]!r})", before_response=True)
    headers: list[tuple[bytes, bytes]] = []
    chunked, length, keep_alive = False, None, parts[0] == b"HTTP/1.1"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise UpstreamError("vLLM sent a malformed header line", before_response=True)
        name, value = name.strip().lower(), value.strip()
        headers.append((name, value))
        if name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"content-length":
            if not value.isdigit():
                raise UpstreamError("vLLM sent a malformed content-length", before_response=True)
            length = int(value)
        elif name == b"connection":
            keep_alive = b"close" not in value.lower() and (keep_alive or b"keep-alive" in value.lower())
    return Head(int(parts[1]), headers, chunked, None if chunked else length, keep_alive)


@dataclass
class Pool:
    """Idle keep-alive connections to one vLLM instance."""

    host: str
    port: int
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    idle_s: float = 4.0
    idle: list[Connection] = field(default_factory=list)

    def put_back(self, conn: Connection) -> None:
        self.idle.append(conn)

    async def connection(self) -> Connection:
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if not conn.closed and now - conn.idle_since < self.idle_s:
                return conn
            conn._close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, protocol = await loop.create_connection(lambda: Connection(self, self.read_timeout_s),
                                                           self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect to vLLM at {self.host}:{self.port} ({exc})",
                                before_response=True) from None
        return protocol  # asyncio and uvloop both set TCP_NODELAY: each event leaves at once

    def close(self) -> None:
        for conn in self.idle:
            conn._close()
        self.idle.clear()


class Client:
    """One pool per upstream URL."""

    def __init__(self, read_timeout_s: float, connect_timeout_s: float = 5.0) -> None:
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._pools: dict[str, Pool] = {}

    def pool(self, url: str) -> Pool:
        pool = self._pools.get(url)
        if pool is None:
            parts = urlsplit(url)
            pool = Pool(parts.hostname or "127.0.0.1", parts.port or 80, self.connect_timeout_s, self.read_timeout_s)
            self._pools[url] = pool
        return pool

    async def request(self, url: str, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
                      ) -> tuple[Connection, Head]:
        """Send a request on a pooled connection and wait for its head; the caller reads the body and calls
        ``finish`` on the connection."""
        pool = self.pool(url)
        conn = await pool.connection()
        lines = [f"{method} {target} HTTP/1.1\r\nhost: {pool.host}:{pool.port}\r\n".encode()]
        lines += [name + b": " + value + b"\r\n" for name, value in headers]
        lines.append(b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
        conn.send(b"".join(lines), body)
        try:
            return conn, await conn.head()
        except BaseException:
            conn.finish()
            raise

    def forget(self, url: str) -> None:
        pool = self._pools.pop(url, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
