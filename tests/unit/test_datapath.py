"""The /v1 data path as raw ASGI: routes, keys before bodies, body limits, and faults of an upstream.

The faults (an answer garbled mid-stream, a client that hangs up) come from a scripted upstream, named as such:
real vLLM cannot garble its chunked encoding on demand. What real vLLM does through the path (usage, streams,
TTFT) is tested against it in tests/system/test_engine.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, MutableMapping
from functools import partial
from typing import Any

import pytest
from aiohttp import web

from engine.access import GatewayKeys, RateLimiter
from engine.bodies import BodyBudget, BodyError, RequestBounds, V1Body, inspect_v1
from engine.gateway import Admission, BodyLimits, DataPath, Gateway, StreamMeter, check_path, forward_query, with_usage
from engine.gateway.proxy import usage_of
from tests.testkit.wait import eventually


class FakeAuth:
    """Stands in for Auth: one key, 'good'."""

    changes = 0

    def authenticate(self, token: str) -> Any:
        from engine.access import Principal

        known = {"good": Principal("k", "prompter", "gateway", 1, None),
                 "good2": Principal("k2", "prompter", "gateway", 2, None)}
        return known.get(token)


async def drive(app: DataPath, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                raw_path: bytes | None = None, chunks: list[bytes] | None = None, hang_up_after: int | None = None
                ) -> tuple[int, dict[str, str], bytes, int]:
    """One request through the ASGI app; (status, headers, body, body messages received by the app)."""
    pending = list(chunks) if chunks is not None else [body]
    reads = 0
    sent: list[dict[str, Any]] = []
    body_messages = 0
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        nonlocal reads
        if pending:
            reads += 1
            chunk = pending.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal body_messages
        sent.append(dict(message))
        if message["type"] == "http.response.body":
            body_messages += 1
            if hang_up_after is not None and body_messages >= hang_up_after:
                gone.set()

    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if body and "content-length" not in (headers or {}):
        hdrs.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "method": method, "path": path, "raw_path": raw_path or path.encode(),
             "query_string": b"", "headers": hdrs, "client": ("127.0.0.1", 1)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, out, reads


async def with_upstream(handler: Any) -> AsyncIterator[str]:
    app = web.Application(client_max_size=64 << 20)
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def make_path(admission: Admission, required: bool = False, max_bytes: int = 1 << 20) -> DataPath:
    keys = GatewayKeys(FakeAuth(), RateLimiter(), required)  # type: ignore[arg-type]
    return DataPath(Gateway(lambda _: admission, 5.0), keys, BodyLimits(max_bytes, 2.0, 64))


def test_paths_are_forwarded_only_as_vllm_routes() -> None:
    assert check_path("POST", "/v1/chat/completions", b"/v1/chat/completions") == "/v1/chat/completions"
    assert check_path("GET", "/v1/models/", b"/v1/models/") == "/v1/models"
    assert check_path("GET", "/v1/responses/resp_1", None) == "/v1/responses/resp_1"
    assert check_path("POST", "/tokenize", None) == "/tokenize"
    for path in ("/v1/../metrics", "/v1/./models", "/v1//models", "/v1/responses/../../docs"):
        refused = check_path("GET", path, path.encode())
        assert not isinstance(refused, str) and refused.status == 400, path
    for raw in (b"/v1/%2e%2e/metrics", b"/v1/models%2f..%2fx", b"/v1/models\\x"):
        refused = check_path("GET", "/v1/x", raw)
        assert not isinstance(refused, str) and refused.status == 400, raw
    for path in ("/v1/load_lora_adapter", "/v1/metrics", "/v1/openapi.json", "/v1/responses/a/b"):
        refused = check_path("POST", path, path.encode())
        assert not isinstance(refused, str) and refused.status == 404, path
    wrong = check_path("GET", "/v1/chat/completions", None)
    assert not isinstance(wrong, str) and (wrong.status, wrong.allow) == (405, "POST")


def test_secrets_in_the_query_string_do_not_reach_vllm() -> None:
    assert forward_query(b"api_key=llmops_x&stream=true&token=t") == "stream=true"
    assert forward_query(b"") == ""


def fields(body: bytes) -> V1Body:
    return asyncio.run(inspect_v1(body, 64))


def test_usage_is_asked_for_by_prepending_bytes_not_reencoding() -> None:
    body = b'{"model":"m","stream":true,"prompt":"\\u00e9"}'
    asked = with_usage(body, fields(body))
    assert asked == b'{"stream_options":{"include_usage":true},"model":"m","stream":true,"prompt":"\\u00e9"}'
    already = b'{"stream":true,"stream_options":{"include_usage":true}}'
    assert with_usage(already, fields(already)) is None
    assert with_usage(b'{"stream":false}', fields(b'{"stream":false}')) is None


@pytest.mark.parametrize(("value", "expected"), [(True, True), (1, True), (1.0, True), ("true", True),
                                                 ("YES", True), ("on", True), (False, False), (0, False),
                                                 ("false", False), (None, False), ([1], False), (2, False)])
def test_a_stream_is_recognised_as_vllm_reads_the_flag(value: object, expected: bool) -> None:
    """Outside probe: ``"stream": 1`` streamed (vLLM's pydantic reads it as true) but skipped usage metering."""
    body = json.dumps({"model": "m", "stream": value}).encode()
    assert fields(body).stream is expected
    assert (with_usage(body, fields(body)) is not None) is expected  # such a stream is asked for its usage
    big = json.dumps({"model": "m", "stream": value, "prompt": "x" * (2 << 20)}).encode()  # the lean path too
    assert asyncio.run(inspect_v1(big, 64)).stream is expected


@pytest.mark.parametrize(("value", "expected"), [(8, 8), ("8", 8), (8.0, 8), (1, 1), (1024, 1024), (0, None),
                                                (-3, None), (1025, None), ("many", None), (True, None),
                                                (None, None), (2.5, None)])
def test_the_stream_interval_a_request_asks_for_is_read_as_vllm_reads_it(value: object, expected: int | None) -> None:
    """vLLM takes a request's stream_interval (lax: "8" and 8.0 are 8) over its own when larger: the gateway must
    know it to meter a stream cut before its usage, on the small bodies' path and the lean one alike."""
    body = json.dumps({"model": "m", "stream": True, "stream_interval": value}).encode()
    assert fields(body).stream_interval == expected
    big = json.dumps({"model": "m", "stream": True, "stream_interval": value, "prompt": "x" * (2 << 20)}).encode()
    assert asyncio.run(inspect_v1(big, 64)).stream_interval == expected


def test_a_cut_stream_is_estimated_at_the_tokens_its_events_carry() -> None:
    """With a stream interval of 4 (vLLM's --stream-interval, or the request's stream_interval) vLLM sends the first
    token alone, then 4 an event: a stream cut before its usage counts so (a chat's role event none), never more
    than the max_tokens it asked for (nor fewer than the events relayed); with the usage, the usage's count."""
    events = b'data: {"choices":[{"text":"abcd"}]}\n\n' * 3
    for per_event, chat, most, expected in ((1, False, None, 3), (1, False, 2, 3), (4, False, None, 9),
                                            (4, True, None, 5), (4, False, 6, 6), (1000, False, 64, 64),
                                            (4, False, 2, 3)):  # (never under the events relayed)
        meter = StreamMeter(hide_usage=False, per_event=per_event)
        assert meter.feed(events) == events
        assert meter.cut_estimate(chat=chat, most=most) == expected
    meter = StreamMeter(hide_usage=False, per_event=4)
    meter.feed(events + b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":10}}\n\n')
    assert meter.output_tokens == 10 and meter.cut_estimate(chat=False) is None


def test_the_usage_of_the_responses_api_and_of_anthropic_messages_is_read_from_their_named_events() -> None:
    """Their streams name each event ("event: NAME" before its data) and carry the usage inside the response or
    the message, or in message_delta; Anthropic counts the tokens read from the prefix cache apart. Every byte goes
    on to the client (their usage is theirs: nothing is hidden), split across reads as it may be."""
    def relayed(stream: bytes) -> tuple[StreamMeter, bytes]:
        meter = StreamMeter(hide_usage=False)
        out = b"".join(meter.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)) + meter.rest()
        return meter, out

    responses = (b'event: response.created\ndata: {"type":"response.created","response":{"usage":null}}\n\n'
                 b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n'
                 b'event: response.completed\ndata: {"type":"response.completed","response":{"status":"completed",'
                 b'"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":4},"output_tokens":3,'
                 b'"total_tokens":15}}}\n\n')
    meter, out = relayed(responses)
    assert out == responses and (meter.input_tokens, meter.output_tokens) == (12, 3)
    messages = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":6,'
                b'"cache_read_input_tokens":4,"output_tokens":0}}}\n\n'
                b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"a"}}\n\n'
                b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                b'"usage":{"input_tokens":6,"cache_read_input_tokens":4,"cache_creation_input_tokens":1,'
                b'"output_tokens":9}}\n\nevent: message_stop\ndata: {"type":"message_stop"}\n\n')
    meter, out = relayed(messages)
    assert out == messages and (meter.input_tokens, meter.output_tokens) == (11, 9)
    # cut before the final usage: message_start's output_tokens (0) is not the count; the deltas are, and only they
    deltas = b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"text":"a"}}\n\n'
    cut = messages.split(b"event: content_block_delta")[0] + b'event: content_block_start\ndata: {"type":' \
        b'"content_block_start"}\n\n' + deltas * 5
    meter = StreamMeter(hide_usage=False, marker=b"event: content_block_delta\n")
    meter.feed(cut)
    assert (meter.input_tokens, meter.output_tokens, meter.cut_estimate(chat=False)) == (10, None, 5)
    meter = StreamMeter(hide_usage=False, marker=b".delta\ndata: {")
    meter.feed(responses.split(b"event: response.completed")[0] * 1)  # created, one delta: the end cut off
    assert (meter.output_tokens, meter.cut_estimate(chat=False)) == (None, 1)
    assert usage_of(b'{"id":"r","usage":{"input_tokens":5,"output_tokens":2}}') == (5, 2)
    assert usage_of(b'{"usage":{"input_tokens":5,"cache_read_input_tokens":3,"output_tokens":2}}') == (8, 2)
    assert usage_of(b'{"usage":{"prompt_tokens":7,"total_tokens":7}}') == (7, None)  # embeddings
    assert usage_of(b'{"usage":{"prompt_tokens":-1,"completion_tokens":true}}') == (None, None)


