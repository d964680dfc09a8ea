"""The /v1 gateway: one stable address in front of whichever vLLM child is ready.

Admission decides where a request goes. While vLLM is ready, requests pass straight to it. While it restarts
(apply, crash), new requests wait in a bounded queue, up to a longest wait, and go to the new child once it is
ready; past either bound they get 503 with Retry-After. On apply the supervisor closes admission, waits for the
requests in flight (streams included) to finish, and only then stops the old child.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send

from engine.errors import QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway.ledger import Ledger, Record
from engine.gateway.usage import USAGE_PATHS, RequestInfo, StreamMeter, usage_of

log = logging.getLogger("llmops.gateway")

_HOP_HEADERS = {
    "host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "proxy-authorization", "proxy-authenticate", "accept-encoding", "content-encoding",
    "authorization",  # the gateway's own API key or token: vLLM has no business with it
}
# Errors that mean the request never produced an answer from vLLM: safe to send again to the next child.
_RETRYABLE = (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


@dataclass(frozen=True)
class Upstream:
    url: str
    revision: int | None


class Admission:
    """Who may send to vLLM now: a gate with a bounded waiting room and a count of requests in flight."""

    def __init__(self, queue_size: int, queue_timeout_s: float) -> None:
        self.queue_size = queue_size
        self.queue_timeout_s = queue_timeout_s
        self._upstream: Upstream | None = None
        self._cond = asyncio.Condition()
        self.in_flight = 0
        self.waiting = 0
        self.rejected = 0
        self.refusal: str | None = None  # set while vLLM is down on purpose: refuse at once, do not queue

    @property
    def upstream(self) -> str | None:
        return self._upstream.url if self._upstream else None

    @property
    def revision(self) -> int | None:
        return self._upstream.revision if self._upstream else None

    async def acquire(self, deadline: float) -> Upstream:
        """Wait (until ``deadline``, monotonic) for an open gate; count the caller in flight; return the URL."""
        async with self._cond:
            if self._upstream is None and self.refusal is not None:
                self.rejected += 1
                raise UpstreamUnavailableError(self.refusal)
            if self._upstream is None:
                if self.waiting >= self.queue_size:
                    self.rejected += 1
                    raise QueueFullError(f"{self.waiting} requests already wait for vLLM (queue_size)")
                self.waiting += 1
                try:
                    await asyncio.wait_for(
                        self._cond.wait_for(lambda: self._upstream is not None or self.refusal is not None),
                        max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    self.rejected += 1
                    raise QueueTimeoutError("vLLM did not become ready within queue_timeout_s") from None
                finally:
                    self.waiting -= 1
                if self._upstream is None:
                    self.rejected += 1
                    raise UpstreamUnavailableError(self.refusal or "vLLM is down")
            self.in_flight += 1
            assert self._upstream is not None
            return self._upstream

    async def release(self) -> None:
        async with self._cond:
            self.in_flight -= 1
            self._cond.notify_all()

    async def open(self, url: str, revision: int | None = None) -> None:
        async with self._cond:
            self._upstream = Upstream(url, revision)
            self.refusal = None
            self._cond.notify_all()

    async def close(self) -> None:
        """Stop admitting: new requests wait (bounded) for the next open."""
        async with self._cond:
            self._upstream = None

    async def refuse(self, refusal: str | None) -> None:
        """While closed, refuse new requests at once with ``refusal`` instead of queueing them (None: queue)."""
        async with self._cond:
            self.refusal = refusal
            if refusal is not None:
                self._cond.notify_all()

    async def drain(self, timeout: float) -> int:
        """Wait until no request is in flight, or ``timeout``; return how many were still in flight."""
        async with self._cond:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._cond.wait_for(lambda: self.in_flight == 0), timeout)
            return self.in_flight


class GenerateRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # a JSON 0 is not false, nor "1" a number

    prompt: str = Field(min_length=1, max_length=1_000_000)
    temperature: float = Field(0.7, ge=0, le=2)
    max_tokens: int = Field(512, ge=1, le=1_000_000)


def _unavailable(message: str, retry_after: int) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "service_unavailable", "code": 503}},
        status_code=503,
        headers={"Retry-After": str(retry_after)},
    )


class Gateway:
    def __init__(self, admission: Admission, upstream_timeout_s: float, ledger: Ledger | None = None,
                 retry_after_s: int = 5) -> None:
        self.admission = admission
        self.retry_after_s = retry_after_s
        self.ledger = ledger
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=upstream_timeout_s, write=60.0, pool=None),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def forward(self, method: str, path: str, params: dict[str, str], headers: dict[str, str],
                      body: bytes, *, client: str = "") -> Response:
        t0, ts = time.monotonic(), time.time()
        info = RequestInfo.parse(body)
        ask_usage = info.body_with_usage() if path in USAGE_PATHS else None
        send = ask_usage or body
        deadline = t0 + self.admission.queue_timeout_s
        fwd_headers = {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}
        rec = Record(ts=ts, revision_id=None, model=info.model, endpoint=path, stream=info.stream, status=0,
                     latency_s=0.0, client=client,
                     prompt=info.prompt_text() if self.ledger is not None and self.ledger.sample_prompt() else None)
        while True:
            try:
                upstream = await self.admission.acquire(deadline)
            except QueueFullError as exc:
                return self._refuse(rec, t0, f"vLLM is restarting and the queue is full: {exc}")
            except QueueTimeoutError as exc:
                return self._refuse(rec, t0, f"vLLM is not ready: {exc}")
            except UpstreamUnavailableError as exc:
                return self._refuse(rec, t0, str(exc))
            rec.revision_id = upstream.revision
            request = self.client.build_request(method, upstream.url + path, params=params, headers=fwd_headers,
                                                content=send)
            try:
                upstream_resp = await self.client.send(request, stream=True)
                if not info.stream:
                    content = await upstream_resp.aread()
                    await upstream_resp.aclose()
            except _RETRYABLE as exc:
                # The child died or is being replaced before answering: send it again to the next one.
                await self.admission.release()
                log.info("upstream %s failed before answering (%s); retrying", upstream.url, type(exc).__name__)
                if time.monotonic() >= deadline:
                    return self._refuse(rec, t0, "vLLM failed while serving this request")
                await asyncio.sleep(0.25)
                continue
            except httpx.TimeoutException:
                await self.admission.release()
                self._done(rec, t0, 504, "timeout")
                return JSONResponse({"error": {"message": "vLLM did not answer within upstream_timeout_s",
                                               "type": "timeout", "code": 504}}, status_code=504)
            except httpx.HTTPError as exc:  # an answer vLLM began but that cannot be read
                await self.admission.release()
                self._done(rec, t0, 502, type(exc).__name__)
                return JSONResponse({"error": {"message": f"vLLM's answer could not be read ({type(exc).__name__})",
                                               "type": "upstream_error", "code": 502}}, status_code=502)
            except BaseException:  # cancelled (the client left): the slot must not stay taken
                with anyio.CancelScope(shield=True):
                    await self.admission.release()
                raise
            resp_headers = {k: v for k, v in upstream_resp.headers.items() if k.lower() not in _HOP_HEADERS}
            if not info.stream:
                await self.admission.release()
                rec.input_tokens, rec.output_tokens = usage_of(content)
                self._done(rec, t0, upstream_resp.status_code, None)
                return _Buffered(content, upstream_resp.status_code, resp_headers)
            meter = StreamMeter(t0, hide_usage=ask_usage is not None)
            return _TrackedStream(self._relay(upstream_resp, meter),
                                  functools.partial(self._finish_stream, upstream_resp, meter, rec, t0),
                                  status_code=upstream_resp.status_code, headers=resp_headers)

    async def _relay(self, upstream_resp: httpx.Response, meter: StreamMeter) -> AsyncIterator[bytes]:
        """Pass a stream through event by event (the response, _TrackedStream, ends the request)."""
        try:
            async for chunk in upstream_resp.aiter_raw():
                out = meter.feed(chunk)
                if out:
                    yield out
            if rest := meter.rest():
                yield rest
        except httpx.HTTPError as exc:  # vLLM died or timed out mid-stream: tell the client, count an error
            meter.error = f"vLLM failed during the stream ({type(exc).__name__})"
            event = {"error": {"message": meter.error, "type": "upstream_error", "code": 502}}
            yield f"data: {json.dumps(event)}\n\n".encode()

    async def _finish_stream(self, upstream_resp: httpx.Response, meter: StreamMeter, rec: Record,
                             t0: float) -> None:
        await upstream_resp.aclose()
        await self.admission.release()
        rec.ttft_s = meter.ttft_s
        rec.input_tokens = meter.input_tokens
        rec.output_tokens = meter.output_tokens if meter.output_tokens is not None else meter.content_events
        self._done(rec, t0, upstream_resp.status_code, meter.error)

    def _refuse(self, rec: Record, t0: float, message: str) -> JSONResponse:
        self._done(rec, t0, 503, message)
        return _unavailable(message, self.retry_after_s)

    def _done(self, rec: Record, t0: float, status: int, error: str | None) -> None:
        if self.ledger is None:
            return
        rec.status, rec.error, rec.latency_s = status, error, time.monotonic() - t0
        self.ledger.record(rec)


class _TrackedStream(StreamingResponse):
    """A stream that ends its request exactly once, shielded, however it ends: finished, broken, or the client
    gone (even before the body began, when Starlette never starts the body iterator). The body iterator itself
    must not do it: a client's departure cancels it, and cleanup awaited in a cancelled scope can be lost."""

    def __init__(self, body: AsyncIterator[bytes], finish: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(body, **kwargs)
        self._finish = finish

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish()


class _Buffered(Response):
    def __init__(self, content: bytes, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(content=content, status_code=status_code, headers=headers)
