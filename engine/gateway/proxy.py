"""The /v1 gateway: one stable address in front of whichever vLLM instances are ready.

Admission decides where a request goes: to the open upstream with the fewest requests outstanding. While none
is open (an apply, a crash), new requests wait in a bounded queue, up to a longest wait, and go to the next one
that opens; past either bound they get 503 with Retry-After. On apply the controller closes an upstream, waits
for its requests in flight (streams included) to finish, and only then stops its vLLM.

The data path is raw ASGI, in front of FastAPI (every token of every stream passes here): the key is checked
before the body is read, the path against the routes it forwards, and each stream event costs one read from
vLLM (engine/gateway/upstream.py, keep-alive) and one ``send``. The first byte from vLLM is the time to first
token; the token counts come from vLLM's final usage chunk, asked for on every stream and hidden from clients
that did not ask; no event is parsed as JSON but that one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import parse_qsl, urlencode

import msgspec
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Message, Receive, Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from engine.bodies import V1Body
from engine.edge import EdgeProtocol
from engine.errors import QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway.admission import Admission, Upstream
from engine.gateway.ledger import Record, RecordSink
from engine.gateway.limits import Grant, KeyLimits, LimitExceededError, LimitsUnavailableError
from engine.gateway.routing import prefix_keys
from engine.gateway.upstream import Client, Connection, Head, UpstreamError, UpstreamTimeoutError

log = logging.getLogger("llmops.gateway")

HOP_HEADERS = frozenset({
    b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
    b"proxy-authorization", b"proxy-authenticate", b"accept-encoding", b"content-encoding", b"expect",
    b"authorization", b"x-api-key",  # the gateway's own API key or token: vLLM has no business with it
})
_SECRET_PARAMS = frozenset({"api_key", "api-key", "apikey", "key", "token", "access_token", "password", "secret"})
USAGE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})  # usage asked for (stream_options) when streamed
# what vLLM answers with its usage, counted against keys' and teams' token limits: the OpenAI completions, the
# Responses API and Anthropic's Messages (their streams carry it always), embeddings, scores and reranks (inputs)
INPUT_ONLY_PATHS = frozenset({"/v1/embeddings", "/v1/score", "/v1/rerank"})
METERED_PATHS = USAGE_PATHS | {"/v1/responses", "/v1/messages"} | INPUT_ONLY_PATHS
GENERATING_PATHS = METERED_PATHS - INPUT_ONLY_PATHS  # (a request of these is reserved its completion tokens)
# the events of a named-event stream that carry tokens (the others: its start, its parts, its end), as they begin
TOKEN_EVENTS = {"/v1/messages": b"event: content_block_delta\n", "/v1/responses": b".delta\ndata: {"}
DOWN_S = 2.0  # an upstream that refused a connection gets no new request for this long while another can take it
_USAGE = b'"usage":{'


class GenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    prompt: str = Field(min_length=1, max_length=1_000_000)
    temperature: float = Field(0.7, ge=0, le=2)
    max_tokens: int = Field(512, ge=1, le=1_000_000)


@dataclass(frozen=True)
class Claim:
    """What a request asks of its key's limits: its key (None: none sent), its peer's address (its flow without a
    key), the tokens it may use (``prompt`` of them its prompt's, estimated) and whether they count (completions
    and chat)."""

    key_id: int | None
    client: str
    prompt: int
    tokens: int
    metered: bool


def used_tokens(rec: Record, prompt: int) -> int:
    """The tokens a request used, as its limits settle them: vLLM's usage; none when vLLM never had it or refused
    it (4xx); its estimated prompt where vLLM's count of it never came (a stream cut, a timeout)."""
    if rec.instance is None:
        return 0
    if rec.input_tokens is None and rec.output_tokens is None:
        return 0 if 400 <= rec.status < 500 else prompt
    return (rec.input_tokens if rec.input_tokens is not None else prompt) + (rec.output_tokens or 0)