def test_the_tokens_a_request_asks_for_are_read_as_each_of_vllm_s_routes_reads_them() -> None:
    """Chat takes max_completion_tokens unless null, else max_tokens; completions and Anthropic's Messages only
    max_tokens; the Responses API only max_output_tokens: a field the route ignores neither lowers what is reserved
    nor raises what is bounded."""
    body = fields(b'{"max_completion_tokens": 10, "max_tokens": 100000, "max_output_tokens": 7}')
    assert [body.max_tokens_for(p) for p in ("/v1/chat/completions", "/v1/completions", "/v1/messages",
                                             "/v1/responses", "/v1/embeddings")] == [10, 100000, 100000, 7, None]
    assert fields(b'{"max_completion_tokens": null, "max_tokens": 9}').max_tokens_for("/v1/chat/completions") == 9
    assert fields(b'{"max_tokens": 1}').max_tokens_for("/v1/responses") is None  # unasked: limits' default
    bounds = RequestBounds(max_asked_tokens=1000)
    bounds.check(body, "/v1/chat/completions")  # 10 asked: vLLM's chat never reads the 100,000
    with pytest.raises(BodyError) as refused:
        bounds.check(body, "/v1/completions")
    assert refused.value.status == 400 and "v1_max_asked_tokens" in str(refused.value)
    for sent in (b'{"input": "x", "background": true}', b'{"input": "x", "background": "yes"}',
                 b'{"input": "x", "background": 1}', b'{"input": "x", "background": "TRUE"}'):
        with pytest.raises(BodyError) as refused:  # generated after the answer, fetched by GET: never metered
            bounds.check(fields(sent), "/v1/responses")
        assert refused.value.status == 400 and "background" in str(refused.value)
    for harmless in (b"false", b"null", b"0", b'"false"', b'"Off"', b'"0"'):  # as vLLM's pydantic reads them
        bounds.check(fields(b'{"input": "x", "background": %b}' % harmless), "/v1/responses")
    bounds.check(fields(b'{"prompt": "x", "stream_interval": "8.0"}'), "/v1/responses")  # (a route that ignores it)


