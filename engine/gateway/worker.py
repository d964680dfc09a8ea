"""A gateway worker: one of the processes that serve the /v1 data path on ``gateway_port`` (engine/gateway/workers.py
starts them: ``python -m engine.gateway.worker``). It relays tokens — the head's bounds and Host check, the body's
limits and budget, the connection to vLLM, each stream's events and usage — on a core of its own; it decides
nothing that the other workers must agree on: a key, a model's deployment, a slot on an instance and the ledger's
record are the engine's (engine/gateway/coordinator.py), asked over the socket the engine gave it.

When the engine's end of that socket closes (the engine stopped or died) the worker stops taking connections, lets
its streams finish within its grace, and exits: no worker outlives its engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import logging
import math
import random
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import uvicorn
from starlette.types import Receive, Scope, Send

from engine.access.auth import Principal
from engine.access.keys import KeyRefusedError, bearer
from engine.bodies import BodyBudget, RequestBounds
from engine.edge import HeadLimits, HostCheck, Shedding, edge_protocol, host_of, refuse_host
from engine.errors import EngineError, QueueFullError, QueueTimeoutError, UpstreamUnavailableError
from engine.gateway import wire
from engine.gateway.admission import Admission, Flow, Upstream
from engine.gateway.datapath import BodyLimits, DataPath
from engine.gateway.ledger import Record
from engine.gateway.limits import LimitExceededError
from engine.gateway.proxy import Claim, Gateway, send_simple
from engine.gateway.steering import BUSY_EVERY_S

log = logging.getLogger("llmops.gateway.worker")

ROUTE_CACHE_S = 1.0  # a model's deployment, as the engine said, is believed this long (the slot is the engine's)
ANSWER_S = 30.0  # the longest the engine may take to answer a question (a slot's wait comes on top)
ACCEPT_RETRY_S = 1.0  # a worker that could not accept again (no descriptor left) tries again this much later


class EngineLink:
    """The worker's end of its socket to the engine: questions by id, their answers as they come."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.out = wire.Outbox(writer)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[wire.Answer]] = {}
        self.lost: str | None = None
        self.on_steer: Callable[[wire.Steer], None] | None = None  # the engine said whether to take connections

    async def run(self) -> None:
        """Read answers until the engine's end closes."""
        try:
            while True:
                answer = await wire.read_answer(self.reader)
                if isinstance(answer, wire.Steer):
                    if self.on_steer is not None:
                        self.on_steer(answer)
                    continue
                future = self._waiting.pop(answer.id, None)
                if future is not None and not future.done():
                    future.set_result(answer)
                elif isinstance(answer, wire.Granted):  # for a request that was given up meanwhile
                    self.tell(wire.Done(answer.permit, used=0))
        except wire.WireError as exc:
            self.lost = str(exc)
        finally:
            self.lost = self.lost or "the engine's link ended"
            for future in self._waiting.values():
                if not future.done():
                    future.set_exception(UpstreamUnavailableError(f"the engine is gone ({self.lost})"))
            self._waiting.clear()

    def tell(self, message: wire.Ask) -> None:
        if self.lost is None:
            self.out.put(message)

    async def ask(self, make: Callable[[int], wire.Ask], timeout: float = ANSWER_S) -> wire.Answer:
        """The engine's answer to the question ``make`` writes; UpstreamUnavailableError without one in
        ``timeout`` (the engine always answers: past it, something is wrong, and the request is not held for ever)."""
        if self.lost is not None:
            raise UpstreamUnavailableError(f"the engine is gone ({self.lost})")
        ask_id = next(self._ids)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[wire.Answer] = loop.create_future()
        self._waiting[ask_id] = future
        message = make(ask_id)
        self.out.put(message)
        # (a timer on the future, not asyncio.timeout and shield around it: a request asks twice, and those cost
        # a task lookup, a context and an outer future each time)
        timer = loop.call_later(timeout, _no_answer, future)
        try:
            return await future
        except (asyncio.CancelledError, _NoAnswerError) as exc:
            self._waiting.pop(ask_id, None)  # (an answer that comes later is dropped; a slot is given back)
            if future.done() and not future.cancelled() and future.exception() is None and isinstance(
                    granted := future.result(), wire.Granted):
                self.tell(wire.Done(granted.permit, used=0))  # granted as the client left: the slot goes back
            elif isinstance(message, wire.Acquire):
                self.tell(wire.Cancel(ask_id))
            if isinstance(exc, _NoAnswerError):
                raise UpstreamUnavailableError(f"the engine did not answer within {timeout:g} s") from None
            raise
        finally:
            timer.cancel()


class _NoAnswerError(EngineError):
    """The engine did not answer a question in time (EngineLink.ask)."""