@dataclass
class Exchange:
    """One request through the gateway: what it asked, and what the ledger will record."""

    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    stream: bool = False
    hide_usage: bool = False
    record: Record = field(default_factory=lambda: Record(ts=0, revision_id=None, model="", endpoint="", stream=False,
                                                          status=0, latency_s=0.0, client=""))
    on_sent: Callable[[], None] | None = None  # told once vLLM has the body (the data path's budget)
    admission: Admission | None = None  # of the deployment the request's model names (None: no such deployment)
    prompt: bytes | memoryview | None = None  # its prompt or messages as JSON (routing by prefix reads it)
    claim: Claim | None = None  # what it asks of its key's limits
    stream_interval: int = 1  # tokens an event it asked vLLM for (its stream_interval; 1: none)
    grant: Grant | None = None  # what its limits reserved for it (settled when it ends)

    def sent(self) -> None:
        """vLLM has read the body and answered: let it go (no retry will need it)."""
        self.body = b""
        if self.on_sent is not None:
            self.on_sent()
            self.on_sent = None


@dataclass(frozen=True)
class Refused:
    """An answer the gateway gives itself, vLLM not reached."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


def _error(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


def model_not_found(model: str) -> bytes:
    """OpenAI's answer for a model it does not serve (its clients look at ``code``)."""
    return json.dumps({"error": {"message": f"The model `{model[:200]}` does not exist. GET /v1/models lists the "
                                 "models this gateway serves.", "type": "invalid_request_error", "param": "model",
                                 "code": "model_not_found"}}).encode()


async def send_simple(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
                      ) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def forward_query(query: bytes) -> str:
    """The query string vLLM gets: without parameters that carry secrets (keys sent in the URL)."""
    if not query:
        return ""
    pairs = parse_qsl(query.decode("latin-1"), keep_blank_values=True)
    return urlencode([(k, v) for k, v in pairs if k.lower() not in _SECRET_PARAMS])


def with_usage(body: bytes, fields: V1Body) -> bytes | None:
    """The request asking vLLM for a final usage chunk, or None if it already does or cannot be asked."""
    if not fields.is_object or not fields.stream:
        return None
    if not fields.has_stream_options:
        start = body.index(b"{")  # an object with at least one key: prepend ours, no re-encoding
        return body[:start + 1] + b'"stream_options":{"include_usage":true},' + body[start + 1:]
    options = fields.stream_options
    if isinstance(options, dict) and not options.get("include_usage"):
        merged = {**options, "include_usage": True}
        if fields.data is not None:
            return json.dumps({**fields.data, "stream_options": merged}).encode()
        return _splice(body, fields.stream_options_raw, json.dumps(merged).encode())
    return None


_COLON = re.compile(rb"\s*:\s*")


def _splice(body: bytes, raw: bytes, value: bytes) -> bytes | None:
    """``body`` with the value of its stream_options (``raw``, as sent) replaced by ``value``, without parsing
    the body: when the key appears exactly once, as sent (a quote inside a JSON string is always escaped, so
    these bytes are a key or a whole string). None when it cannot be placed so: the stream is not metered."""
    key = b'"stream_options"'
    if not raw or body.count(key) != 1:
        return None
    colon = _COLON.match(body, body.index(key) + len(key))
    if colon is None or colon.end() == colon.start() or body[colon.end():colon.end() + len(raw)] != raw:
        return None
    at = colon.end()
    return body[:at] + value + body[at + len(raw):]


class _Usage(msgspec.Struct):
    usage: Any = None


_USAGE_OF = msgspec.json.Decoder(_Usage)