def test_the_usage_chunk_is_read_and_hidden_even_when_split_across_reads() -> None:
    meter = StreamMeter(hide_usage=True)
    events = (b'data: {"choices":[{"text":"a"}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
              b"data: [DONE]\n\n")
    out = b"".join(meter.feed(events[i:i + 7]) for i in range(0, len(events), 7)) + meter.rest()
    assert out == b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n'
    assert (meter.input_tokens, meter.output_tokens) == (3, 1)


def test_the_key_is_checked_before_the_body_is_read() -> None:
    async def go() -> None:
        admission = Admission(4, 1)
        path = make_path(admission, required=True)
        status, _, body, reads = await drive(path, "POST", "/v1/completions",
                                             headers={"content-length": str(50 << 20)}, chunks=[b"x" * 1024] * 3)
        assert status == 401 and reads == 0 and b"API key" in body

    asyncio.run(go())


def test_bodies_past_the_limit_or_not_json_are_refused_with_a_reason() -> None:
    async def go() -> None:
        path = make_path(Admission(4, 1), max_bytes=4096)
        status, _, body, reads = await drive(path, "POST", "/v1/completions", headers={"content-length": "50000"})
        assert status == 413 and reads == 0
        status, _, body, _ = await drive(path, "POST", "/v1/completions", chunks=[b"{" * 1000, b"]" * 4000])
        assert status == 413  # no length declared: cut off as it grows
        for bad, reason in ((b'{"x": NaN}', b"NaN"), (b'{"x": 1e999999}', b"too large"),
                            (b'{"x": "\xff"}', b"not UTF-8"), (b"[" * 100_000, b"nested deeper"),
                            (b'{"x": "\\ud800"}', b"surrogate")):
            status, _, body, _ = await drive(make_path(Admission(4, 1), max_bytes=1 << 20), "POST",
                                             "/v1/completions", bad, {"content-type": "application/json"})
            assert status == 400 and reason in body, bad
            assert json.loads(body)["error"]["code"] == 400

    asyncio.run(go())


