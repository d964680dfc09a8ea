"""Gateway workers: the /v1 data path across cores (gateway_workers, gateway_port).

One Python process relays about 27,000 tokens/s (3.7 % of a core per 1,000: docs/benchmarks.md), three H200s of an
8B model; a fleet puts more behind one engine than that. So the engine binds the data port once and starts N worker
processes (engine/gateway/worker.py) that accept on it, each relaying on a core of its own; the kernel hands each
new connection to one of those that accept, as few as the load needs (engine/gateway/steering.py). What must be one
for all of them stays in the engine, which answers their questions (engine/gateway/coordinator.py): each instance's
cap and requests in flight, routing's index, keys and their limits, the ledger. The engine's own port serves /v1 as
before (the console's playground, the built-in benchmarks, one address for everything), so N = 0 is the engine as it
was.

A worker that exits is started again (after 0.5 s, doubling to 30 s while it keeps dying within a minute of its
start; a process that cannot be made is tried again the same way), with an event each time; the slots it held
are free at once, and the other workers' requests never notice. A worker the engine lets go of (it sent what the
engine cannot read) is killed before its slots are freed: none relays under slots the engine gave back. Each
worker is a child of its own process group, with the engine's allow-listed environment, stopped by SIGTERM (its
streams finish within drain_timeout_s) and then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.errors import EngineError
from engine.gateway.coordinator import Coordinator, WorkerTally
from engine.gateway.steering import Steering
from engine.gateway.wire import WorkerSpec
from engine.vllm import child_env

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 30.0
STABLE_S = 60.0  # a worker that ran this long before it exited starts its backoff again at RESTART_FIRST_S
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where `engine` is imported from

Emit = Callable[[str, str, str, dict[str, object]], object]  # kind, message, severity, data (what it returns: unused)


class DataPortError(EngineError):
    """The data port could not be bound (in use, or not an address of this host)."""


@dataclass
class WorkerState:
    index: int
    pid: int | None = None
    started_at: float | None = None  # wall clock
    restarts: int = 0
    last_exit: int | None = None  # its last exit code (negative: the signal that ended it)
    tally: WorkerTally = field(default_factory=WorkerTally)
    alive: bool = False  # its process runs now


def listen(host: str, port: int) -> socket.socket:
    """The data port's socket, bound once by the engine (its workers inherit it)."""
    wildcard_v6 = host == "::"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=4096, dualstack_ipv6=wildcard_v6)
    sock.setblocking(False)
    return sock