def usage_of(content: bytes) -> tuple[int | None, int | None]:
    """(prompt_tokens, completion_tokens) of a non-streamed answer (only its usage is built)."""
    try:
        usage = _USAGE_OF.decode(content).usage
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None, None
    return tokens_of(usage)


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def tokens_of(usage: object) -> tuple[int | None, int | None]:
    """(input, output) tokens of a usage object in any of the shapes vLLM answers with: OpenAI's completions
    (prompt_tokens, completion_tokens), the Responses API (input_tokens, output_tokens), Anthropic's Messages
    (input_tokens less what came from the prefix cache: cache_read_input_tokens and cache_creation_input_tokens
    are added back)."""
    if not isinstance(usage, dict):
        return None, None
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    inputs = _count(usage.get("input_tokens"))
    if inputs is not None:
        inputs += sum(_count(usage.get(k)) or 0 for k in ("cache_read_input_tokens", "cache_creation_input_tokens"))
    return inputs, _count(usage.get("output_tokens"))


ERROR_BODY_LIMIT = 64 * 1024  # an upstream error answer past this is replaced by a short one (it may echo input)
ERROR_MESSAGE_KEEP = 1000  # characters of vLLM's own message kept in that short answer
_MESSAGE = re.compile(rb'"message"\s*:\s*"((?:[^"\\]|\\.){0,%d})' % ERROR_MESSAGE_KEEP, re.S)
_WHOLE_ESCAPES = re.compile(rb'(?:[^"\\]|\\u[0-9a-fA-F]{4}|\\["\\/bfnrt])*')  # no escape cut in two
_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
          413: "request_too_large", 422: "invalid_request_error", 429: "rate_limit"}


def short_error(status: int, start: bytes, size: int | None) -> bytes:
    """An OpenAI-style error in place of vLLM's over-long one: the start of vLLM's message, and what was cut."""
    message = start[:ERROR_MESSAGE_KEEP].decode("utf-8", "replace")
    if m := _MESSAGE.search(start):
        text = _WHOLE_ESCAPES.match(m[1])[0]  # type: ignore[index]  # matches (maybe nothing) at the start
        with contextlib.suppress(ValueError):  # control characters vLLM would not send: its bytes as they are
            message = json.loads('"' + text.decode("utf-8", "ignore") + '"')
    message = message.encode("utf-8", "replace").decode()  # a surrogate pair cut in two: no lone half
    told = f"{size:,} bytes" if size is not None else f"over {ERROR_BODY_LIMIT:,} bytes"
    note = f" [vLLM's error answer was {told}; cut to the start of its message]"
    return _error(status, message[:ERROR_MESSAGE_KEEP] + "…" + note, _KINDS.get(status, "upstream_error"))


# Streams under uvicorn's HTTP/1.1 cycle relayed from vLLM's socket callback (``_direct``). False: one task
# wake-up and one ASGI send per event, as before 2026-12-06; only `python -m bench relay-ceiling --workers -2` sets
# it, to measure both in one run.
RELAY_FROM_CALLBACK = True