def test_a_body_that_trickles_is_timed_out() -> None:
    async def go() -> None:
        admission = Admission(4, 1)
        path = make_path(admission)
        gate = asyncio.Event()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if not sent:
                sent.append({})
                return {"type": "http.request", "body": b'{"a":', "more_body": True}
            await gate.wait()  # never: the rest of the body does not come
            return {"type": "http.disconnect"}

        out: list[dict[str, Any]] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            out.append(dict(message))

        t0 = time.monotonic()
        await path({"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                    "query_string": b"", "headers": [], "client": None}, receive, send)
        assert out[0]["status"] == 408 and time.monotonic() - t0 < 10

    asyncio.run(go())


def test_an_answer_garbled_mid_stream_ends_with_an_error_event_and_frees_the_slot() -> None:
    async def garbled(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"a"}]}\n\n')
        await asyncio.sleep(0.2)  # the first event has gone through
        request.transport.write(b"zz\r\nnot a chunk\r\n")  # type: ignore[union-attr]  # broken chunked framing
        await asyncio.sleep(0.2)
        request.transport.close()  # type: ignore[union-attr]
        return resp

    async def go() -> None:
        async for url in with_upstream(garbled):
            admission = Admission(4, 1)
            await admission.open(url, 1)
            path = make_path(admission)
            status, _, body, _ = await drive(path, "POST", "/v1/completions", b'{"stream": true, "prompt": "x"}',
                                             {"content-type": "application/json"})
            await path.gateway.aclose()
            assert status == 200 and b'"text":"a"' in body and b"upstream_error" in body
            assert admission.in_flight == 0

    asyncio.run(go())


def test_an_answer_garbled_from_its_start_is_a_502_and_frees_the_slot() -> None:
    async def garbled(request: web.Request) -> web.StreamResponse:
        request.transport.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n")  # type: ignore
        await asyncio.sleep(0.2)
        request.transport.close()  # type: ignore[union-attr]
        return web.StreamResponse()

    async def go() -> None:
        async for url in with_upstream(garbled):
            admission = Admission(4, 1)
            await admission.open(url, 1)
            path = make_path(admission)
            status, _, body, _ = await drive(path, "POST", "/v1/completions", b'{"prompt": "x"}',
                                             {"content-type": "application/json"})
            await path.gateway.aclose()
            assert status == 502 and b"could not be read" in body
            assert admission.in_flight == 0

    asyncio.run(go())


