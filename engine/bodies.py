"""Request bodies as every HTTP entry of the engine reads them (the API's body guard and the gateway's data
path): within a size limit and a time limit, and, when JSON, checked before anything parses it for real —
UTF-8, no NaN or Infinity or numbers that overflow to them, no unpaired surrogate escapes (no text can hold
them, so storing one fails), nesting at most a depth. Each refusal names its reason; none echoes the body."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from typing import Any

from starlette.types import Message, Receive

from engine.errors import EngineError

_UNPAIRED = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
                       rb"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")
OFF_LOOP_BYTES = 1 << 20  # bodies larger than this are parsed on a thread: the loop carries every stream


class BodyError(EngineError, ValueError):
    """Why a body is refused: (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


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


async def read_body(receive: Receive, limit: int, timeout_s: float) -> tuple[bytes, Message | None]:
    """The whole body, within ``limit`` bytes (413) and ``timeout_s`` (408); and a disconnect seen while reading."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                message = await receive()
        except TimeoutError:
            raise BodyError(408, f"the body did not arrive within {timeout_s:g} s (body_timeout_s)") from None
        if message["type"] == "http.disconnect":
            return b"".join(chunks), message
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyError(413, f"the body is over {limit:,} bytes, the most this route takes (body_limit_*)")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), None


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
