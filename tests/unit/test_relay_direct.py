"""A stream through the data path under a real uvicorn with the edge protocol, as the engine and its workers serve
it: each read of vLLM's socket is written to the client's from the socket's callback (engine/gateway/proxy.py,
``_direct``). What a client sees must not change: every event in order, vLLM's usage chunk hidden when it did not
ask, a client that reads slowly holding back vLLM rather than the gateway's memory, a client that hangs up ending
vLLM's request. The upstream is scripted (named as such: a socket that writes what the test says, not vLLM)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from starlette.types import Receive, Scope, Send

from engine.access import GatewayKeys, RateLimiter
from engine.edge import HeadLimits, edge_protocol
from engine.gateway import Admission, BodyLimits, DataPath, Gateway
from engine.gateway import proxy as proxy_module
from tests.testkit.ledger import Records
from tests.testkit.served import serving
from tests.testkit.wait import wait_until
from tests.unit.test_datapath import FakeAuth

REQUEST = b'{"stream": true, "prompt": "x"}'


class ScriptedUpstream:
    """One connection, one chunked answer of ``events`` ``pace_s`` apart (a thread with a blocking socket). It
    notes what it wrote, since when its writes block (the reader stopped reading), and whether the reader closed."""

    def __init__(self, events: list[bytes], pace_s: float = 0.0, reads: list[bytes] | None = None) -> None:
        self.events = events
        self.reads = reads  # instead of events: the body's raw bytes, framing and all, one write each
        self.pace_s = pace_s
        self.written = 0
        self.blocked_since: float | None = None
        self.closed_by_peer = threading.Event()
        self.finished = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(65536)
            raw_head, _, body = head.partition(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in raw_head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            conn.settimeout(0.2)
            pause = threading.Event()
            try:
                chunks = [b"%x\r\n%b\r\n" % (len(e), e) for e in [*self.events, b"data: [DONE]\n\n"]]
                for data in self.reads if self.reads is not None else [*chunks, b"0\r\n\r\n"]:
                    self._write(conn, data)
                    if self.pace_s:
                        pause.wait(self.pace_s)
                self.finished.set()
            except (BrokenPipeError, ConnectionResetError):
                self.closed_by_peer.set()

    def _write(self, conn: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = conn.send(view)
            except TimeoutError:
                if self.blocked_since is None:
                    self.blocked_since = time.monotonic()
                continue
            self.blocked_since = None
            self.written += sent
            view = view[sent:]


class OpenedPath:
    """The data path with its admission opened on uvicorn's own loop (at the first request)."""

    def __init__(self, url: str, upstream_timeout_s: float = 5.0) -> None:
        self.url = url
        self.admission = Admission(4, 1)
        keys = GatewayKeys(FakeAuth(), RateLimiter(), False)  # type: ignore[arg-type]
        self.path = DataPath(Gateway(lambda _: self.admission, upstream_timeout_s), keys,
                             BodyLimits(1 << 20, 2.0, 64))
        self.ledger = Records()
        self.path.gateway.ledger = self.ledger
        self.opened = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if not self.opened:
            await self.admission.open(self.url, 1)
            self.opened = True
        await self.path(scope, receive, send)


@contextmanager
def gateway(upstream: ScriptedUpstream, upstream_timeout_s: float = 5.0) -> Iterator[tuple[int, OpenedPath]]:
    app = OpenedPath(upstream.url, upstream_timeout_s)
    with serving(app, edge_protocol(HeadLimits())) as port:
        yield port, app


def ask(port: int, requests: int = 1) -> socket.socket:
    """A connection that sent ``requests`` streamed completions at once (more than one: pipelined)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(requests * (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                             b"\r\ncontent-length: %d\r\n\r\n%b" % (len(REQUEST), REQUEST)))
    return sock


def read_stream(sock: socket.socket) -> tuple[bytes, bytes]:
    """The head and the de-chunked body of a chunked answer, read to its last chunk."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += sock.recv(65536)
    head, _, rest = buf.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    body = bytearray()
    while True:
        while b"\r\n" not in rest:
            rest += sock.recv(1 << 20)
        line, _, rest = rest.partition(b"\r\n")
        size = int(line, 16)
        while len(rest) < size + 2:
            rest += sock.recv(1 << 20)
        assert rest[size:size + 2] == b"\r\n"
        if size == 0:
            return head, bytes(body)
        body += rest[:size]
        rest = rest[size + 2:]


