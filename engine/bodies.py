"""Request bodies as every HTTP entry of the engine reads them (the API's body guard and the gateway's data
path): within a size limit and a time limit, and, when JSON, checked before anything parses it for real —
UTF-8, no NaN or Infinity or numbers that overflow to them, no unpaired surrogate escapes (no text can hold
them, so storing one fails), nesting at most a depth. Each refusal names its reason; none echoes the body.

/v1 bodies are also held within a total (``BodyBudget``, ``v1_body_budget_bytes``) and a share of it per client
(``v1_body_share_bytes``): a request holds its bytes as they arrive, not as declared (four connections that declared
32 MiB and sent a byte each held the whole budget for a minute); a declared length that does not fit now is refused
with 503 and Retry-After before a byte is read, as is a body that grows past either bound; the first byte of a body
must come within ``body_first_byte_s``. The gateway does not build a large /v1
body into Python objects (``inspect_v1``): vLLM parses it; the gateway checks it as JSON and reads the top-level
fields it needs (a 31 MiB array of token ids built as a list cost 7 times its bytes and seconds of the loop)."""

from __future__ import annotations

import asyncio
import codecs
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.types import Message, Receive

from engine.errors import EngineError

_UNPAIRED = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                       rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed on a thread: the loop carries every stream


class BodyError(EngineError, ValueError):
    """Why a body is refused: (status, message, and headers for the answer)."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []


class BodyBudget:
    """Bytes of request bodies held at once, all requests together, and by each owner (a gateway key, else the
    peer's address) at most ``share`` of them (one event loop: no lock). Bytes are held as they arrive, never as
    declared: a client that declares 32 MiB and sends one byte holds one byte."""

    def __init__(self, limit: int, share: int | None = None, retry_after_s: int = 2) -> None:
        self.limit = limit
        self.share = min(share or limit, limit)
        self.retry_after_s = retry_after_s
        self.held = 0
        self.by_owner: dict[str, int] = {}

    def hold(self, owner: str = "") -> BodyHold:
        return BodyHold(self, owner)

    def fits(self, size: int, owner: str = "") -> bool:
        """Whether ``size`` more bytes would fit now, in all and in the owner's share."""
        return self.held + size <= self.limit and self.by_owner.get(owner, 0) + size <= self.share

    def _refusal(self, size: int, owner_held: int) -> BodyError:
        if self.held + size > self.limit:
            why = (f"the engine holds {self.held:,} bytes of request bodies; {size:,} more would pass its budget "
                   f"of {self.limit:,} (v1_body_budget_bytes)")
        else:
            why = (f"this client (its key, else its address) holds {owner_held:,} bytes of request bodies; "
                   f"{size:,} more would pass its share of {self.share:,} (v1_body_share_bytes)")
        return BodyError(503, f"{why}: retry shortly", [(b"retry-after", str(self.retry_after_s).encode())])


class BodyHold:
    """One request's part of the budget: grown as its body arrives, given back once (``release``)."""

    __slots__ = ("budget", "owner", "size")

    def __init__(self, budget: BodyBudget, owner: str = "") -> None:
        self.budget = budget
        self.owner = owner
        self.size = 0

    def check_declared(self, size: int) -> None:
        """A declared length that could not fit now: BodyError(503) before a byte is read. Nothing is held for
        it: the bytes are held as they arrive (``grow_to``)."""
        budget = self.budget
        if not budget.fits(size - self.size, self.owner):
            raise budget._refusal(size - self.size, budget.by_owner.get(self.owner, 0))

    def grow_to(self, size: int) -> None:
        """Hold ``size`` bytes in all, or BodyError(503) when they do not fit beside the other requests' (or the
        owner's other requests')."""
        budget = self.budget
        more = size - self.size
        if more <= 0:
            return
        owned = budget.by_owner.get(self.owner, 0)
        if budget.held + more > budget.limit or owned + more > budget.share:
            raise budget._refusal(more, owned)
        budget.held += more
        budget.by_owner[self.owner] = owned + more
        self.size = size

    def release(self) -> None:
        if not self.size:
            return
        budget = self.budget
        budget.held -= self.size
        left = budget.by_owner.get(self.owner, 0) - self.size
        if left > 0:
            budget.by_owner[self.owner] = left
        else:
            budget.by_owner.pop(self.owner, None)
        self.size = 0


def _no_constant(name: str) -> Any:
    raise BodyError(400, f"the JSON body holds {name}, which is not a number JSON allows")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BodyError(400, f"the JSON body holds the number {text[:40]}, too large for a float")
    return value


def _too_deep(value: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


def parse_json(body: bytes, max_depth: int) -> Any:
    """The body as JSON, or BodyError(400) saying what is wrong with it."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyError(400, f"the body is not UTF-8 (byte {exc.start})") from None
    if b"\\u" in body and (m := _UNPAIRED.search(body)):
        raise BodyError(400, f"the JSON body holds an unpaired surrogate escape ({m[0].decode()}) at byte "
                        f"{m.start()}, which no text can hold")
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise BodyError(400, f"the JSON body is nested deeper than {max_depth} levels") from None
    except BodyError:
        raise
    except ValueError as exc:  # JSONDecodeError, and ints past Python's digit limit
        raise BodyError(400, f"the body is not valid JSON: {str(exc)[:200]}") from None
    if isinstance(value, dict | list) and _too_deep(value, max_depth):
        raise BodyError(400, f"the JSON body is nested deeper than {max_depth} levels")
    return value


async def read_body(receive: Receive, limit: int, timeout_s: float, hold: BodyHold | None = None,
                    first_byte_s: float | None = None) -> tuple[bytes, Message | None]:
    """The whole body, within ``limit`` bytes (413), ``timeout_s`` (408), its first byte within ``first_byte_s``
    (408) and, with ``hold``, the budget (503);
    and a disconnect seen while reading. A body of several messages is gathered in one growing buffer, each
    message let go as soon as it is copied (kept in a list until joined, 31 MiB of them had the allocator keep
    twice the body)."""
    first: bytes | None = None
    buf = bytearray()
    started = time.monotonic()
    deadline = started + timeout_s
    first_by = started + min(first_byte_s or timeout_s, timeout_s)
    while True:
        waiting_first = not (first or buf)
        try:
            async with asyncio.timeout(max(0.0, (first_by if waiting_first else deadline) - time.monotonic())):
                message = await receive()
        except TimeoutError:
            if waiting_first and first_by < deadline:
                raise BodyError(408, f"the body's first byte did not arrive within {first_by - started:g} s "
                                "(body_first_byte_s)") from None
            raise BodyError(408, f"the body did not arrive within {timeout_s:g} s (body_timeout_s)") from None
        if message["type"] == "http.disconnect":
            return (first or b"") if not buf else bytes(buf), message
        chunk: bytes = message.get("body", b"")
        size = len(buf) + len(first or b"") + len(chunk)
        if size > limit:
            raise BodyError(413, f"the body is over {limit:,} bytes, the most this route takes (body_limit_*)")
        if hold is not None:
            hold.grow_to(size)
        more = message.get("more_body", False)
        del message
        if first is None and not buf:
            if not more:
                return chunk, None  # the whole body in one message: most bodies, no copy
            first = chunk
            continue
        if first is not None:
            buf += first
            first = None
        buf += chunk
        del chunk
        if not more:
            return bytes(buf), None


async def parse_json_async(body: bytes, max_depth: int) -> Any:
    """parse_json, on a thread for a large body (the event loop carries every stream)."""
    if len(body) > OFF_LOOP_BYTES:
        return await asyncio.to_thread(parse_json, body, max_depth)
    return parse_json(body, max_depth)


def replay(body: bytes, tail: Message | None, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the disconnect (or whatever comes next)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            if tail is not None and not body:
                return tail
            return {"type": "http.request", "body": body, "more_body": False}
        if tail is not None:
            return tail
        return await receive()

    return again


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


# --- /v1 bodies: checked, not built -----------------------------------------------------------------------------

LEAN_BYTES = 1 << 20  # /v1 bodies past this are checked by msgspec and never built into Python objects
_SMALL_FIELD = 64 * 1024  # a top-level field the gateway reads is decoded only up to this size
_CONSTANTS = (b"NaN", b"Infinity", b"-Infinity")


class _Fields(msgspec.Struct):
    """The top-level fields of a /v1 body the gateway reads, as the raw JSON they are (the rest is skipped)."""

    model: msgspec.Raw = msgspec.Raw()
    stream: msgspec.Raw = msgspec.Raw()
    stream_options: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    max_tokens: msgspec.Raw = msgspec.Raw()
    max_completion_tokens: msgspec.Raw = msgspec.Raw()
    max_output_tokens: msgspec.Raw = msgspec.Raw()
    background: msgspec.Raw = msgspec.Raw()
    n: msgspec.Raw = msgspec.Raw()
    best_of: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()
    stream_interval: msgspec.Raw = msgspec.Raw()


_FIELDS = msgspec.json.Decoder(_Fields)
_ANY_JSON = msgspec.json.Decoder(msgspec.Raw)
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])


@dataclass
class V1Body:
    """What the gateway reads of a /v1 JSON body. ``data``: the whole body as Python objects, for a small one
    (None past LEAN_BYTES: only its top-level fields were read)."""

    is_object: bool
    model: str | None = None
    stream: bool = False
    has_stream_options: bool = False
    stream_options: Any = None  # the value, when small enough to read
    stream_options_raw: bytes = b""  # its JSON as sent (past LEAN_BYTES; up to _SMALL_FIELD)
    prompt: Any = None  # the prompt or messages: the value, or its raw JSON past LEAN_BYTES
    asked_by: dict[str, int] = field(default_factory=dict)  # each of MAX_TOKENS_FIELDS it sent, when sane
    background: Any = None  # the Responses API's background, as sent
    data: Any = None
    n: Any = None  # choices asked for per prompt (as sent: checked by ``RequestBounds``)
    best_of: Any = None
    prompts: int = 1  # prompts in the request: a completion's list of prompts, an embedding's list of inputs
    stream_interval_sent: Any = None  # its stream_interval as sent (None: none, or null)

    @property
    def max_tokens(self) -> int | None:
        """The largest of the completion tokens it names (a route's own reading: max_tokens_for)."""
        return max(self.asked_by.values(), default=None)

    def max_tokens_for(self, path: str) -> int | None:
        """The most completion tokens it asks for as vLLM's route at ``path`` reads them: chat takes
        max_completion_tokens unless it is null, else max_tokens; completions and Anthropic's Messages max_tokens;
        the Responses API max_output_tokens; another route, the largest named."""
        by = self.asked_by
        if path == "/v1/chat/completions":
            return by.get("max_completion_tokens", by.get("max_tokens"))
        if path in ("/v1/completions", "/v1/messages"):
            return by.get("max_tokens")
        if path == "/v1/responses":
            return by.get("max_output_tokens")
        return None if path else self.max_tokens  # (another route generates nothing: embeddings, scores…)

    @property
    def stream_interval(self) -> int | None:
        """Tokens an event it asked vLLM for (vLLM takes the larger of it and its own --stream-interval)."""
        return asked_stream_interval(self.stream_interval_sent)

    def prompt_bytes(self, limit: int) -> bytes | memoryview | None:
        """The prompt or messages as JSON, at most its first ``limit`` bytes (what routing by prefix reads): as
        sent past LEAN_BYTES, else encoded again (at C speed; the same value, the same bytes)."""
        if self.prompt is None:
            return None
        if isinstance(self.prompt, msgspec.Raw):
            return memoryview(self.prompt)[:limit]
        try:
            return msgspec.json.encode(self.prompt)[:limit]
        except (TypeError, ValueError, OverflowError):  # an integer past 64 bits: vLLM will refuse it anyway
            return None

    def prompt_text(self) -> str | None:
        """The prompt or messages as JSON, cut at 4,000 characters (for sampled requests only: it costs)."""
        if isinstance(self.prompt, msgspec.Raw):
            return bytes(memoryview(self.prompt)[:4000]).decode("utf-8", "replace")
        return None if self.prompt is None else json.dumps(self.prompt)[:4000]


TRUE_TEXTS = frozenset({"1", "true", "yes", "on", "t", "y"})
FALSE_TEXTS = frozenset({"0", "false", "no", "off", "f", "n"})


def lax_false(value: Any) -> bool:
    """Whether vLLM's pydantic reads ``value`` as a false boolean (or it is absent: null)."""
    if value is None or value is False or (isinstance(value, int | float) and not isinstance(value, bool)
                                           and value == 0):
        return True
    return isinstance(value, str) and value.lower() in FALSE_TEXTS


def streams(value: Any) -> bool:
    """Whether vLLM will stream this request: its request models are pydantic's, whose lax booleans take 1, 1.0
    and "true", "yes", "on", "1"… as true (a ``"stream": 1`` streamed unmetered when only ``true`` counted)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return value == 1
    return isinstance(value, str) and value.strip().lower() in TRUE_TEXTS


def prompt_count(value: Any) -> int:
    """How many prompts a ``prompt`` or ``input`` holds: a list of texts or of token-id lists is one each; a text or
    one list of token ids is one."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        return len(value)
    return 1


def _raw_prompt_count(raw: msgspec.Raw) -> int:
    """prompt_count of a field left as raw JSON (a large body): a list of token ids (one prompt) is never decoded
    (31 MiB of them would be millions of objects, on the event loop's thread); a list of texts or lists is decoded
    as raw items, not built."""
    head = bytes(memoryview(raw)[:64]).lstrip()
    if not head.startswith(b"["):
        return 1
    first = head[1:].lstrip()[:1]
    if first not in (b'"', b"["):
        return 1
    return len(_RAW_LIST.decode(raw))


def _lax_int(value: Any) -> int | None:
    """An integer as pydantic's lax mode takes one (an int, an integral float, a numeric string: "8", " 8 ",
    "1_000", "60000.0"), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and len(value) <= 64:
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+(?:_\d+)*", text):
            return int(text)
        if re.fullmatch(r"[+-]?\d+(?:_\d+)*\.0*", text):  # (a whole number written as a float)
            return int(text.split(".")[0])
    return None


@dataclass(frozen=True)
class RequestBounds:
    """What one /v1 request may ask vLLM for (v1_max_n, v1_max_prompts, v1_max_asked_tokens): ``n`` of 16,384 or a
    list of thousands of prompts held every other client of the deployment for minutes (issue 31)."""

    max_n: int = 16
    max_prompts: int = 2048
    max_asked_tokens: int = 65_536

    def check(self, body: V1Body, path: str = "") -> None:
        """BodyError(400) naming the field and the setting, when the request (to vLLM's route ``path``) asks for
        more than one may, or for what the gateway could not meter."""
        if path == "/v1/responses" and not lax_false(body.background):
            raise BodyError(400, "background responses are not served through the gateway: their tokens could not "
                            "be counted against the key's limits (send the request without background)")
        choices = 1
        for name, raw in (("n", body.n), ("best_of", body.best_of)):
            value = _lax_int(raw)  # as vLLM's pydantic reads it: 1024.0 and "1024" are 1024
            if value is None or value < 1:
                continue  # vLLM refuses what is not a positive integer, saying so
            if value > self.max_n:
                raise BodyError(400, f"{name} is {value:,}; one request may ask for at most {self.max_n} choices "
                                "(v1_max_n): send several requests")
            choices = max(choices, value)
        if body.stream_interval_sent is not None and body.stream_interval is None and \
                path in ("", "/v1/chat/completions", "/v1/completions"):  # (the routes that take it)
            # the gateway meters a stream cut before its usage by it: a value it cannot read would let one pass for
            # fewer tokens than it took (vLLM's pydantic takes "8.0" and 1e16 too)
            raise BodyError(400, f"stream_interval must be a whole number from 1 to {MAX_STREAM_INTERVAL:,} "
                            f"(tokens an event); got {str(body.stream_interval_sent)[:40]!r}")
        if body.prompts > self.max_prompts:
            raise BodyError(400, f"the request holds {body.prompts:,} prompts; one request may hold at most "
                            f"{self.max_prompts:,} (v1_max_prompts): send them in several requests")
        most = body.max_tokens_for(path) if path else body.max_tokens
        if most is not None and (asked := choices * body.prompts * most) > self.max_asked_tokens:
            raise BodyError(400, f"the request asks for up to {asked:,} tokens ({body.prompts:,} prompt(s) × "
                            f"{choices} choice(s) × max_tokens {most:,}); one request may ask for at most "
                            f"{self.max_asked_tokens:,} (v1_max_asked_tokens): lower max_tokens, n or the prompts")


MAX_STREAM_INTERVAL = 1024  # tokens an event a request may ask for (as the --stream-interval a revision may set)


def asked_stream_interval(value: object) -> int | None:
    """The stream_interval a /v1 request asks for, as vLLM's lax pydantic reads it: a whole number from 1 to
    MAX_STREAM_INTERVAL, else None (RequestBounds refuses such a request before vLLM sees it)."""
    interval = _lax_int(value)
    return interval if interval is not None and 1 <= interval <= MAX_STREAM_INTERVAL else None


MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")


def asked_by(data: object) -> dict[str, int]:
    """Each of MAX_TOKENS_FIELDS a /v1 request body sends as a sane integer (as vLLM's lax pydantic reads it)."""
    if not isinstance(data, dict):
        return {}
    values = ((k, _lax_int(data.get(k))) for k in MAX_TOKENS_FIELDS)
    return {k: v for k, v in values if v is not None and 0 < v < 2**31}


def asked_max_tokens(data: object) -> int | None:
    """The max_tokens (or max_completion_tokens, or the Responses API's max_output_tokens) a /v1 request body asks
    for, when it is a sane integer (as vLLM's lax pydantic reads it: 64.0 and "64" are 64). With several, the
    largest: vLLM's chat takes max_completion_tokens unless it is null, its completions only max_tokens, so a small
    one beside a large one must not pass for what the request may use (v1_max_asked_tokens, the limits'
    reservation)."""
    return max(asked_by(data).values(), default=None)


def _small(raw: msgspec.Raw) -> Any:
    return json.loads(bytes(raw)) if 0 < len(raw) <= _SMALL_FIELD else None


def _check_utf8(body: bytes) -> None:
    if body.isascii():
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(body)
    step = 1 << 20
    for start in range(0, len(body), step):
        try:
            decoder.decode(view[start:start + step], final=start + step >= len(body))
        except UnicodeDecodeError as exc:
            raise BodyError(400, f"the body is not UTF-8 (near byte {start + exc.start})") from None


def _lean_error(body: bytes, exc: msgspec.DecodeError) -> BodyError:
    """msgspec's refusal in parse_json's words where it has them."""
    text = str(exc)
    if (m := re.search(r"\(byte (\d+)\)", text)) and (at := int(m[1])) < len(body):
        for name in _CONSTANTS:
            if body.startswith(name, at) or (name == b"Infinity" and body.startswith(name, at + 1)):
                return BodyError(400, f"the JSON body holds {name.decode()}, which is not a number JSON allows")
    if "surrogate" in text and b"\\u" in body and (u := _UNPAIRED.search(body)):
        return BodyError(400, f"the JSON body holds an unpaired surrogate escape ({u[0].decode()}) at byte "
                         f"{u.start()}, which no text can hold")
    return BodyError(400, f"the body is not valid JSON: {text[:200]}")


def _lean(body: bytes) -> V1Body:
    _check_utf8(body)
    try:
        fields = _FIELDS.decode(body)
    except RecursionError:
        raise BodyError(400, "the JSON body is nested too deeply") from None
    except msgspec.ValidationError:  # valid JSON, maybe, but not an object: vLLM will say what it wants
        try:
            _ANY_JSON.decode(body)
        except RecursionError:
            raise BodyError(400, "the JSON body is nested too deeply") from None
        except msgspec.DecodeError as exc:
            raise _lean_error(body, exc) from None
        return V1Body(is_object=False)
    except msgspec.DecodeError as exc:
        raise _lean_error(body, exc) from None
    model = _small(fields.model)
    options = fields.stream_options
    prompt = fields.messages if len(fields.messages) else fields.prompt
    asked = {k: _small(v) for k, v in (("max_tokens", fields.max_tokens),
                                        ("max_completion_tokens", fields.max_completion_tokens),
                                        ("max_output_tokens", fields.max_output_tokens)) if len(v)}
    listed = fields.prompt if len(fields.prompt) else fields.input
    return V1Body(is_object=True, model=model if isinstance(model, str) else None, asked_by=asked_by(asked),
                  background=_small(fields.background) if len(fields.background) else None,
                  stream=streams(_small(fields.stream)), has_stream_options=len(options) > 0,
                  stream_options=_small(options), stream_options_raw=bytes(options) if len(options) <= _SMALL_FIELD
                  else b"", prompt=prompt if len(prompt) else None, n=_small(fields.n) if len(fields.n) else None,
                  best_of=_small(fields.best_of) if len(fields.best_of) else None,
                  prompts=_raw_prompt_count(listed) if len(listed) else 1,
                  stream_interval_sent=(_small(fields.stream_interval) if len(fields.stream_interval) <= _SMALL_FIELD
                                        else "(a value too long to read)") if len(fields.stream_interval) else None)


def _full(body: bytes, max_depth: int) -> V1Body:
    data = parse_json(body, max_depth)
    if not isinstance(data, dict):
        return V1Body(is_object=False, data=data)
    model = data.get("model")
    return V1Body(is_object=True, model=model if isinstance(model, str) else None, stream=streams(data.get("stream")),
                  has_stream_options="stream_options" in data, stream_options=data.get("stream_options"),
                  prompt=data.get("messages", data.get("prompt")), data=data, asked_by=asked_by(data),
                  background=data.get("background"),
                  n=data.get("n"), best_of=data.get("best_of"),
                  prompts=prompt_count(data["prompt"] if "prompt" in data else data.get("input")),
                  stream_interval_sent=data.get("stream_interval"))


async def inspect_v1(body: bytes, max_depth: int) -> V1Body:
    """A /v1 JSON body checked (BodyError 400 saying why not) and its top-level fields read. Up to LEAN_BYTES as
    parse_json checks every body; past it, without building it: UTF-8, JSON's syntax (NaN and Infinity are not
    JSON), surrogate pairs and nesting up to msgspec's own limit (about 1,000 levels) are checked at C speed;
    numbers past a float and nesting past ``max_depth`` are left to vLLM, which parses the body for real and
    refuses what it cannot take."""
    if len(body) <= LEAN_BYTES:
        return _full(body, max_depth)
    return await asyncio.to_thread(_lean, body)