class WorkerPool:
    def __init__(self, count: int, host: str, port: int, spec: WorkerSpec, coordinator: Coordinator,
                 emit: Emit | None = None, stop_timeout_s: float = 20.0, busy_share: float = 0.0) -> None:
        """``busy_share``: gateway_worker_busy_share (engine/gateway/steering.py); 0: every worker accepts."""
        self.count = count
        self.host = host
        self.port = port
        self.spec = spec
        self.coordinator = coordinator
        self.emit = emit
        self.stop_timeout_s = stop_timeout_s
        self.workers = [WorkerState(i) for i in range(count)]
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._listener: socket.socket | None = None
        self._stopping = False
        self.steering = Steering(busy_share)
        coordinator.on_busy = self._steer

    def _steer(self) -> None:
        """Tell each worker whose part changed whether it takes new connections (and whether it sheds). A worker
        counts once it has said how busy it is (it says so from the end of its startup on): one still starting is
        never the one new connections wait for. Nothing is said when steering is off (every worker accepts)."""
        if self.steering.share <= 0:
            return
        says = self.steering.decide([w.tally.cpu if w.alive and w.tally.tell is not None else None
                                     for w in self.workers])
        for w, steer in zip(self.workers, says, strict=True):
            tell = w.tally.tell
            if tell is not None and w.tally.said != steer:
                w.tally.said = steer
                tell(steer)

    def accepting(self, w: WorkerState) -> bool:
        """Whether worker ``w`` takes new connections now, as it last said (before it said: unsteered ones do)."""
        if not w.alive:
            return False
        return w.tally.accepting if w.tally.accepting is not None else self.steering.share <= 0

    async def start(self) -> None:
        """Bind the data port and start the workers (they take connections as soon as each is up)."""
        try:
            self._listener = listen(self.host, self.port)
        except OSError as exc:
            raise DataPortError(f"the gateway workers' data port {self.host}:{self.port} cannot be bound "
                                f"({exc.strerror}): set gateway_port to a free port, or gateway_workers to 0") from exc
        self.port = self._listener.getsockname()[1]  # (0: a free one, for tests)
        self._tasks = [asyncio.ensure_future(self._keep(state)) for state in self.workers]

    async def _keep(self, state: WorkerState) -> None:
        """Run worker ``state.index`` until the pool stops, starting it again when it exits."""
        quick = 0  # exits in a row, each within STABLE_S of its start
        while not self._stopping:
            began = time.monotonic()
            try:
                code: int | str = await self._run_once(state)
            except OSError as exc:  # no process could be made (EMFILE, ENOMEM): tried again, like an exit
                code = f"no start ({exc.strerror or exc})"
            if self._stopping:
                return
            state.restarts += 1
            state.last_exit = code if isinstance(code, int) else None
            ran = time.monotonic() - began
            quick = 0 if ran >= STABLE_S else quick + 1
            backoff = min(RESTART_FIRST_S * 2 ** max(0, quick - 1), RESTART_MAX_S)
            self._say("gateway_worker_exited",
                      f"gateway worker {state.index} (pid {state.pid}) exited with {code} after {ran:.1f} s; started "
                      f"again in {backoff:g} s (its requests in flight were lost, the other workers' were not)",
                      "warning", {"worker": state.index, "pid": state.pid, "code": code, "ran_s": round(ran, 1)})
            await asyncio.sleep(backoff)

    async def _run_once(self, state: WorkerState) -> int:
        assert self._listener is not None
        ours, theirs = socket.socketpair()
        spec = msgspec.structs.replace(self.spec, index=state.index, steered=self.steering.share > 0)
        env = child_env()
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([PACKAGE_ROOT, *filter(None, env.get(
            "PYTHONPATH", "").split(os.pathsep))]))
        env["PYTHONUNBUFFERED"] = "1"
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "engine.gateway.worker", "--spec", msgspec.json.encode(spec).decode(),
                "--listen-fd", str(self._listener.fileno()), "--engine-fd", str(theirs.fileno()),
                pass_fds=(self._listener.fileno(), theirs.fileno()), start_new_session=True, env=env,
                stdin=asyncio.subprocess.DEVNULL, cwd=PACKAGE_ROOT)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._procs[state.index] = proc
        state.pid, state.started_at, state.tally, state.alive = proc.pid, time.time(), WorkerTally(), True
        if self._stopping:  # stop() began while it was being made: it ends with the others
            _signal_group(proc.pid, signal.SIGTERM)
        link: asyncio.Future[None] | None = None
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_connection(sock=ours)
            link = asyncio.ensure_future(self.coordinator.serve(reader, writer, state.tally))
            exited = asyncio.ensure_future(proc.wait())
            await asyncio.wait([link, exited], return_when=asyncio.FIRST_COMPLETED)
            if not exited.done():  # the engine let go of it (it sent what cannot be read): its slots are free, so
                _signal_group(proc.pid, signal.SIGKILL)  # it must not relay on under them
            return await exited
        except BaseException:
            _signal_group(proc.pid, signal.SIGKILL)
            raise
        finally:
            state.alive = False
            self._procs.pop(state.index, None)
            if writer is not None:
                writer.close()
            else:
                ours.close()
            if link is not None:
                with contextlib.suppress(Exception):
                    await link
            if not self._stopping:
                self._steer()  # (the next one takes new connections now, not after this one's restart)

    async def stop(self) -> None:
        """Stop taking connections, let the workers' streams finish (stop_timeout_s), then end them."""
        self._stopping = True
        procs = list(self._procs.values())
        for proc in procs:
            _signal_group(proc.pid, signal.SIGTERM)
        if procs:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=self.stop_timeout_s)
            for proc in procs:
                if proc.returncode is None:
                    _signal_group(proc.pid, signal.SIGKILL)
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    await proc.wait()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:  # (a task that failed is logged, never raised into the engine's stop)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _say(self, kind: str, message: str, severity: str, data: dict[str, object]) -> None:
        if self.emit is not None:
            self.emit(kind, message, severity, data)


class WorkersCollector(Collector):
    """The workers in /metrics: up or not, restarts, and each one's requests since its process started."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("llmops_gateway_worker_up", "Whether a gateway worker's process runs",
                               labels=["worker"])
        restarts = CounterMetricFamily("llmops_gateway_worker_restarts", "Times a gateway worker exited and was "
                                       "started again", labels=["worker"])
        requests = GaugeMetricFamily("llmops_gateway_worker_requests", "Requests a gateway worker was given a slot "
                                     "for since its process started", labels=["worker"])
        held = GaugeMetricFamily("llmops_gateway_worker_in_flight", "A gateway worker's requests on an instance now",
                                 labels=["worker"])
        accepting = GaugeMetricFamily("llmops_gateway_worker_accepting", "Whether a gateway worker takes new "
                                      "connections now (gateway_worker_busy_share)", labels=["worker"])
        shedding = GaugeMetricFamily("llmops_gateway_worker_shedding", "The share of a gateway worker's responses "
                                     "after which it lets their connection go, to move load to a worker with room",
                                     labels=["worker"])
        cpu = GaugeMetricFamily("llmops_gateway_worker_cpu", "A gateway worker's share of a core lately, as it "
                                "said", labels=["worker"])
        for w in self.pool.workers:
            label = [str(w.index)]
            up.add_metric(label, 1.0 if w.alive else 0.0)
            restarts.add_metric(label, w.restarts)
            requests.add_metric(label, w.tally.requests)
            held.add_metric(label, w.tally.held)
            accepting.add_metric(label, 1.0 if self.pool.accepting(w) else 0.0)
            shedding.add_metric(label, w.tally.shedding if w.alive else 0.0)
            if w.alive and w.tally.cpu is not None:
                cpu.add_metric(label, w.tally.cpu)
        yield from (up, restarts, requests, held, accepting, shedding, cpu)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