class StreamMeter:
    """What a server-sent-event stream tells as it passes, at near-zero cost per event: the first byte (time to
    first token) and vLLM's final usage chunk, which it leaves out for clients that did not ask for it. Bytes are
    passed on up to the last complete event; a partial one waits for its end (vLLM writes whole events, so this
    is almost never)."""

    __slots__ = ("_tail", "error", "events", "hide_usage", "input_tokens", "marker", "output_tokens", "per_event")

    def __init__(self, hide_usage: bool, per_event: int = 1, marker: bytes = b"data: {") -> None:
        self.hide_usage = hide_usage
        self.per_event = per_event  # tokens an event carries (vLLM's --stream-interval; only the last may have fewer)
        self.marker = marker  # what begins an event that carries tokens (TOKEN_EVENTS: named events' deltas)
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None  # vLLM's count, once its usage came
        self.error: str | None = None
        self.events = 0  # events with tokens relayed: a stream cut before vLLM's usage is metered by them
        self._tail = b""

    def cut_estimate(self, chat: bool, most: int | None = None) -> int | None:
        """Completion tokens of a stream that ended without vLLM's usage chunk (a client that left, vLLM that
        failed), by the events relayed (less the role event of a chat): vLLM sends one per token, or with a
        stream interval of N (its --stream-interval, or the request's own) the first token alone and then N an
        event, the last one maybe fewer (so at most N - 1 over); never more than ``most``, what the request could
        ask for. None when the usage came (it is exact) or nothing was relayed."""
        if self.output_tokens is not None or not self.events:
            return None
        content = max(0, self.events - (1 if chat else 0))
        if self.per_event == 1:
            return content  # (exact)
        estimate = 1 + (content - 1) * self.per_event if content else 0
        return estimate if most is None else max(content, min(estimate, most))

    def feed(self, chunk: bytes) -> bytes:
        if self._tail:
            chunk = self._tail + chunk
            self._tail = b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n") + 2
            if cut == 1:  # no event complete yet
                self._tail = chunk
                return b""
            chunk, self._tail = chunk[:cut], chunk[cut:]
        self.events += chunk.count(self.marker)  # (not [DONE]; C speed: nothing parsed)
        if _USAGE in chunk:
            return self._usage(chunk)
        return chunk

    def passes(self, framed: bytes) -> bool:
        """Whether one whole chunk of vLLM's (its framing included) may go to the client as it came: whole events,
        no usage in them, nothing held back before it. Counted if so."""
        if self._tail or _USAGE in framed or not framed.endswith(b"\n\n\r\n"):
            return False
        self.events += framed.count(self.marker)
        return True

    def rest(self) -> bytes:
        rest, self._tail = self._tail, b""
        return rest

    def _usage(self, chunk: bytes) -> bytes:
        kept = []
        for event in chunk.split(b"\n\n")[:-1]:
            # "data: {...}", or "event: NAME\ndata: {...}" (the Responses API's and Anthropic's Messages' streams)
            at = 0 if event.startswith(b"data: ") else event.find(b"\ndata: ") + 1 if event.startswith(b"event: ") \
                else -1
            if _USAGE in event and at >= 0 and event.startswith(b"data: ", at):
                try:
                    data = json.loads(event[at + 6:])
                except ValueError:
                    kept.append(event)
                    continue
                usage = None
                if isinstance(data, dict):  # at the top (completions, a message_delta), or in the response/message
                    usage = data.get("usage")
                    for outer in ("response", "message"):
                        if usage is None and isinstance(data.get(outer), dict):
                            usage = data[outer].get("usage")
                inputs, outputs = tokens_of(usage)
                if isinstance(usage, dict):
                    self.input_tokens = inputs if inputs is not None else self.input_tokens
                    if data.get("type") != "message_start":  # (its output_tokens is 0: the count is message_delta's)
                        self.output_tokens = outputs if outputs is not None else self.output_tokens
                    if self.hide_usage and not data.get("choices"):
                        continue
            kept.append(event)
        return b"".join(e + b"\n\n" for e in kept)


