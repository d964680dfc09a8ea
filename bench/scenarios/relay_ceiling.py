"""The relay's ceiling: how many tokens/s the gateway's data path passes with 0, 1, 2, … worker processes, against a
stub upstream that streams as fast as it can (tests/testkit/stub_upstream.py, a benchmark stub: no model), so that
the gateway is the only thing measured.

    python -m bench relay-ceiling --workers 0 1 2 --seconds 20 --out DIR          # this host
    python -m bench relay-ceiling --profile h200                                   # 16 cores: 0 1 2 4 8

For each worker count a gateway host process (this module, ``--host-gateway``) builds what the engine builds for
/v1 — an admission over the stub upstreams, the gateway, the data path on uvicorn with the engine's edge protocol
(0 workers: the engine's own port), or the coordinator and the worker pool (engine/gateway/workers.py) — and a
load of ``--clients`` streaming completions of ``--tokens`` tokens each, from ``--load-procs`` processes (raw
keep-alive sockets, events counted, nothing parsed), runs ``--seconds`` after ``--warmup``. Reported: tokens/s and
requests/s through the gateway, the gateway's CPU (its process and its workers, in cores) and its CPU per 1,000
tokens/s; and the same load straight to the stubs first, which says what the stubs and the load can do at all.
``--workers -3`` runs the engine itself instead (ledger, metrics, limits): the difference from ``0`` at a few
tokens a request is what a request costs past the relay. Writes relay-ceiling.json and relay-ceiling.md under
``--out``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import multiprocessing
import os
import random
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.base import REPO, serve_engine_over
from engine.config import AppConfig
from engine.vllm import free_port

MARK = b"data: {"
END = b"\r\n0\r\n\r\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2], help="worker counts to measure, in turn; "
                   "-1: a byte proxy instead of the gateway (the floor of a relay in Python: each read from the stub "
                   "written on to the client from the socket's callback, nothing parsed, no task); -2: the engine's "
                   "port with the stream relayed per event (a task wake-up and an ASGI send each), as before "
                   "2026-12-06; -3: the engine itself (its app as `llmops engine` builds it: ledger, metrics, "
                   "limits; keys off) on its own port, its default deployment's instances the stubs")
    p.add_argument("--busy-share", type=float, nargs="+", default=[AppConfig.model_fields[
                   "gateway_worker_busy_share"].default], help="gateway_worker_busy_share of each run of workers "
                   "(one value: every run's; else one per --workers entry): new connections go to as few workers "
                   "as their load needs; 0: every worker accepts, spread by the kernel (engine/gateway/steering.py)")
    p.add_argument("--clients", type=int, default=64, help="streaming clients at once")
    p.add_argument("--tokens", type=int, default=256, help="tokens a request asks for (one event each)")
    p.add_argument("--stubs", type=int, default=1, help="stub upstream processes (the deployment's instances)")
    p.add_argument("--token-s", type=float, default=0.0, help="the stubs' time between a stream's tokens (0: as fast "
                   "as they can, events batched in few reads; vLLM's decode steps send one event a read)")
    p.add_argument("--vllm-shaped", action="store_true", help="the stubs' events as vLLM's (~235 bytes each, its "
                   "fields), its end (the finishing event, the usage, [DONE], each a write), all streams' events on "
                   "one clock as vLLM's decode steps send them (with --token-s)")
    p.add_argument("--prompt-words", type=int, default=1, help="words in each client's prompt (random, drawn "
                   "afresh each run; 150 is about the 200 tokens of the GPU profile's prompts)")
    p.add_argument("--seed", type=int, default=None, help="the prompts' seed (default: a fresh one each run, "
                   "recorded in relay-ceiling.json); each load of the run and each of its processes draws its own "
                   "prompts from it")
    p.add_argument("--load-procs", type=int, default=1, help="processes the clients are spread over")
    p.add_argument("--seconds", type=float, default=20.0, help="measured window per run")
    p.add_argument("--warmup", type=float, default=3.0, help="load before the window")
    p.add_argument("--host-gateway", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--upstream", action="append", default=[], help=argparse.SUPPRESS)


# --- the load ----------------------------------------------------------------------------------------------------


CLOSE = b"\r\nconnection: close\r\n"
_AGAIN: set[asyncio.Task[None]] = set()  # connections being made again


class _Stream(asyncio.Protocol):
    """One client: a request, its stream counted, the next request on the same connection; a connection the server
    lets go after a response (``connection: close``: a gateway worker shedding load) is made again, as HTTP clients
    do, and counted apart from one lost."""

    def __init__(self, request: bytes, tally: list[int], stop_at: float, done: asyncio.Future[None],
                 port: int) -> None:
        self.request, self.tally, self.stop_at, self.done, self.port = request, tally, stop_at, done, port
        self.tail = b""
        self.head_tail = b""  # (the last bytes, for a `connection: close` cut between reads)
        self.let_go = False  # the last response said connection: close
        self.complete = False  # its last response ended
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        buf = self.tail + data
        self.tally[0] += buf.count(MARK)
        self.tail = buf[-7:]
        head = self.head_tail + data
        self.let_go = self.let_go or CLOSE in head
        self.head_tail = head[-(len(CLOSE) - 1):]
        self.complete = False
        if buf.endswith(END):
            self.tally[1] += 1
            self.tail = b""
            self.complete = True
            if self.let_go:
                return  # (the server closes it: made again in connection_lost)
            if time.monotonic() < self.stop_at and self.transport is not None:
                self.transport.write(self.request)  # the next request on the same connection
            elif not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.let_go and self.complete and time.monotonic() < self.stop_at:
            self.tally[3] += 1
            again = asyncio.get_running_loop().create_task(self._again())
            _AGAIN.add(again)  # (held: a task nobody holds may be collected)
            again.add_done_callback(_AGAIN.discard)
            return
        if not (self.let_go and self.complete):
            self.tally[2] += 1
        if not self.done.done():
            self.done.set_result(None)

    async def _again(self) -> None:
        try:
            await asyncio.get_running_loop().create_connection(functools.partial(
                _Stream, self.request, self.tally, self.stop_at, self.done, self.port), "127.0.0.1", self.port)
        except OSError:
            self.tally[2] += 1
            if not self.done.done():
                self.done.set_result(None)


def _request(tokens: int, words: int, rng: random.Random) -> bytes:
    """A streamed completion of ``tokens`` with a prompt of ``words`` random words (no model named: the default
    deployment's, where an engine answers)."""
    prompt = " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(words))
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


async def _load(port: int, clients: int, tokens: int, warmup: float, seconds: float, words: int = 1,
                seed: str = "") -> tuple[int, int, int, int]:
    """Tokens and requests counted in the window (after ``warmup``), connections lost, and connections made again
    after the server let them go."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    tally = [0, 0, 0, 0]
    stop_at = time.monotonic() + warmup + seconds
    dones = []
    for _ in range(clients):
        request = _request(tokens, words, rng)
        done: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(functools.partial(_Stream, request, tally, stop_at, done, port), "127.0.0.1",
                                     port)
        dones.append(done)
    await asyncio.sleep(warmup)
    start = tally.copy()
    await asyncio.sleep(seconds)
    end = tally.copy()
    await asyncio.wait(dones, timeout=60)
    return end[0] - start[0], end[1] - start[1], tally[2], tally[3]


def _load_proc(args: tuple[int, int, int, float, float, int, str]) -> tuple[int, int, int, int]:
    import uvloop

    return uvloop.run(_load(*args))


def load(port: int, a: argparse.Namespace, part: str) -> dict[str, float]:
    """The load, its prompts drawn from ``a.seed`` for this ``part`` of the run (each process its own)."""
    per = [a.clients // a.load_procs + (1 if i < a.clients % a.load_procs else 0) for i in range(a.load_procs)]
    with multiprocessing.get_context("spawn").Pool(a.load_procs) as pool:
        results = pool.map(_load_proc, [(port, n, a.tokens, a.warmup, a.seconds, a.prompt_words,
                                         f"{a.seed}/{part}/{i}") for i, n in enumerate(per)])
    tokens, requests, lost, again = (sum(r[i] for r in results) for i in range(4))
    return {"tokens_per_s": tokens / a.seconds, "requests_per_s": requests / a.seconds, "connections_lost": lost,
            "reconnects": again}


# --- the gateway host --------------------------------------------------------------------------------------------


def host_gateway(a: argparse.Namespace) -> None:
    """What the engine builds for /v1, over the stubs (run in a process of its own)."""
    import uvicorn
    import uvloop

    from engine.access import GatewayKeys, RateLimiter
    from engine.edge import HeadLimits, edge_protocol
    from engine.gateway import Admission, BodyLimits, Coordinator, DataPath, Gateway, WorkerPool, WorkerSpec

    class NoLedger:
        def record(self, rec: Any) -> None:
            pass

        def sample_prompt(self) -> bool:
            return False

    workers = a.workers[0]

    async def byte_proxy() -> None:
        """The floor: two sockets spliced by their protocols' callbacks (a read of one is a write to the other)."""
        host, port = a.upstream[0].removeprefix("http://").rsplit(":", 1)
        loop = asyncio.get_running_loop()

        class Side(asyncio.Protocol):
            def __init__(self) -> None:
                self.transport: asyncio.Transport | None = None
                self.peer: Side | None = None
                self.pending: list[bytes] = []

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport  # type: ignore[assignment]

            def data_received(self, data: bytes) -> None:
                if self.peer is not None and self.peer.transport is not None:
                    self.peer.transport.write(data)
                else:
                    self.pending.append(data)

            def connection_lost(self, exc: Exception | None) -> None:
                if self.peer is not None and self.peer.transport is not None:
                    self.peer.transport.close()

        class Front(Side):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                self.linking = loop.create_task(self.link())  # (held: a task nobody holds may be collected)

            async def link(self) -> None:
                _, back = await loop.create_connection(Side, host, int(port))
                back.peer, self.peer = self, back
                for data in self.pending:
                    assert back.transport is not None
                    back.transport.write(data)
                self.pending = []

        server = await loop.create_server(Front, "127.0.0.1", a.port)
        await server.serve_forever()

    async def engine() -> None:
        """The engine itself over the stubs: what a request costs with its ledger, metrics and limits."""
        from engine.app import create_app

        os.environ.setdefault("LLMOPS_ADMIN_PASSWORD", "relay-ceiling-bench")
        with tempfile.TemporaryDirectory(prefix="relay-ceiling-") as data:
            config = AppConfig(data_dir=Path(data), autostart=False, gateway_keys="off", gateway_workers=0,
                               port=a.port)
            await serve_engine_over(create_app(config), config, a.upstream)

    async def main() -> None:
        if workers == -1:
            await byte_proxy()
            return
        if workers == -3:
            await engine()
            return
        admission = Admission(256, 30.0, deployment_id=1, deployment="stub")
        admission.routing = "least_outstanding"
        for i, url in enumerate(a.upstream):
            await admission.open(url, revision=1, instance=f"s{i}")
        keys = GatewayKeys(None, RateLimiter(), False)  # type: ignore[arg-type]  # no key asked: never consulted
        if workers <= 0:
            if workers == -2:
                from engine.gateway import proxy

                proxy.RELAY_FROM_CALLBACK = False
            path = DataPath(Gateway(lambda _: admission, 600.0, NoLedger()), keys, BodyLimits(1 << 20, 30.0, 64))
            server = uvicorn.Server(uvicorn.Config(path, host="127.0.0.1", port=a.port, log_level="warning",
                                                   lifespan="off", http=edge_protocol(HeadLimits())))
            await server.serve()
            return
        spec = WorkerSpec(index=0, engine_port=0, hosts=[], head_bytes=65536, line_bytes=8192, head_timeout_s=10.0,
                          body_max_bytes=1 << 20, body_timeout_s=30.0, json_max_depth=64, body_budget_bytes=64 << 20,
                          body_share_bytes=None, body_first_byte_s=5.0, max_n=16, max_prompts=64,
                          max_asked_tokens=1 << 20, upstream_timeout_s=600.0, ledger_sample_rate=0.0,
                          keys_required=False, graceful_s=1.0)
        pool = WorkerPool(workers, "127.0.0.1", a.port, spec,
                          Coordinator(lambda _: admission, keys, NoLedger(), lambda: []), busy_share=a.busy_share[0])
        await pool.start()
        try:
            await asyncio.Event().wait()
        finally:
            await pool.stop()

    uvloop.run(main())


def _ready(port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    body = {"prompt": "x", "max_tokens": 1}
    while True:
        try:
            if httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"nothing answered on port {port} within {timeout:.0f} s")
        time.sleep(0.2)


def _tree_sum(proc: psutil.Process, of: Callable[[psutil.Process], float]) -> float:
    """``of`` summed over a process and its children (the workers) so far; a child gone meanwhile adds nothing."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += of(p)
    return total


def _cpu(proc: psutil.Process) -> float:
    """CPU seconds of a process and its children so far."""
    return _tree_sum(proc, lambda p: sum(p.cpu_times()[:2]))  # user, system


def _kernel(proc: psutil.Process) -> float:
    """Of those, the seconds spent in the kernel (system calls, the sockets' TCP) on their behalf."""
    return _tree_sum(proc, lambda p: p.cpu_times().system)


def _syscalls(proc: psutil.Process) -> float:
    """Read and write system calls of a process and its children so far (/proc/PID/io: syscr + syscw)."""
    return _tree_sum(proc, lambda p: sum(p.io_counters()[:2]))  # read_count, write_count


def _or_dash(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


def run(a: argparse.Namespace) -> int:
    if a.host_gateway:
        host_gateway(a)
        return 0
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1 << 32)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, os.environ.get(
        "PYTHONPATH", "").split(os.pathsep))])}  # (vLLM's and the engine's packages may be staged elsewhere)
    stubs, ports = [], []
    for _ in range(a.stubs):
        port = free_port()
        stubs.append(subprocess.Popen([sys.executable, "-m", "tests.testkit.stub_upstream", "--port", str(port),
                                       "--token-s", str(a.token_s), *(["--vllm-shaped"] if a.vllm_shaped else [])],
                                      cwd=REPO, env=env))
        ports.append(port)
    results: list[dict[str, Any]] = []
    try:
        for port in ports:
            _ready(port)
        direct = load(ports[0], a, "direct") if a.stubs == 1 else None
        if direct is not None:
            results.append({"path": "direct to the stub", "workers": None, **direct})
            print(f"direct: {direct['tokens_per_s']:,.0f} tok/s", flush=True)
        if len(a.busy_share) not in (1, len(a.workers)):
            raise SystemExit("--busy-share: one value, or one per --workers entry")
        for k, workers in enumerate(a.workers):
            share = a.busy_share[k if len(a.busy_share) > 1 else 0]
            port = free_port()
            cmd = [sys.executable, "-m", "bench", "relay-ceiling", "--host-gateway", "--workers", str(workers),
                   "--busy-share", str(share), "--port", str(port), "--out", str(a.out / "host"),
                   *[x for p in ports for x in ("--upstream", f"http://127.0.0.1:{p}")]]
            host = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True)
            try:
                _ready(port)
                proc = psutil.Process(host.pid)
                cpu0, sys0, calls0, t0 = _cpu(proc), _kernel(proc), _syscalls(proc), time.monotonic()
                figures = load(port, a, f"workers {workers}")
                elapsed = time.monotonic() - t0
                cores = (_cpu(proc) - cpu0) / elapsed
                kernel = (_kernel(proc) - sys0) / elapsed
                calls_s = (_syscalls(proc) - calls0) / elapsed
            finally:
                os.killpg(host.pid, 15)
                host.wait(30)
            path = ("engine's port" if workers == 0 else "byte proxy (the floor)" if workers == -1
                    else "engine's port, relayed per event (before)" if workers == -2
                    else "the engine itself (ledger, metrics, limits)" if workers == -3 else f"{workers} workers"
                    + (f", steered (busy share {share:g})" if share > 0 and workers > 1 else
                       ", spread by the kernel" if workers > 1 else ""))
            row = {"path": path, "workers": workers, "busy_share": share if workers > 0 else None, **figures,
                   "gateway_cores": cores,
                   "kernel_share": kernel / cores if cores else None,  # of the gateway's CPU, the kernel's
                   # reads and writes of the gateway's processes per token relayed (the floor: about 2)
                   "syscalls_per_token": round(calls_s / figures["tokens_per_s"], 3) if figures["tokens_per_s"]
                   else None,
                   "cpu_pct_per_1k_tok_s": 100 * cores / (figures["tokens_per_s"] / 1000)
                   if figures["tokens_per_s"] else None}
            results.append(row)
            print(f"{row['path']}: {figures['tokens_per_s']:,.0f} tok/s, {figures['requests_per_s']:,.1f} req/s, "
                  f"gateway {cores:.2f} cores", flush=True)
    finally:
        for stub in stubs:
            stub.terminate()
            stub.wait(10)
    out = {"clients": a.clients, "tokens": a.tokens, "prompt_words": a.prompt_words, "seed": a.seed,
           "token_s": a.token_s, "vllm_shaped": a.vllm_shaped,
           "stubs": a.stubs, "load_procs": a.load_procs,
           "seconds": a.seconds, "cores": len(os.sched_getaffinity(0)), "results": results}
    (a.out / "relay-ceiling.json").write_text(json.dumps(out, indent=2))
    lines = [f"{a.clients} streaming clients, {a.tokens} tokens a request "
             f"({f'{a.token_s * 1000:g} ms apart' if a.token_s else 'as fast as the stub can'}), {a.stubs} stub(s), "
             f"{a.load_procs} load process(es), {a.seconds:g} s windows, {out['cores']} cores, prompts of "
             f"{a.prompt_words} word(s), seed {a.seed}"
             + (", the stubs' events shaped and timed as vLLM's" if a.vllm_shaped else ""), "",
             "| path | tokens/s | requests/s | gateway CPU (cores) | % of a core per 1,000 tok/s "
             "| of it in the kernel | reads and writes per token | lost | let go, made again |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        head = f"| {r['path']} | {r['tokens_per_s']:,.0f} | {r['requests_per_s']:,.1f} | "
        if "gateway_cores" in r:
            share = r.get("kernel_share")
            in_kernel = "–" if share is None else f"{100 * share:.0f} %"
            lines.append(head + f"{r['gateway_cores']:.2f} | {r['cpu_pct_per_1k_tok_s'] or 0:.2f} | {in_kernel} | "
                         f"{_or_dash(r.get('syscalls_per_token'))} | {r['connections_lost']} | "
                         f"{r.get('reconnects', 0)} |")
        else:
            lines.append(head + f"– | – | – | – | {r['connections_lost']} | {r.get('reconnects', 0)} |")
    (a.out / "relay-ceiling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0