@pytest.mark.parametrize(("instance", "asked"), [(1, None), (4, None), (1, 8), (8, 2)])
def test_a_client_that_hangs_up_ends_the_upstream_request_and_frees_the_slot(instance: int, asked: int | None
                                                                             ) -> None:
    """``instance``: its vLLM's --stream-interval; ``asked``: the request's own stream_interval (vLLM takes the
    larger): tokens an event, by which a cut stream is metered (a client could ask for 1,000 an event and leave
    before the usage, metered at one an event)."""
    upstream_saw_close = asyncio.Event()
    per_event = max(instance, asked or 1)
    event = b'data: {"choices":[{"text":"%b"}]}\n\n' % (b"a" * per_event)

    async def endless(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for _ in range(10_000):
                await resp.write(event)
                await asyncio.sleep(0.005)
        except (ConnectionResetError, asyncio.CancelledError):
            upstream_saw_close.set()
            raise
        return resp

    async def go() -> None:
        async for url in with_upstream(endless):
            admission = Admission(4, 1)
            await admission.open(url, 1, tokens_per_event=instance)
            path = make_path(admission)
            recorded: list[Any] = []

            class Ledger:  # the request ledger, as far as the gateway writes to it
                def record(self, rec: Any) -> None:
                    recorded.append(rec)  # noqa: B023 - one request, read within this iteration

                def sample_prompt(self) -> bool:
                    return False

            path.gateway.ledger = Ledger()
            t0 = time.monotonic()
            body = {"stream": True, "prompt": "x", **({"stream_interval": asked} if asked else {})}
            status, _, out, _ = await drive(path, "POST", "/v1/completions", json.dumps(body).encode(),
                                            {"content-type": "application/json"}, hang_up_after=5)
            assert status == 200 and time.monotonic() - t0 < 20  # not the 50 s of the whole stream
            assert admission.in_flight == 0
            # metered though it ended before vLLM's usage chunk (such streams were not, issue 31): by the events
            # relayed: the first token alone, then per_event tokens each
            assert len(recorded) == 1 and recorded[0].error == "the client disconnected"
            relayed = out.count(b"data: {")
            assert relayed >= 5 and recorded[0].output_tokens == 1 + (relayed - 1) * per_event
            await asyncio.wait_for(upstream_saw_close.wait(), 10)
            await path.gateway.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("path", ["/v1/../metrics", "/v1/scale_elastic_ep"])
def test_vllm_routes_beyond_the_api_are_not_reached(path: str) -> None:
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text="vllm's own route")

    async def go() -> None:
        async for url in with_upstream(record):
            admission = Admission(4, 1)
            await admission.open(url, 1)
            dp = make_path(admission)
            status, _, _, _ = await drive(dp, "POST", path, b"{}", {"content-type": "application/json"})
            await dp.gateway.aclose()
            assert status in (400, 404) and hits == []

    asyncio.run(go())


# --- issue 17: errors echoed whole, bodies held without a total, big bodies built ---------------------------------

MiB = 1 << 20