def token(i: int, pad: int = 0) -> bytes:
    return b"data: " + json.dumps({"choices": [{"text": f"t{i}", "index": 0}], "pad": "x" * pad}).encode() + b"\n\n"


@pytest.fixture
def only_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream must take the direct path: the per-event one fails the test if it is used."""
    def per_event(*args: object) -> bool:
        raise AssertionError("the stream was relayed per event, not from the socket's callback")

    monkeypatch.setattr(proxy_module, "_by_events", per_event)


@pytest.mark.usefixtures("only_direct")
def test_every_event_arrives_in_order_and_the_usage_it_did_not_ask_for_is_hidden_but_metered() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":40,"total_tokens":43}}\n\n'
    events = [token(i) for i in range(40)] + [usage]
    upstream = ScriptedUpstream(events, pace_s=0.001)
    with gateway(upstream) as (port, app), ask(port) as sock:
        head, body = read_stream(sock)
        assert head.startswith(b"HTTP/1.1 200")
        assert body == b"".join(token(i) for i in range(40)) + b"data: [DONE]\n\n"  # no usage: not asked for
        wait_until(lambda: app.ledger.records and app.admission.in_flight == 0, 10, what="the request settled")
        rec = app.ledger.records[0]
        assert (rec.input_tokens, rec.output_tokens, rec.error) == (3, 40, None)
        assert rec.ttft_s is not None and rec.ttft_s > 0


@pytest.mark.usefixtures("only_direct")
def test_reads_of_any_shape_reach_the_client_as_events_in_order_the_usage_hidden_the_tokens_counted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's reads, one chunk each, go on in vLLM's own framing; reads of other shapes (two chunks, an event cut
    across two chunks or two reads, a chunk with an extension, upper-case and zero-padded sizes) are parsed and
    re-framed, and the usage chunk is taken out of a read of several events. The client sees the same events."""
    passed: list[bytes] = []
    passes = proxy_module.StreamMeter.passes

    def counted(meter: proxy_module.StreamMeter, framed: bytes) -> bool:
        if ok := passes(meter, framed):
            passed.append(framed)
        return ok

    monkeypatch.setattr(proxy_module.StreamMeter, "passes", counted)
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9,"total_tokens":12}}\n\n'
    ev = [token(i) for i in range(9)]

    def chunk(data: bytes, size: bytes | None = None) -> bytes:
        return (size or b"%x" % len(data)) + b"\r\n" + data + b"\r\n"

    reads = [chunk(ev[0]), chunk(ev[1]) + chunk(ev[2]), chunk(ev[3][:9]), chunk(ev[3][9:]), chunk(ev[4])[:5],
             chunk(ev[4])[5:], chunk(ev[5], b"%X" % len(ev[5])), chunk(ev[6], b"00%x" % len(ev[6])),
             chunk(ev[7], b"%x;note=1" % len(ev[7])), chunk(ev[8] + usage), chunk(b"data: [DONE]\n\n"), b"0\r\n\r\n"]
    upstream = ScriptedUpstream([], pace_s=0.02, reads=reads)
    with gateway(upstream) as (port, app), ask(port) as sock:
        _, body = read_stream(sock)
        assert body == b"".join(ev) + b"data: [DONE]\n\n"
        wait_until(lambda: app.ledger.records and app.admission.in_flight == 0, 10, what="the request settled")
        rec = app.ledger.records[0]
        assert (rec.input_tokens, rec.output_tokens, rec.error) == (3, 9, None)
    # reads of one plain chunk after the first went on as they came, upper-case and zero-padded sizes too (a read
    # that the socket merged with its neighbour under load is parsed instead: a subset, not all three)
    plain = [chunk(ev[5], b"%X" % len(ev[5])), chunk(ev[6], b"00%x" % len(ev[6])), chunk(b"data: [DONE]\n\n")]
    assert passed and all(read in plain for read in passed), passed


