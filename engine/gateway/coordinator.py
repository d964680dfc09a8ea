"""The engine's side of its gateway workers: it answers each worker's questions (engine/gateway/wire.py) with the
engine's own keys, deployments, admissions and ledger, so that what must be one for every worker is one — each
instance's cap and requests in flight, routing's index and counts, a key's rate limit, the ledger. A worker that
dies (its socket closes) gives back every slot it held and every wait it had: its requests are gone with it, and
the other workers' are not touched."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.access import GatewayKeys, KeyRefusedError
from engine.errors import QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway import wire
from engine.gateway.admission import Admission, Upstream
from engine.gateway.ledger import RecordSink
from engine.gateway.limits import Grant, KeyLimits, LimitExceededError, LimitsUnavailableError
from engine.gateway.proxy import DOWN_S

log = logging.getLogger("llmops.gateway")


@dataclass
class WorkerTally:
    """What one worker's connection asked of the engine since it was made."""

    requests: int = 0  # slots granted
    refused: int = 0  # keys refused, models not found, queues full or timed out
    held: int = 0  # slots it holds now
    waits: int = 0  # requests of it waiting for a slot now
    cpu: float | None = None  # its share of a core lately, as it said (wire.Busy)
    said: wire.Steer | None = None  # what it was last told about taking connections
    accepting: bool | None = None  # whether it takes new connections, as it last said (None: not said yet)
    shedding: float = 0.0  # the share of its responses it lets go, as it last said
    tell: Callable[[wire.Answer], None] | None = None  # a message to it, while its link is up


@dataclass
class _Conn:
    writer: asyncio.StreamWriter
    tally: WorkerTally
    permits: dict[int, Upstream] = field(default_factory=dict)
    grants: dict[int, Grant] = field(default_factory=dict)  # what each permit's limits reserved
    waits: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    out: wire.Outbox = field(init=False)

    def __post_init__(self) -> None:
        self.out = wire.Outbox(self.writer)

    def send(self, message: wire.Answer) -> None:
        self.out.put(message)