def _no_answer(future: asyncio.Future[wire.Answer]) -> None:
    if not future.done():
        future.set_exception(_NoAnswerError())


class RemoteKeys:
    """The engine's gateway keys, asked (a key's rate limit is one for every worker)."""

    def __init__(self, link: EngineLink, required: bool) -> None:
        self.link = link
        self.required = required

    async def check(self, headers: list[tuple[bytes, bytes]]) -> Principal | None:
        token = bearer(headers)
        if not self.required and not token:
            return None
        answer = await self.link.ask(lambda i: wire.Check(i, token))
        if isinstance(answer, wire.Refused):
            raise KeyRefusedError(answer.status, answer.message, list(answer.headers))
        if not isinstance(answer, wire.Checked):
            raise UpstreamUnavailableError(f"the engine answered a key's check with {type(answer).__name__}")
        p = answer.principal
        if p is None:
            return None
        return Principal(p.name, p.role, p.kind, p.token_id,
                         deployments=tuple(p.deployments) if p.deployments is not None else None)


class RemoteLedger:
    """The engine's request ledger: each record is sent to it."""

    def __init__(self, link: EngineLink, sample_rate: float) -> None:
        self.link = link
        self.sample_rate = sample_rate

    def record(self, rec: Record) -> None:
        self.link.tell(wire.Ledger(rec))

    def sample_prompt(self) -> bool:
        return self.sample_rate > 0 and random.random() < self.sample_rate