class Gateway:
    """Forwards each request to the deployment its ``model`` names (``route``: the registry's answer, None for a
    model no deployment serves), through that deployment's admission."""

    def __init__(self, route: Callable[[str | None], Admission | None], upstream_timeout_s: float,
                 ledger: RecordSink | None = None,
                 retry_after_s: int = 5, limits: KeyLimits | None = None) -> None:
        self.route = route
        self.upstream_timeout_s = upstream_timeout_s
        self.retry_after_s = retry_after_s
        self.ledger = ledger
        self.limits = limits  # keys' and teams' limits (None: a worker's, whose engine holds them)
        self.client = Client(upstream_timeout_s)

    async def aclose(self) -> None:
        self.client.close()

    async def resolve(self, model: str | None) -> Admission | None:
        """The admission of the deployment ``model`` names (None: no deployment serves it)."""
        return self.route(model)

    def _refused(self, rec: Record, t0: float, message: str) -> Refused:
        self._done(rec, t0, 503, message)
        return Refused(503, _error(503, message, "service_unavailable"),
                       [(b"retry-after", str(self.retry_after_s).encode())])

    def _done(self, rec: Record, t0: float, status: int, error: str | None) -> None:
        if self.ledger is None:
            return
        rec.status, rec.error, rec.latency_s = status, error, time.monotonic() - t0
        self.ledger.record(rec)

    async def _open_upstream(self, ex: Exchange, t0: float) -> tuple[Upstream, Connection, Head] | Refused:
        """Send the request to an upstream; on a connection that fails before any answer, to the next one."""
        rec = ex.record
        admission = ex.admission
        if admission is None:
            self._done(rec, t0, 404, "model_not_found")
            return Refused(404, model_not_found(rec.model))
        deadline = t0 + admission.queue_timeout_s
        rec.deployment_id = admission.deployment_id
        target = ex.path + (f"?{ex.query}" if ex.query else "")
        keys = prefix_keys(ex.prompt) if ex.prompt is not None and admission.by_prefix else None
        ex.prompt = None  # (a view of the body: let it go with it)
        claim = ex.claim
        flow = None
        try:
            if self.limits is not None and claim is not None:
                ex.grant = await self.limits.claim(claim.key_id, claim.client, claim.prompt, claim.tokens,
                                                   claim.metered)
                flow = (ex.grant.flow, ex.grant.weight)
        except LimitExceededError as exc:
            self._done(rec, t0, 429, f"{exc.scope} {exc.limit}")
            return Refused(429, exc.body(), exc.headers())
        except LimitsUnavailableError as exc:
            return self._refused(rec, t0, str(exc))
        held = flow[0] if flow is not None else None  # the flow a slot is held by, given back with it
        while True:
            try:
                upstream = await admission.acquire(deadline, keys, flow, claim)
            except LimitExceededError as exc:  # (a worker's: its engine's limits refused it)
                self._done(rec, t0, 429, f"{exc.scope} {exc.limit}")
                return Refused(429, exc.body(), exc.headers())
            except QueueFullError as exc:
                return self._refused(rec, t0, f"vLLM is restarting and the queue is full: {exc}")
            except QueueTimeoutError as exc:
                return self._refused(rec, t0, f"vLLM is not ready: {exc}")
            except UpstreamUnavailableError as exc:
                return self._refused(rec, t0, str(exc))
            rec.revision_id, rec.instance = upstream.revision, upstream.instance
            try:
                headers = ex.headers if upstream.auth is None else [*ex.headers, upstream.auth]
                conn, head = await self.client.request(upstream.url, ex.method, target, headers, ex.body)
            except UpstreamTimeoutError:
                self._done(rec, t0, 504, "timeout")
                await admission.release(upstream, used_tokens(rec, claim.prompt if claim else 0), held)
                return Refused(504, _error(504, "vLLM did not answer within upstream_timeout_s", "timeout"))
            except UpstreamError as exc:
                if exc.before_response:  # (before its slot is given back: a worker's engine hears both at once)
                    admission.mark_down(upstream, DOWN_S)
                    await admission.release(upstream, 0, held)
                    rec.revision_id, rec.instance = None, None  # vLLM did not take it
                else:  # an answer vLLM began that cannot be read
                    self._done(rec, t0, 502, str(exc))
                    await admission.release(upstream, used_tokens(rec, claim.prompt if claim else 0), held)
                    return Refused(502, _error(502, f"vLLM's answer could not be read: {exc}", "upstream_error"))
                # The instance died or is being replaced before answering: send it again to the next one, and
                # send it nothing new for a while (its exit may not be seen yet: a lost node takes Ray a moment)
                log.info("upstream %s failed before answering (%s); retrying", upstream.url, exc)
                if time.monotonic() >= deadline:
                    return self._refused(rec, t0, "vLLM failed while serving this request")
                if len(admission.upstreams) < 2:
                    await asyncio.sleep(0.25)
                continue
            except BaseException:  # cancelled (the client left): the slot must not stay taken
                with contextlib.suppress(BaseException):
                    await asyncio.shield(admission.release(upstream, claim.prompt if claim else 0, held))
                raise
            return upstream, conn, head

    async def _read_all(self, conn: Connection) -> bytes:
        parts = []
        while data := await conn.read():
            parts.append(data)
        return b"".join(parts)

    async def _read_answer(self, conn: Connection, head: Head) -> tuple[bytes, bool]:
        """The body of a non-streamed answer, and whether it was replaced: whole when 2xx; an error answer past
        ERROR_BODY_LIMIT is read no further (the connection is closed) and replaced by ``short_error``."""
        if 200 <= head.status < 300:
            return await self._read_all(conn), False
        parts, size = [], 0
        while data := await conn.read():
            parts.append(data)
            size += len(data)
            if size > ERROR_BODY_LIMIT:
                return short_error(head.status, b"".join(parts)[:ERROR_BODY_LIMIT], head.length), True
        return b"".join(parts), False

    async def complete(self, path: str, body: bytes, client: str, model: str | None = None) -> tuple[int, bytes]:
        """A non-streamed request (POST ``path``) to the deployment ``model`` names (None: the default one), for
        the engine's own /v1/generate: (status, body)."""
        t0 = time.monotonic()
        ex = Exchange("POST", path, "", [(b"content-type", b"application/json")], body, admission=self.route(model))
        ex.record = Record(ts=time.time(), revision_id=None, model=model or "", endpoint=path, stream=False,
                           status=0, latency_s=0.0, client=client)
        opened = await self._open_upstream(ex, t0)
        if isinstance(opened, Refused):
            return opened.status, opened.body
        upstream, conn, head = opened
        try:
            content, _ = await self._read_answer(conn, head)
        except UpstreamError as exc:
            self._done(ex.record, t0, 502, str(exc))
            return 502, _error(502, f"vLLM's answer could not be read: {exc}", "upstream_error")
        finally:
            conn.finish()
            _release(upstream, None, None)
        ex.record.input_tokens, ex.record.output_tokens = usage_of(content)
        self._done(ex.record, t0, head.status, None)
        return head.status, content

    def _settle(self, ex: Exchange) -> None:
        """What the request's limits reserved becomes what it used (once, whatever way it ended)."""
        if self.limits is not None and ex.grant is not None:
            self.limits.settle(ex.grant, used_tokens(ex.record, ex.grant.prompt))

    async def serve(self, ex: Exchange, client_receive: Receive, send: Send) -> None:
        """Forward one request and relay its answer, streamed event by event when it is a stream."""
        try:
            await self._serve(ex, client_receive, send)
        finally:
            self._settle(ex)

    async def _serve(self, ex: Exchange, client_receive: Receive, send: Send) -> None:
        t0 = time.monotonic()
        ex.record.ts = time.time()
        opened = await self._open_upstream(ex, t0)
        if isinstance(opened, Refused):
            await send_simple(send, opened.status, opened.body, opened.headers)
            return
        upstream, conn, head = opened
        ex.sent()  # vLLM has read the body (it answered): it is not held any longer
        rec = ex.record
        try:
            headers = [(k, v) for k, v in head.headers if k not in HOP_HEADERS]
            streaming = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
            if not streaming:
                try:
                    content, replaced = await self._read_answer(conn, head)
                    if replaced:
                        headers = [*[(k, v) for k, v in headers if k != b"content-type"],
                                   (b"content-type", b"application/json")]
                except UpstreamError as exc:
                    self._done(rec, t0, 502, str(exc))
                    await send_simple(send, 502, _error(502, f"vLLM's answer could not be read: {exc}",
                                                        "upstream_error"))
                    return
                rec.input_tokens, rec.output_tokens = usage_of(content) if ex.path in METERED_PATHS else (None, None)
                await send({"type": "http.response.start", "status": head.status,
                            "headers": [*headers, (b"content-length", str(len(content)).encode())]})
                await send({"type": "http.response.body", "body": content})
                self._done(rec, t0, head.status, None)
                return
            meter = StreamMeter(ex.hide_usage, max(upstream.tokens_per_event, ex.stream_interval),
                                TOKEN_EVENTS.get(ex.path, b"data: {"))
            await self._relay(conn, head, meter, headers, client_receive, send, rec, t0)
            rec.input_tokens, rec.output_tokens = meter.input_tokens, meter.output_tokens
            if meter.output_tokens is None and ex.path in METERED_PATHS:  # cut, or ended on an error, before vLLM's
                # usage: metered anyway
                estimate = meter.cut_estimate(  # at most what it asked for, when it said (not limits' reservation)
                    chat=ex.path.endswith("/chat/completions"),
                    most=ex.claim.tokens - ex.claim.prompt if ex.claim and rec.max_tokens is not None else None)
                if estimate is not None:
                    rec.output_tokens = estimate
            self._done(rec, t0, head.status, meter.error)
        finally:
            conn.finish()  # read to its end: back to the pool; else closed, and vLLM aborts the request
            _release(upstream, used_tokens(rec, ex.claim.prompt) if ex.claim else None,
                     ex.grant.flow if ex.grant is not None else None)

    async def _relay(self, conn: Connection, head: Head, meter: StreamMeter, headers: list[tuple[bytes, bytes]],
                     client_receive: Receive, send: Send, rec: Record, t0: float) -> None:
        """Pass a stream on as it comes. A client that hangs up ends the upstream request too (its connection is
        closed, and vLLM aborts the request). Under uvicorn's own HTTP/1.1 cycle (the engine's and the workers'
        servers) each read of vLLM's socket is written to the client's from the socket's callback (``_direct``);
        under any other ASGI server, one read and one send per event."""
        await send({"type": "http.response.start", "status": head.status, "headers": headers})
        cycle = getattr(send, "__self__", None)
        direct = RELAY_FROM_CALLBACK and isinstance(cycle, RequestResponseCycle) and bool(cycle.chunked_encoding)
        protocol = getattr(getattr(cycle, "on_response", None), "__self__", None) if direct else None
        # a client that leaves: the edge's protocol says so (uvicorn's own cycle, the engine's and the workers'
        # servers), else a task waits for the ASGI disconnect
        edge = protocol if isinstance(protocol, EdgeProtocol) else None
        gone = None if edge is not None else asyncio.ensure_future(_disconnected(client_receive))
        try:
            try:
                if direct:
                    if not await _direct(conn, cast(RequestResponseCycle, cycle), meter, gone, rec, t0, edge):
                        return
                elif not await _by_events(conn, send, meter, cast(asyncio.Future[None], gone), rec, t0):
                    return
                tail = meter.rest()
            except UpstreamError as exc:  # vLLM died, timed out or garbled its answer mid-stream
                meter.error = f"vLLM failed during the stream: {exc}"
                tail = b"data: " + _error(502, meter.error, "upstream_error") + b"\n\n" + meter.rest()
            if not direct:
                await send({"type": "http.response.body", "body": tail, "more_body": False})
                return
            last = {"type": "http.response.body", "body": tail, "more_body": False}
            flow = cast(RequestResponseCycle, cycle).flow
            if not flow.write_paused:  # (uvicorn writes it at once: nothing to wait for)
                await send(last)
                return
            try:  # the last bytes wait for a client that takes them, as long as the stream's did and no longer
                async with asyncio.timeout(conn.read_timeout_s):
                    await send(last)
            except TimeoutError:
                meter.error = _stalled(conn.read_timeout_s)
                cast(RequestResponseCycle, cycle).transport.abort()
        finally:
            if gone is not None:
                gone.cancel()