class Coordinator:
    """Answers the workers. ``route``: a model's admission (the fleet's); ``keys``: the engine's gateway keys;
    ``models``: GET /v1/models's entries, each with its ``deployment``."""

    def __init__(self, route: Callable[[str | None], Admission | None], keys: GatewayKeys, ledger: RecordSink | None,
                 models: Callable[[], list[dict[str, Any]]], limits: KeyLimits | None = None) -> None:
        self.route = route
        self.keys = keys
        self.limits = limits
        self.ledger = ledger
        self.models = models
        self._permits = itertools.count(1)
        self.on_busy: Callable[[], None] | None = None  # a worker said how busy it is, or its link came or went

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tally: WorkerTally) -> None:
        """Answer one worker until its socket closes; then give back what it held."""
        conn = _Conn(writer, tally)
        tally.tell, tally.said, tally.cpu, tally.accepting, tally.shedding = conn.send, None, None, None, 0.0
        self._busy()
        try:
            while True:
                try:
                    ask = await wire.read_ask(reader)
                except wire.WireError as exc:
                    if not isinstance(exc, wire.LinkClosedError) and not reader.at_eof():
                        log.warning("a gateway worker sent what the engine cannot read (%s): disconnected", exc)
                    return
                try:
                    self._take(conn, ask)
                except Exception as exc:  # a store or registry that failed: this request is refused, the link lives
                    log.exception("the engine could not answer a gateway worker's %s", type(ask).__name__)
                    _refuse(conn, ask, exc)
        finally:
            for task in conn.waits.values():
                task.cancel()
            for task in list(conn.waits.values()):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            for permit, upstream in conn.permits.items():  # a dead worker's requests: their slots are free again
                grant = conn.grants.get(permit)
                await _release(upstream, grant.flow if grant is not None else None)
            conn.permits.clear()
            for grant in conn.grants.values():  # and what they used is not known: their reservations stand
                self._settle(grant, None)
            conn.grants.clear()
            tally.held = 0
            tally.waits = 0
            tally.tell = None
            writer.close()

    def _take(self, conn: _Conn, ask: wire.Ask) -> None:
        match ask:
            case wire.Acquire():
                self._wait(conn, ask, self._acquire(conn, ask))
            case wire.Done():
                upstream = conn.permits.pop(ask.permit, None)
                grant = conn.grants.pop(ask.permit, None)
                self._settle(grant, ask.used)
                conn.tally.held = len(conn.permits)
                if upstream is not None and upstream.admission is not None:
                    if ask.down:
                        upstream.admission.mark_down(upstream, DOWN_S)
                    upstream.admission.release_nowait(upstream, grant.flow if grant is not None else None)
            case wire.Cancel():
                task = conn.waits.get(ask.id)
                if task is not None:
                    task.cancel()
            case wire.Check():
                self._wait(conn, ask, self._check(conn, ask))
            case wire.Resolve():
                admission = self.route(ask.model)
                conn.send(wire.Route(ask.id, None) if admission is None else wire.Route(
                    ask.id, admission.deployment, admission.deployment_id, admission.queue_timeout_s,
                    admission.by_prefix))
            case wire.Ledger():
                if self.ledger is not None:
                    self.ledger.record(ask.record)
            case wire.Busy():
                conn.tally.cpu = ask.cpu if math.isfinite(ask.cpu) else 0.0
                conn.tally.accepting = ask.accepting
                conn.tally.shedding = ask.shedding if math.isfinite(ask.shedding) else 0.0
                self._busy()
            case wire.Models():
                entries = [(str(m.get("deployment") or ""), json.dumps(
                    {k: v for k, v in m.items() if k != "deployment"}).encode()) for m in self.models()]
                conn.send(wire.ModelList(ask.id, entries))

    def _busy(self) -> None:
        if self.on_busy is not None:
            self.on_busy()

    def _wait(self, conn: _Conn, ask: wire.Check | wire.Acquire, work: Any) -> None:
        async def answered() -> None:
            try:
                await work
            except Exception as exc:  # whatever failed, the worker hears of it: no request waits for ever
                log.exception("the engine could not answer a gateway worker's %s", type(ask).__name__)
                _refuse(conn, ask, exc)

        ask_id = ask.id
        task: asyncio.Task[None] = asyncio.ensure_future(answered())
        conn.waits[ask_id] = task
        conn.tally.waits = len(conn.waits)

        def gone(_: asyncio.Task[None]) -> None:
            if conn.waits.get(ask_id) is task:
                del conn.waits[ask_id]
            conn.tally.waits = len(conn.waits)

        task.add_done_callback(gone)

    async def _check(self, conn: _Conn, ask: wire.Check) -> None:
        headers = [(b"authorization", b"Bearer " + ask.token.encode("latin-1", "replace"))] if ask.token else []
        try:
            principal = await self.keys.check(headers)
        except KeyRefusedError as exc:
            conn.tally.refused += 1
            conn.send(wire.Refused(ask.id, "key", exc.status, str(exc), exc.headers))
            return
        conn.send(wire.Checked(ask.id, None if principal is None else wire.Principal(
            principal.name, principal.role, principal.kind, principal.token_id,
            list(principal.deployments) if principal.deployments is not None else None)))

    async def _acquire(self, conn: _Conn, ask: wire.Acquire) -> None:
        admission = self.route(ask.model)
        if admission is None or admission.deployment != ask.deployment:  # (a key was checked against that one)
            conn.tally.refused += 1
            conn.send(wire.Refused(ask.id, "not_found", 404, ask.model or "(none)"))
            return
        began = time.monotonic()
        grant = None
        if self.limits is not None:
            try:
                grant = await self.limits.claim(ask.key_id, ask.client, ask.prompt, ask.tokens, ask.metered)
            except LimitExceededError as exc:
                conn.tally.refused += 1
                conn.send(wire.Refused(ask.id, "limit", 429, str(exc), exc.headers(), exc.body()))
                return
            except LimitsUnavailableError as exc:
                conn.tally.refused += 1
                conn.send(wire.Refused(ask.id, "unavailable", 503, str(exc)))
                return
        try:
            upstream = await admission.acquire(began + ask.wait_s, ask.keys if admission.by_prefix else None,
                                               (grant.flow, grant.weight) if grant is not None else None)
        except (QueueFullError, QueueTimeoutError, UpstreamUnavailableError) as exc:
            self._settle(grant, 0)
            conn.tally.refused += 1
            kind = ("queue_full" if isinstance(exc, QueueFullError) else
                    "queue_timeout" if isinstance(exc, QueueTimeoutError) else "unavailable")
            conn.send(wire.Refused(ask.id, kind, 503, str(exc)))
            return
        except BaseException:  # cancelled, or anything else: what its limits reserved goes back
            self._settle(grant, 0)
            raise
        permit = next(self._permits)
        conn.permits[permit] = upstream
        if grant is not None:
            conn.grants[permit] = grant
        conn.tally.held = len(conn.permits)
        conn.tally.requests += 1
        if conn.writer.is_closing():  # the worker died while this waited: the slot goes back at once
            conn.permits.pop(permit, None)
            self._settle(conn.grants.pop(permit, None), 0)
            await _release(upstream, grant.flow if grant is not None else None)
            return
        conn.send(wire.Granted(ask.id, permit, upstream.url, upstream.revision, upstream.instance,
                               admission.deployment_id, upstream.auth, len(admission.upstreams),
                               upstream.tokens_per_event))


    def _settle(self, grant: Grant | None, used: int | None) -> None:
        if self.limits is not None:
            self.limits.settle(grant, used)


def _refuse(conn: _Conn, ask: wire.Ask, exc: Exception) -> None:
    """Answer a question the engine failed on with 503 (messages that want no answer get none)."""
    if isinstance(ask, wire.Check | wire.Resolve | wire.Acquire | wire.Models):
        conn.tally.refused += 1
        conn.send(wire.Refused(ask.id, "unavailable", 503, f"the engine could not take this request now "
                               f"({type(exc).__name__}); try again"))


async def _release(upstream: Upstream, flow: str | None) -> None:
    if upstream.admission is not None:
        await upstream.admission.release(upstream, flow=flow)