def test_an_upstream_error_past_the_bound_is_cut_to_the_start_of_its_message() -> None:
    """vLLM's 404 for an unknown model echoes the name: a 20 MiB name came back through the gateway whole."""
    name = "m" * (20 * MiB)
    huge = json.dumps({"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError",
                                 "param": "model", "code": 404}}).encode()
    small = json.dumps({"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                  "param": "model", "code": 404}}).encode()

    async def vllm(request: web.Request) -> web.StreamResponse:
        body = huge if (await request.read()).startswith(b'{"model": "m') else small
        if request.query.get("chunked"):
            resp = web.StreamResponse(status=404, headers={"content-type": "application/json"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(body), MiB):
                await resp.write(body[i:i + MiB])
            return resp
        return web.Response(status=404, body=body, content_type="application/json")

    async def go() -> None:
        async for url in with_upstream(vllm):
            admission = Admission(4, 1)
            await admission.open(url, 1)
            path = make_path(admission, max_bytes=32 * MiB)
            for query in (b"", b"chunked=1"):
                request = json.dumps({"model": name, "prompt": "x"}).encode()
                scope_path = "/v1/completions"
                status, headers, out, _ = await drive_query(path, scope_path, request, query)
                assert status == 404 and len(out) < 4096, len(out)
                error = json.loads(out)["error"]
                assert error["message"].startswith("The model `mmmm") and "cut to the start" in error["message"]
                assert error["code"] == 404 and headers["content-type"] == "application/json"
                assert admission.in_flight == 0
            status, _, out, _ = await drive(path, "POST", "/v1/completions", b'{"model": "x"}',
                                            {"content-type": "application/json"})
            assert status == 404 and out == small  # an error of ordinary size passes as vLLM wrote it
            await path.gateway.aclose()

    asyncio.run(go())


async def drive_query(app: DataPath, path: str, body: bytes, query: bytes) -> tuple[int, dict[str, str], bytes, int]:
    sent: list[dict[str, Any]] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": query,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1)}
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, out, 1


def given_back(budget: BodyBudget) -> bool:
    return budget.held == 0


def test_bodies_past_the_total_budget_get_503_before_being_read_and_the_budget_comes_back() -> None:
    """Six concurrent 31 MiB bodies took the engine from 103 to 603 MB: the limit was per request, none in total."""
    answer, finish = asyncio.Event(), asyncio.Event()
    seen: list[int] = []

    async def slow_vllm(request: web.Request) -> web.StreamResponse:
        seen.append(len(await request.read()))
        await answer.wait()  # vLLM has the body, not yet answered: the gateway keeps it (a retry may need it)
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await finish.wait()  # answered: the stream goes on without the body
        await resp.write(b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n')
        return resp

    async def go() -> None:
        async for url in with_upstream(slow_vllm):
            admission = Admission(8, 5)
            await admission.open(url, 1)
            keys = GatewayKeys(FakeAuth(), RateLimiter(), False)  # type: ignore[arg-type]
            gateway = Gateway(lambda _, a=admission: a, 10.0)  # type: ignore[misc]
            path = DataPath(gateway, keys, BodyLimits(MiB, 5.0, 64, budget_bytes=int(1.5 * MiB)))
            body = b'{"stream": true, "prompt": "' + b"a" * (MiB - 100) + b'"}'
            first = asyncio.ensure_future(drive(path, "POST", "/v1/completions", body,
                                                {"content-type": "application/json"}))
            await eventually(lambda: len(seen) == 1, 10, what="vLLM reading the first body")
            assert path.budget.held == len(body)
            status, headers, out, reads = await drive(path, "POST", "/v1/completions", body,
                                                      {"content-type": "application/json"})
            assert status == 503 and reads == 0 and headers["retry-after"].isdigit()
            assert "v1_body_budget_bytes" in json.loads(out)["error"]["message"]
            chunks = [b'{"prompt": "', b"a" * (MiB * 4 // 10), b"a" * (MiB * 4 // 10), b'"}']  # no length declared
            status, _, _, reads = await drive(path, "POST", "/v1/completions", headers={}, chunks=chunks)
            assert status == 503 and reads == 3  # cut off as it grew past the budget
            assert path.budget.held == len(body)  # the refused ones gave theirs back
            answer.set()
            await eventually(partial(given_back, path.budget), 10, what="the budget given back once vLLM answered")
            again = asyncio.ensure_future(drive(path, "POST", "/v1/completions", body,
                                                {"content-type": "application/json"}))
            await eventually(lambda: len(seen) == 2, 10, what="a body taken while the first still streams")
            finish.set()
            assert (await first)[0] == 200 and (await again)[0] == 200
            assert path.budget.held == 0 and admission.in_flight == 0
            await path.gateway.aclose()

    asyncio.run(go())


def test_a_big_body_is_checked_as_json_without_being_built() -> None:
    pad = b"a" * (2 * MiB)
    for bad, reason in ((b'{"x": NaN, "p": "' + pad + b'"}', "NaN"), (b'{"p": "' + pad + b'", "x": -Infinity}',
                                                                       "Infinity"),
                        (b'{"p": "' + pad + b'\xff"}', "not UTF-8"), (b'{"p": "' + pad + b'\\udc00"}', "surrogate"),
                        (b'{"p": "' + pad + b'"} x', "not valid JSON"), (b'{"p": "' + pad + b'", "x": ' + b"[" * 5000
                                                                         + b"]" * 5000 + b"}", "nested"),
                        (b'{"p": "' + pad + b'", "x": [1,]}', "not valid JSON")):
        with pytest.raises(BodyError, match=reason) as refused:
            fields(bad)
        assert refused.value.status == 400 and len(str(refused.value)) < 400
    ids = json.dumps({"model": "demo", "stream": True, "stream_options": {"continuous_usage_stats": False},
                      "prompt": list(range(1000, 1_000_000))}).encode()
    import tracemalloc

    tracemalloc.start()
    read = fields(ids)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < len(ids) // 2, f"{peak:,} bytes allocated to read a {len(ids):,}-byte body"  # built: 7x its size
    assert read.model == "demo" and read.stream and read.data is None
    assert (read.prompt_text() or "").startswith("[1000, 1001")
    asked = with_usage(ids, read)
    assert asked is not None and json.loads(asked)["stream_options"] == {"continuous_usage_stats": False,
                                                                        "include_usage": True}
    assert json.loads(asked)["prompt"] == json.loads(ids)["prompt"]
    assert not fields(b"[" + b"1," * MiB + b"1]").is_object  # valid JSON, not an object: vLLM says what it wants


def test_an_instance_that_refuses_connections_is_passed_over_at_once() -> None:
    """A lost node's vLLM stops answering before its exit is seen (Ray takes a moment to tell): requests go to the
    instance that answers, and the one that refused gets no new request meanwhile."""
    from engine.vllm import free_port

    async def vllm(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1,
                                                                        "completion_tokens": 1}})

    async def go() -> None:
        async for url in with_upstream(vllm):
            admission = Admission(8, 5)
            dead = await admission.open(f"http://127.0.0.1:{free_port()}", 1, instance="b")  # nothing listens
            alive = await admission.open(url, 1, instance="a")
            path = make_path(admission)
            body = b'{"model": "m", "prompt": "x"}'
            statuses = [(await drive(path, "POST", "/v1/completions", body, {"content-type": "application/json"}))[0]
                        for _ in range(20)]
            assert statuses == [200] * 20
            assert alive.finished == 20
            assert dead.finished <= 1  # tried once at most, then passed over
            assert dead.down_until > 0

    asyncio.run(go())


async def trickle(app: DataPath, declared: int, sent: bytes, peer: str, key: str | None = None
                  ) -> tuple[asyncio.Future[tuple[int, bytes]], asyncio.Event]:
    """A request that declares ``declared`` bytes, sends ``sent`` and then nothing until told to hang up."""
    gone = asyncio.Event()
    given = False
    out: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given and sent:
            given = True
            return {"type": "http.request", "body": sent, "more_body": True}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        out.append(dict(message))

    headers = [(b"content-type", b"application/json"), (b"content-length", str(declared).encode())]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": headers, "client": (peer, 1)}

    async def run() -> tuple[int, bytes]:
        await app(scope, receive, send)
        start = next((m for m in out if m["type"] == "http.response.start"), {"status": 0})
        return start["status"], b"".join(m.get("body", b"") for m in out if m["type"] == "http.response.body")

    return asyncio.ensure_future(run()), gone


def test_declared_lengths_hold_nothing_only_bytes_that_arrived_do() -> None:
    """Four connections that declared 32 MiB and sent one byte held the whole 128 MiB budget for a minute: every
    other client got 503 (issue 31). Now each holds the byte it sent, and the others are served."""
    async def go() -> None:
        admission = Admission(4, 1)
        keys = GatewayKeys(FakeAuth(), RateLimiter(), False)  # type: ignore[arg-type]
        path = DataPath(Gateway(lambda _: admission, 5.0), keys,
                        BodyLimits(32 * MiB, 30.0, 64, budget_bytes=128 * MiB, first_byte_s=30.0),
                        BodyBudget(128 * MiB, 32 * MiB))
        held = [await trickle(path, 32 * MiB, b"{", f"10.0.0.{i}") for i in range(4)]
        await eventually(lambda: path.budget.held == 4, 5, what="the four held bytes")
        status, _, out, reads = await drive(path, "POST", "/v1/completions", b'{"model": "m", "prompt": "x"}',
                                            {"content-type": "application/json"})
        assert status == 503 and b"v1_body_budget_bytes" not in out and reads == 1  # past the budget: vLLM down
        for task, gone in held:
            gone.set()
            await task
        assert path.budget.held == 0 and path.budget.by_owner == {}
        await path.gateway.aclose()

    asyncio.run(go())


def test_one_client_holds_no_more_than_its_share_of_the_budget() -> None:
    """A client is its key (whatever address it sends from), else its address: none holds more than its share."""
    async def go() -> None:
        admission = Admission(4, 1)
        keys = GatewayKeys(FakeAuth(), RateLimiter(), True)  # type: ignore[arg-type]
        path = DataPath(Gateway(lambda _: admission, 5.0), keys, BodyLimits(MiB, 30.0, 64, first_byte_s=30.0),
                        BodyBudget(4 * MiB, MiB))
        part = b"{" + b" " * (MiB - 10)
        first, gone = await trickle(path, MiB, part, "10.0.0.1", "good")
        await eventually(lambda: path.budget.held == len(part), 5, what="the first body's bytes held")
        again, again_gone = await trickle(path, MiB, b"{" * 100, "10.0.0.2", "good")  # the same key: past its share
        status, out = await again
        assert status == 503 and b"v1_body_share_bytes" in out, out
        again_gone.set()
        other, other_gone = await trickle(path, MiB, part, "10.0.0.1", "good2")  # another key, the same address
        await eventually(lambda: path.budget.held == 2 * len(part), 5,
                         what="another key's body held beside the first")
        other_gone.set()
        await other
        gone.set()
        await first
        assert path.budget.held == 0 and path.budget.by_owner == {}
        await path.gateway.aclose()

    asyncio.run(go())


def test_a_body_whose_first_byte_does_not_come_is_let_go_at_once() -> None:
    async def go() -> None:
        admission = Admission(4, 1)
        keys = GatewayKeys(FakeAuth(), RateLimiter(), False)  # type: ignore[arg-type]
        path = DataPath(Gateway(lambda _: admission, 5.0), keys, BodyLimits(MiB, 60.0, 64, first_byte_s=0.2))
        t0 = time.monotonic()
        task, gone = await trickle(path, 1000, b"", "10.0.0.1")
        status, out = await asyncio.wait_for(task, 10)
        assert status == 408 and b"body_first_byte_s" in out, out
        assert time.monotonic() - t0 < 30  # not after body_timeout_s (60 s)
        gone.set()
        await path.gateway.aclose()

    asyncio.run(go())


def test_a_budget_gives_back_what_it_held_per_client() -> None:
    budget = BodyBudget(10, 6)
    a, b = budget.hold("a"), budget.hold("b")
    a.grow_to(6)
    with pytest.raises(BodyError, match="v1_body_share_bytes"):
        a.grow_to(7)
    with pytest.raises(BodyError, match="v1_body_budget_bytes"):
        b.grow_to(5)
    b.grow_to(4)
    assert (budget.held, budget.by_owner) == (10, {"a": 6, "b": 4})
    a.release()
    a.release()  # once only
    b.release()
    assert (budget.held, budget.by_owner) == (0, {})


@pytest.mark.parametrize("big", [False, True], ids=["parsed", "lean"])
def test_one_request_cannot_ask_for_more_than_the_bounds(big: bool) -> None:
    """n=1,024 with max_tokens=64 held a 4-token bystander 8 s, growing to the 600 s upstream timeout (issue 31):
    n, best_of, the prompts of one request and the tokens it may ask for are bounded, each refusal naming the field
    and its setting; a body past 1 MiB (read without being built) is bounded the same."""
    pad = {"user": "x" * (2 * MiB)} if big else {}

    def ask(**fields: object) -> tuple[int, dict[str, Any]]:
        body = json.dumps({"model": "m", **fields, **pad}).encode()
        status, _, out, _ = asyncio.run(drive(make_path(Admission(4, 1), max_bytes=8 * MiB), "POST",
                                              "/v1/completions", body, {"content-type": "application/json"}))
        return status, json.loads(out) if out else {}

    refusals: list[tuple[dict[str, Any], str]] = [
        ({"prompt": "x", "n": 1024, "max_tokens": 64}, "v1_max_n"),
        ({"prompt": "x", "best_of": 100}, "v1_max_n"),
        ({"prompt": ["x"] * 3000, "max_tokens": 1}, "v1_max_prompts"),
        ({"input": [[1, 2]] * 3000}, "v1_max_prompts"),
        ({"prompt": "x", "n": 16, "max_tokens": 8192}, "v1_max_asked_tokens"),
        ({"prompt": ["a", "b"] * 100, "max_tokens": 1000}, "v1_max_asked_tokens"),
        # as vLLM's lax pydantic reads them: a float or a numeric string is the integer it names
        ({"prompt": "x", "n": "1024"}, "v1_max_n"), ({"prompt": "x", "n": 1024.0}, "v1_max_n"),
        ({"prompt": "x", "n": 16, "max_tokens": "100000"}, "v1_max_asked_tokens"),
        # vLLM's completions read max_tokens only: a small max_completion_tokens beside it does not pass for it
        ({"prompt": "x", "max_completion_tokens": 1, "max_tokens": 100_000}, "v1_max_asked_tokens"),
        ({"prompt": "x", "max_completion_tokens": None, "max_tokens": 100_000}, "v1_max_asked_tokens"),
        # tokens an event, by which a stream cut before its usage is metered: only what the gateway can read
        ({"prompt": "x", "stream_interval": "8.5"}, "stream_interval"),
        # vLLM's pydantic reads "60000.0" and "1_000" as whole numbers: so does the bound
        ({"prompt": "x", "max_tokens": "60000.0", "n": 2}, "v1_max_asked_tokens"),
        ({"prompt": "x", "n": "1_024"}, "v1_max_n"),
        ({"prompt": "x", "stream_interval": 1e16}, "stream_interval"),
        ({"prompt": "x", "stream_interval": 2000}, "stream_interval"),
        ({"prompt": "x", "stream_interval": 0}, "stream_interval"), ({"prompt": "x", "stream_interval": True},
                                                                     "stream_interval")]
    for fields, named in refusals:
        status, answer = ask(**fields)
        assert status == 400 and named in answer["error"]["message"], (fields.keys(), status, answer)
        assert answer["error"]["type"] == "invalid_request_error"
    allowed: list[dict[str, Any]] = [{"prompt": "x", "n": 4, "max_tokens": 64},
                                     {"prompt": list(range(5000)), "max_tokens": 10},
                                     {"prompt": ["x"] * 64, "max_tokens": 256}, {"prompt": "x", "n": "many"},
                                     {"prompt": "x", "stream_interval": 8}, {"prompt": "x", "stream_interval": None}]
    for fields in allowed:
        status, answer = ask(**fields)
        assert status != 400, (fields.keys(), answer)  # past the bounds, on to vLLM (none here: 503)