@pytest.mark.usefixtures("only_direct")
def test_a_client_that_stops_reading_holds_back_vllm_not_the_gateways_memory_and_still_gets_every_byte() -> None:
    # 2,048 events of 16 KiB (32 MiB): more than the sockets' and the transport's buffers hold together
    events = [token(i, pad=16_000) for i in range(2048)]
    upstream = ScriptedUpstream(events)
    with gateway(upstream) as (port, app), ask(port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        # the client reads nothing: the gateway stops reading from vLLM, whose writes block
        wait_until(lambda: upstream.blocked_since is not None, 20, what="the upstream's writes blocking")
        assert upstream.written < sum(map(len, events)) * 0.75
        _, body = read_stream(sock)
        assert body == b"".join(events) + b"data: [DONE]\n\n"
        assert upstream.finished.is_set()
        wait_until(lambda: app.ledger.records, 10, what="the request recorded")
        assert app.ledger.records[0].error is None


@pytest.mark.usefixtures("only_direct")
@pytest.mark.parametrize("events", [2048, 256], ids=["cut-mid-stream", "cut-at-its-last-chunk"])
def test_a_client_that_takes_nothing_for_the_upstream_timeout_is_cut_off_and_vllms_request_ended(events: int) -> None:
    """32 MiB: the gateway stops reading from vLLM mid-stream; 4 MiB: the sockets' buffers take all of it, vLLM's
    answer ends, and what waits is the last chunk (it waited for good: a review found it)."""
    upstream = ScriptedUpstream([token(i, pad=16_000) for i in range(events)])
    with gateway(upstream, upstream_timeout_s=1.0) as (port, app), ask(port) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        wait_until(lambda: app.ledger.records and app.admission.in_flight == 0, 20, every=0.05,
                   what="the stalled client's slot freed")
        rec = app.ledger.records[0]
        assert rec.error is not None and rec.error.startswith("the client took nothing for 1 s"), rec.error
        if not upstream.finished.is_set():
            assert upstream.closed_by_peer.wait(10), "vLLM's request went on after its client was cut off"
        # the client's connection is closed: what it reads now ends, short of the last chunk
        sock.settimeout(10)
        got = b""
        while chunk := sock.recv(1 << 20):
            got += chunk
        assert not got.endswith(b"0\r\n\r\n")


@pytest.mark.usefixtures("only_direct")
def test_a_client_that_hangs_up_mid_stream_ends_vllms_request_and_frees_the_slot() -> None:
    upstream = ScriptedUpstream([token(i) for i in range(10_000)], pace_s=0.005)
    with gateway(upstream) as (port, app):
        with ask(port) as sock:
            got = b""
            while got.count(b"data: {") < 5:
                got += sock.recv(65536)
        assert upstream.closed_by_peer.wait(10), "vLLM's request went on after the client hung up"
        wait_until(lambda: app.ledger.records and app.admission.in_flight == 0, 10, what="the slot freed")
        rec = app.ledger.records[0]
        assert rec.error == "the client disconnected" and rec.output_tokens is not None and rec.output_tokens >= 5


@pytest.mark.usefixtures("only_direct")
@pytest.mark.parametrize("pipelined", [False, True], ids=["one-request", "a-second-request-pipelined-behind-it"])
def test_a_client_that_hangs_up_while_vllm_sends_nothing_is_seen_at_once(pipelined: bool) -> None:
    """vLLM in a long prefill, or stalled: no event comes to notice the client's hang-up by. Its connection's loss
    ends vLLM's request and frees the slot at once, not at vLLM's next token (30 s later here). A request pipelined
    behind the stream makes uvicorn stop reading the connection: the hang-up is read all the same."""
    upstream = ScriptedUpstream([token(0), token(1)], pace_s=30.0)
    with gateway(upstream) as (port, app):
        with ask(port, requests=2 if pipelined else 1) as sock:
            got = b""
            while b"data: {" not in got:
                got += sock.recv(65536)
        wait_until(lambda: app.ledger.records and app.admission.in_flight == 0, 5, what="the slot freed")
        assert app.ledger.records[0].error == "the client disconnected"
