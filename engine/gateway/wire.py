"""What the engine and its gateway workers say to each other (engine/gateway/workers.py): typed messages, msgpack
in frames of a 4-byte length, over a socket pair the engine makes for each worker (no name on the filesystem, no
one else can connect; the worker's end closes when it dies).

A worker relays tokens; the engine decides. Every decision that must be one for all workers is taken by the engine
on the worker's behalf, so that caps, routing and limits hold exactly as with one process: a key's check (and its
rate limit), a model's deployment, a request's limits (its tokens reserved, then settled), a slot on an instance (its
cap, the fair queue, routing by prefix and load), the ledger's record. A request costs a worker two round trips (the
key; a slot) and one message without an answer (its end: the slot freed, its tokens settled, the record)."""

from __future__ import annotations

import asyncio
import struct

import msgspec

from engine.errors import EngineError
from engine.gateway.ledger import Record

MAX_FRAME = 8 << 20  # a message is a few hundred bytes; a record's sampled prompt at most 4,000 characters
_LEN = struct.Struct("!I")


class WireError(EngineError):
    """The other end sent what is not a message, or went away."""


class LinkClosedError(WireError):
    """The other end went away (closed, or died: its socket reset)."""


class WorkerSpec(msgspec.Struct, frozen=True):
    """What a worker is told at start (its argument: no secret in it)."""

    index: int
    engine_port: int
    hosts: list[str]  # the Host names it answers (engine.edge.HostCheck's names; "*": any)
    head_bytes: int
    line_bytes: int
    head_timeout_s: float
    body_max_bytes: int
    body_timeout_s: float
    json_max_depth: int
    body_budget_bytes: int  # this worker's share of v1_body_budget_bytes
    body_share_bytes: int | None
    body_first_byte_s: float | None
    max_n: int
    max_prompts: int
    max_asked_tokens: int
    upstream_timeout_s: float
    ledger_sample_rate: float
    keys_required: bool
    graceful_s: float
    trusted_proxies: list[str] = []  # whose X-Forwarded-For is believed (the engine's trusted_proxies)
    limit_bytes_per_token: float = 1.0
    limit_unasked_max_tokens: int = 1024
    steered: bool = False  # it takes no connection until the engine says so (gateway_worker_busy_share > 0)



# --- a worker asks ---------------------------------------------------------------------------------------------


class Check(msgspec.Struct, tag="check", frozen=True):
    """The key of a request (its bearer token; None: it sent none), before a byte of its body is read."""

    id: int
    token: str | None


class Resolve(msgspec.Struct, tag="resolve", frozen=True):
    """Which deployment serves ``model`` (None: the default one)."""

    id: int
    model: str | None


class Acquire(msgspec.Struct, tag="acquire", frozen=True):
    """A slot on an instance of ``model``'s deployment for a request whose prompt has prefix ``keys``; waits as a
    request in the engine would (the queue, up to ``wait_s``)."""

    id: int
    model: str | None
    deployment: str | None  # the deployment the worker resolved it to (and checked the key against)
    keys: list[int] | None
    wait_s: float
    # what it asks of its key's limits (engine.gateway.proxy.Claim): checked, reserved and queued by the engine
    key_id: int | None = None
    client: str = ""
    prompt: int = 0
    tokens: int = 0
    metered: bool = False


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """The request of Acquire ``id`` is gone (its client left while it waited): give up its wait, or its slot."""

    id: int


class Done(msgspec.Struct, tag="done", frozen=True):
    """The request of slot ``permit`` ended (``down``: its instance refused the connection); no answer."""

    permit: int
    down: bool = False
    used: int | None = None  # the tokens it used, which its limits settle (None: unknown, its reservation stands)


class Ledger(msgspec.Struct, tag="ledger", frozen=True):
    """A request for the ledger; no answer."""

    record: Record


class Models(msgspec.Struct, tag="models", frozen=True):
    id: int


class Busy(msgspec.Struct, tag="busy", frozen=True):
    """How busy the worker was since it last said (its process's share of a core), every BUSY_EVERY_S; no answer
    (engine/gateway/steering.py decides from it which workers take new connections)."""

    cpu: float
    accepting: bool = True  # it takes new connections now (what it does, not what it was told)
    shedding: float = 0.0  # the share of its responses after which it lets their connection go now