async def _by_events(conn: Connection, send: Send, meter: StreamMeter, gone: asyncio.Future[None], rec: Record,
                     t0: float) -> bool:
    """One read, one ASGI send per event; False if the client left."""
    first = True
    while data := await conn.read():
        if first:
            rec.ttft_s = time.monotonic() - t0
            first = False
        out = meter.feed(data)
        if out:
            await send({"type": "http.response.body", "body": out, "more_body": True})
        if gone.done():
            meter.error = "the client disconnected"
            return False
    return True


async def _direct(conn: Connection, cycle: RequestResponseCycle, meter: StreamMeter,
                  gone: asyncio.Future[None] | None, rec: Record, t0: float, edge: EdgeProtocol | None = None) -> bool:
    """The stream written to the client's transport from vLLM's socket callback, in the chunked framing uvicorn
    began with the head (it writes the last chunk): no task wake-up, no ASGI message per event. When the client's
    transport is over its high-water mark, reading from vLLM pauses until it drains; a client that takes nothing for
    upstream_timeout_s is cut off. False if the client left or was cut off."""
    transport, flow = cycle.transport, cycle.flow
    first = True
    # the connection was lost, as the edge's protocol said: uvicorn marks only its newest cycle disconnected, which
    # is not this stream's when another request was pipelined behind it
    lost = False

    def sink(data: bytes) -> bool:
        nonlocal first
        if first:
            rec.ttft_s = time.monotonic() - t0
            first = False
        out = meter.feed(data)
        if out and not (lost or cycle.disconnected):
            transport.write(b"%x\r\n%b\r\n" % (len(out), out))
        return not flow.write_paused

    def whole(framed: bytes) -> bool | None:
        """A read that is one whole chunk of whole events (a token's, nearly always) goes on in vLLM's framing,
        which is the client's too: no parse, no copy, no re-framing."""
        if first or not meter.passes(framed):
            return None  # (the first read sets the time to first token)
        if not (lost or cycle.disconnected):
            transport.write(framed)
        return not flow.write_paused

    def wake(_: asyncio.Future[None]) -> None:
        conn.wake()

    def gone_now() -> None:
        nonlocal lost
        lost = True
        conn.wake()

    def left() -> bool:
        return lost or cycle.disconnected or (gone is not None and gone.done())

    if gone is not None:
        gone.add_done_callback(wake)
    if edge is not None:
        edge.on_lost = gone_now
        flow.resume_reading()  # (a request pipelined behind this one paused reading: a hang-up is read all the same)
    conn.relay_to(sink, whole)
    try:
        while True:
            ended = False if left() else await conn.relay_wait()
            if left():
                meter.error = "the client disconnected"
                return False
            if ended:
                return True
            if conn.relay_full:
                try:
                    async with asyncio.timeout(conn.read_timeout_s):
                        await flow.drain()
                except TimeoutError:  # a client that takes nothing holds a slot and a sequence of vLLM's: ended
                    meter.error = _stalled(conn.read_timeout_s)
                    transport.abort()  # (close() would wait to send what it holds, to a client that reads nothing)
                    return False
                conn.relay_resume()
    finally:
        conn.relay_to(None)
        if gone is not None:  # the connection goes back to the pool: another request's from now on
            gone.remove_done_callback(wake)
        if edge is not None:
            edge.on_lost = None


def _stalled(timeout_s: float) -> str:
    return f"the client took nothing for {timeout_s:g} s (upstream_timeout_s): its stream was ended"


def _release(upstream: Upstream, used: int | None, flow: str | None) -> None:
    """A request's slot given back as it ends, whatever way it ends (nothing to wait for, so nothing a cancelled
    request could leave half done; it was a task a request, shielded)."""
    if upstream.admission is not None:
        upstream.admission.release_nowait(upstream, flow, used)


async def _disconnected(receive: Receive) -> None:
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            return