class RelayedLimitError(LimitExceededError):
    """A key's or team's limit refused the request in the engine: its answer, as the engine wrote it."""

    def __init__(self, message: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        try:
            told = json.loads(body)["error"]
            scope, limit, value = str(told["scope"]), str(told["limit"]), int(told["limit_value"])
        except (ValueError, KeyError, TypeError):
            scope, limit, value = "key", "limit", 0
        super().__init__(message, scope=scope, limit=limit, value=value, retry_after_s=1)
        self._body = body
        self._headers = headers

    def headers(self) -> list[tuple[bytes, bytes]]:
        return self._headers

    def body(self) -> bytes:
        return self._body


@dataclass(eq=False)
class RemoteUpstream(Upstream):
    permit: int = 0  # the engine's slot


class RemoteAdmission(Admission):
    """A deployment's admission as a worker sees it: a slot is the engine's to give (Acquire) and take back (Done)."""

    def __init__(self, link: EngineLink, model: str | None, route: wire.Route) -> None:
        super().__init__(0, route.queue_timeout_s, route.deployment_id, route.deployment)
        self.link = link
        self.model = model
        self._by_prefix = route.by_prefix
        self.open_now = 1

    @property
    def by_prefix(self) -> bool:
        return self._by_prefix

    @property
    def upstreams(self) -> list[Upstream]:
        return [Upstream("", None)] * self.open_now  # how many are open (the retry after a refused connection)

    async def acquire(self, deadline: float, keys: Sequence[int] | None = None, flow: Flow | None = None,
                      claim: object = None) -> Upstream:
        wait_s = max(0.0, deadline - time.monotonic())
        c = claim if isinstance(claim, Claim) else Claim(None, "", 0, 0, False)
        answer = await self.link.ask(lambda i: wire.Acquire(i, self.model, self.deployment,
                                                            list(keys) if keys else None, wait_s, c.key_id, c.client,
                                                            c.prompt, c.tokens, c.metered),
                                     timeout=wait_s + ANSWER_S)
        if isinstance(answer, wire.Granted):
            self.open_now = answer.open
            return RemoteUpstream(answer.url, answer.revision, answer.instance, auth=answer.auth, admission=self,
                                  tokens_per_event=answer.tokens_per_event, permit=answer.permit)
        if isinstance(answer, wire.Refused):
            if answer.kind == "queue_full":
                raise QueueFullError(answer.message)
            if answer.kind == "queue_timeout":
                raise QueueTimeoutError(answer.message)
            if answer.kind == "not_found":
                raise UpstreamUnavailableError(f"no deployment serves model {answer.message!r} now")
            if answer.kind == "limit":
                raise RelayedLimitError(answer.message, answer.body, list(answer.headers))
            raise UpstreamUnavailableError(answer.message)
        raise UpstreamUnavailableError(f"the engine answered a slot's request with {type(answer).__name__}")

    async def release(self, upstream: Upstream, used: int | None = None, flow: str | None = None) -> None:
        self.release_nowait(upstream, flow, used)

    def release_nowait(self, upstream: Upstream, flow: str | None = None, used: int | None = None) -> None:
        if isinstance(upstream, RemoteUpstream):
            self.link.tell(wire.Done(upstream.permit, down=upstream.down_until > time.monotonic(), used=used))


class WorkerGateway(Gateway):
    """The relay of a worker: deployments and slots asked of the engine."""

    def __init__(self, link: EngineLink, upstream_timeout_s: float, ledger: RemoteLedger) -> None:
        super().__init__(lambda _: None, upstream_timeout_s, ledger)
        self.link = link
        # a model's route as the engine said, and its admission (one for the route's life, not one a request)
        self._routes: dict[str | None, tuple[float, RemoteAdmission | None]] = {}

    async def resolve(self, model: str | None) -> Admission | None:
        now = time.monotonic()
        cached = self._routes.get(model)
        if cached is None or now - cached[0] > ROUTE_CACHE_S:
            answer = await self.link.ask(lambda i: wire.Resolve(i, model))
            if not isinstance(answer, wire.Route):
                raise UpstreamUnavailableError(f"the engine answered a model's route with {type(answer).__name__}")
            if len(self._routes) >= 1024:
                self._routes.clear()
            admission = None if answer.deployment is None else RemoteAdmission(self.link, model, answer)
            if admission is not None and cached is not None and cached[1] is not None \
                    and cached[1].deployment_id == admission.deployment_id:
                admission.open_now = cached[1].open_now  # (as the last grant said)
            self._routes[model] = cached = (now, admission)
        return cached[1]


class WorkerDataPath(DataPath):
    async def list_models(self, principal: Principal | None) -> bytes | None:
        link = self.gateway.link if isinstance(self.gateway, WorkerGateway) else None
        if link is None:
            return None
        answer = await link.ask(lambda i: wire.Models(i))
        entries = answer.models if isinstance(answer, wire.ModelList) else []
        data = b",".join(body for deployment, body in entries if principal is None or principal.may_use(deployment))
        return b'{"object":"list","data":[' + data + b"]}"


class WorkerApp:
    """The worker's ASGI app: the Host check, then the data path; anything else is the engine's, on its port."""

    def __init__(self, data_path: DataPath, hosts: HostCheck, engine_port: int) -> None:
        self.data_path = data_path
        self.hosts = hosts
        self.elsewhere = json.dumps({"error": {
            "message": f"this port serves the /v1 gateway only; the engine's API is on port {engine_port}",
            "type": "not_found", "code": 404}}).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return
        if not self.hosts.admits(host := host_of(scope)):
            await refuse_host(scope, send, self.hosts.refusal(host or ""))
            return
        if self.data_path.handles(scope):
            await self.data_path(scope, receive, send)
        elif scope["type"] == "http":
            await send_simple(send, 404, self.elsewhere)
        else:
            await send({"type": "websocket.close", "code": 1008})


class BusyReports:
    """Say how busy this worker is (its process's share of a core) every BUSY_EVERY_S, until stopped."""

    def __init__(self, link: EngineLink, applied: Callable[[], tuple[bool, float]]) -> None:
        self.link = link
        self.applied = applied  # what it does now: takes new connections, the share of responses it lets go
        self._last = (time.monotonic(), time.process_time())
        self._timer = asyncio.get_running_loop().call_later(BUSY_EVERY_S, self._report)

    def _report(self) -> None:
        now, cpu = time.monotonic(), time.process_time()
        then, was = self._last
        if now > then:
            accepting, shedding = self.applied()
            self.link.tell(wire.Busy(round((cpu - was) / (now - then), 4), accepting, shedding))
        self._last = (now, cpu)
        self._timer = asyncio.get_running_loop().call_later(BUSY_EVERY_S, self._report)

    def stop(self) -> None:
        self._timer.cancel()


class Steered(uvicorn.Server):
    """uvicorn's server, taking connections on the data port only while the engine says so (wire.Steer:
    engine/gateway/steering.py). Its listening socket is the engine's, shared by every worker: a worker that stops
    accepting closes only its own copy, and opens a new copy to accept again."""

    def __init__(self, config: uvicorn.Config, listener: socket.socket, shedding: Shedding, link: EngineLink,
                 *, steered: bool) -> None:
        """``steered``: it takes no connection until the engine says so (gateway_worker_busy_share > 0); else it
        takes them from its start, as every worker did before steering."""
        super().__init__(config)
        self.link = link
        self.reports: BusyReports | None = None  # from the end of its startup (what starting cost is not load)
        self.listener = listener
        self.shedding = shedding
        self.accept_wanted = not steered
        self._accepting = False
        self._up = False  # its startup is over (uvicorn's own servers are open)
        self._turning: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, on a copy of the listening socket only if it takes connections from its start."""
        await super().startup([self.listener.dup()] if self.accept_wanted else [])
        self._up, self._accepting = True, bool(self.servers)
        self.reports = BusyReports(self.link, lambda: (self._accepting, self.shedding.share))
        self._turn()

    def steer(self, said: wire.Steer) -> None:
        self.shedding.share = min(1.0, max(0.0, said.shed)) if math.isfinite(said.shed) else 0.0
        self.accept_wanted = said.accept
        self._turn()

    def _turn(self) -> None:
        if not self._up or self.should_exit:
            return  # (not up yet: startup turns it; stopping: uvicorn closes what is open)
        if self._turning is not None and not self._turning.done():
            return  # (it turns again when done)
        if self.accept_wanted and not self._accepting:
            self._turning = asyncio.ensure_future(self._accept())
        elif not self.accept_wanted and self._accepting:
            for server in self.servers:
                server.close()
            self.servers = []  # (its connections are uvicorn's to wait for on stop, not the servers')
            self._accepting = False

    async def _accept(self) -> None:
        config = self.config

        def protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state)

        try:
            server = await asyncio.get_running_loop().create_server(protocol, sock=self.listener.dup(),
                                                                    backlog=config.backlog)
        except OSError as exc:  # (no descriptor left): tried again in a second, the others accept meanwhile
            log.warning("a gateway worker could not accept on the data port again (%s); trying again in %g s", exc,
                        ACCEPT_RETRY_S)
            asyncio.get_running_loop().call_later(ACCEPT_RETRY_S, self._turn)
            return
        self.servers.append(server)
        self._accepting = True
        if self.should_exit:  # (stopping began meanwhile: uvicorn closed only what it saw)
            server.close()
        asyncio.get_running_loop().call_soon(self._turn)  # (told otherwise meanwhile)


async def serve(spec: wire.WorkerSpec, listener: socket.socket, engine: socket.socket) -> None:
    reader, writer = await asyncio.open_connection(sock=engine)
    link = EngineLink(reader, writer)
    gateway = WorkerGateway(link, spec.upstream_timeout_s, RemoteLedger(link, spec.ledger_sample_rate))
    limits = BodyLimits(spec.body_max_bytes, spec.body_timeout_s, spec.json_max_depth, spec.body_budget_bytes,
                        spec.body_first_byte_s, RequestBounds(spec.max_n, spec.max_prompts, spec.max_asked_tokens),
                        spec.limit_bytes_per_token, spec.limit_unasked_max_tokens)
    data_path = WorkerDataPath(gateway, RemoteKeys(link, spec.keys_required), limits,
                               BodyBudget(spec.body_budget_bytes, spec.body_share_bytes))
    app = WorkerApp(data_path, HostCheck(spec.hosts), spec.engine_port)
    shedding = Shedding()
    server = Steered(uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", server_header=False,
        http=edge_protocol(HeadLimits(spec.head_bytes, spec.line_bytes, spec.head_timeout_s), shedding),
        proxy_headers=bool(spec.trusted_proxies), forwarded_allow_ips=list(spec.trusted_proxies),
        timeout_graceful_shutdown=max(1, math.ceil(spec.graceful_s)), backlog=4096), listener, shedding, link,
        steered=spec.steered)
    link.on_steer = server.steer

    async def watch() -> None:
        try:
            await link.run()
            log.warning("gateway worker %d: %s; stopping", spec.index, link.lost)
        except Exception:
            log.exception("gateway worker %d: its link to the engine failed; stopping", spec.index)
            raise
        finally:  # (whatever ended it, its own stop's cancel included: no worker outlives its link)
            server.should_exit = True

    watcher = asyncio.ensure_future(watch())
    gc.collect()
    gc.freeze()  # (as the engine does: its start's objects are left out of the collector's full passes)
    try:
        await server.serve(sockets=[])  # (Steered.startup gives uvicorn its copy of the listening socket)
    finally:
        if server.reports is not None:
            server.reports.stop()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        await gateway.aclose()
        link.out.flush()
        writer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.gateway.worker",
                                     description="A gateway worker of the engine (the engine starts it).")
    parser.add_argument("--spec", required=True, help="the worker's WorkerSpec, as JSON")
    parser.add_argument("--listen-fd", type=int, required=True, help="the data port's listening socket")
    parser.add_argument("--engine-fd", type=int, required=True, help="the socket to the engine")
    args = parser.parse_args(argv)
    spec = msgspec.json.decode(args.spec, type=wire.WorkerSpec)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s gateway-worker-{spec.index} "
                        "%(name)s: %(message)s")
    listener = socket.socket(fileno=args.listen_fd)
    engine = socket.socket(fileno=args.engine_fd)
    import uvloop  # the engine's own loop (engine.app.server_config)

    uvloop.run(serve(spec, listener, engine))


if __name__ == "__main__":
    main()