Ask = Check | Resolve | Acquire | Cancel | Done | Ledger | Models | Busy


# --- the engine answers ----------------------------------------------------------------------------------------


class Principal(msgspec.Struct, frozen=True):
    """Who a key is, as far as the data path needs: its token (the body budget's share) and its deployments."""

    name: str
    role: str
    kind: str
    token_id: int | None
    deployments: list[str] | None


class Checked(msgspec.Struct, tag="checked", frozen=True):
    id: int
    principal: Principal | None  # None: keys are not required


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """The request is answered ``status`` with ``message`` (and ``headers``) by the worker, vLLM not reached.
    ``kind``: key (401/429/503 of a key), limit (429 of a key's or team's limit), unavailable, queue_full,
    queue_timeout, not_found."""

    id: int
    kind: str
    status: int
    message: str
    headers: list[tuple[bytes, bytes]] = []
    body: bytes = b""  # the answer's body, when the engine wrote it (a limit's 429)


class Route(msgspec.Struct, tag="route", frozen=True):
    """A model's deployment (``deployment`` None: no deployment serves it)."""

    id: int
    deployment: str | None
    deployment_id: int | None = None
    queue_timeout_s: float = 0.0
    by_prefix: bool = False


class Granted(msgspec.Struct, tag="granted", frozen=True):
    """A slot: send the request to ``url`` (with ``auth`` as a header, if any) and say Done with ``permit``."""

    id: int
    permit: int
    url: str
    revision: int | None
    instance: str
    deployment_id: int | None
    auth: tuple[bytes, bytes] | None
    open: int  # instances of the deployment open now (a refused connection is retried only where another is)
    tokens_per_event: int = 1  # the instance's --stream-interval (a stream cut before its usage is metered by it)


class ModelList(msgspec.Struct, tag="model_list", frozen=True):
    """GET /v1/models: each model's deployment and its entry in the list, as JSON."""

    id: int
    models: list[tuple[str, bytes]]


class Steer(msgspec.Struct, tag="steer", frozen=True):
    """Unasked: whether the worker takes new connections on the data port (``accept``) and the share of its
    responses after which it lets their connection go (``shed``: those clients reconnect, to a worker with room)."""

    accept: bool
    shed: float
    id: int = 0  # (answers no question)


Answer = Checked | Refused | Route | Granted | ModelList | Steer

_encoder = msgspec.msgpack.Encoder()
_ask = msgspec.msgpack.Decoder(Ask)
_answer = msgspec.msgpack.Decoder(Answer)


def frame(message: Ask | Answer) -> bytes:
    body = _encoder.encode(message)
    return _LEN.pack(len(body)) + body


class Outbox:
    """The messages to one end, written once per turn of the event loop: all those of a turn in one write. Each
    message was a write of its own, and a request through a worker costs three of them (a slot asked, its end, its
    record) and the engine one; under load many requests' messages fall in the same turn."""

    __slots__ = ("_frames", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: list[bytes] = []

    def put(self, message: Ask | Answer) -> None:
        if not self._frames:
            asyncio.get_running_loop().call_soon(self.flush)
        self._frames.append(frame(message))

    def flush(self) -> None:
        """Write what was put (nothing when the other end is gone: as a write to it would)."""
        if not self._frames:
            return
        frames, self._frames = self._frames, []
        if not self.writer.is_closing():
            self.writer.write(frames[0] if len(frames) == 1 else b"".join(frames))


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    try:
        head = await reader.readexactly(4)
        (size,) = _LEN.unpack(head)
        if size > MAX_FRAME:
            raise WireError(f"a message of {size:,} bytes (at most {MAX_FRAME:,})")
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise LinkClosedError("the other end closed the connection") from exc
    except OSError as exc:  # (reset: it died, or closed, with our messages unread in its buffer)
        raise LinkClosedError(f"the other end's connection broke ({exc.strerror or exc})") from exc


async def read_ask(reader: asyncio.StreamReader) -> Ask:
    try:
        return _ask.decode(await _read_frame(reader))
    except msgspec.DecodeError as exc:
        raise WireError(f"not a message from a worker: {exc}") from exc


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    try:
        return _answer.decode(await _read_frame(reader))
    except msgspec.DecodeError as exc:
        raise WireError(f"not a message from the engine: {exc}") from exc
