"""Would vLLM's KV-cache events beat the gateway's estimate? Two vLLM replicas started with ``--kv-events-config``
(each publishing on its own socket in a private folder: the events carry the prompts' token ids) behind one router
in this process, which alternates four policies on the same replicas and the same kind of load:

- ``least_outstanding``: the fewest requests in flight;
- ``prefix``: the engine's own choice (``engine.gateway.routing.pick``: the prompt's bytes in blocks, an index per
  replica of what was sent to it, the load bound) — the estimate;
- ``prefix_evictions``: the estimate, corrected by the events off the request's path: after the choice the prompt is
  tokenized to learn which of vLLM's blocks each of its keys stands on, and when vLLM evicts a block the keys on it
  leave that replica's index (the tokenizer's cost is not the decision's);
- ``events``: what each replica's cache really holds by its events. The router tokenizes the prompt (the model's
  tokenizer, as vLLM does), chains its whole blocks of vLLM's block size, and sends it to the replica that holds
  the longest prefix under the same load bound; a prompt no replica holds goes to its home by rendezvous hashing,
  as ``prefix`` does. What was routed and not yet confirmed by an event counts as held for ``PENDING_S``: otherwise
  a burst of one new prefix would spread before the first event arrives.

For every request under every policy the router also computes, from the events, how much of its prompt each replica
held when it was routed: the share of requests sent to a replica holding the longest cached prefix there was, the
share of their blocks held where they went, and the prompts no replica held any of (how many were routed as if one
did). Every policy pays that tokenizing, so the policies differ in the choice alone.

Fresh prompts every run (vLLM's ``prefix_repetition`` dataset, a new seed each run); a round runs each policy twice,
mirrored (least_outstanding, prefix, prefix_evictions, events, events, prefix_evictions, prefix, least_outstanding).
Each run records vLLM's figures, each replica's prefix-cache hits over the run (its /metrics), and the decision's own
cost (the estimate's keys and choice; the events' tokenizing, hashing and choice). The router is a benchmark's, not
the engine's data path: its relay is aiohttp.

    python -m bench routing-events --out DIR                   # CPU: the demo model
    python -m bench routing-events --profile h200              # 2 x 0.42 of an H200 (the routing scenario's load)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.base import REPO
from bench.scenarios.gateway_overhead import KV_LINE, _free_port, cache_over
from bench.scenarios.routing import replica_and_load_options, scrape_one
from engine.benchmarks.runs import fresh_seed
from engine.gateway.routing import (
    BLOCK_BYTES,
    BYTES_PER_TOKEN,
    HOME_BLOCKS,
    KEY_ENDS,
    LOAD_FACTOR,
    LOAD_SLACK,
    PrefixIndex,
    Routed,
    _mix,
    instance_salt,
    pick,
    prefix_keys,
)

POLICIES = ("least_outstanding", "prefix", "prefix_evictions", "events", "events", "prefix_evictions", "prefix",
            "least_outstanding")
PENDING_S = 10.0  # a prompt routed to a replica counts as held there this long, or until its events arrive


@dataclass
class Replica:
    """One vLLM server, as both routers see it."""

    name: str
    url: str
    endpoint: str
    proc: subprocess.Popen[bytes]
    log: Path
    salt: int = 0
    outstanding: int = 0
    kv_usage: float | None = None  # pick() reads it; left unknown for every policy alike
    routed: Routed = field(default_factory=Routed)
    # the events' view: our chained hash of each held block <-> vLLM's hash of it
    held: dict[int, int] = field(default_factory=dict)
    by_vllm: dict[int, int] = field(default_factory=dict)
    pending: dict[int, float] = field(default_factory=dict)  # routed here, not yet in an event: until when
    # prefix_evictions: the estimate's keys that stand on each block (ours), dropped from its index when vLLM
    # evicts the block
    keys_on: dict[int, set[int]] = field(default_factory=dict)
    evict_keys: bool = False
    failure: str | None = None  # why its events' subscriber stopped
    events: int = 0
    unchained: int = 0  # stored blocks whose parent was never seen (an event missed): not indexed
    block_size: int | None = None

    def holds(self, chain: list[int], now: float = math.inf) -> int:
        """How many leading blocks of ``chain`` it holds by its events (or were routed here, not yet confirmed, and
        ``now`` is before their time runs out; by default, by its events alone)."""
        n = 0
        for h in chain:
            if h in self.held or self.pending.get(h, 0.0) > now:
                n += 1
            else:
                break
        return n



def chain_of(tokens: list[int], block_size: int) -> list[int]:
    """The chained hashes of ``tokens``'s whole blocks (this process's own hash; vLLM's is matched by event)."""
    out: list[int] = []
    parent = 0
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        out.append(parent)
    return out


def apply_event(rep: Replica, event: Any) -> None:
    """One of vLLM's KV-cache events (its own msgspec types, decoded as its version writes them)."""
    kind = type(event).__name__
    if kind == "BlockStored":
        size = int(event.block_size)
        rep.block_size = rep.block_size or size
        parent = 0 if event.parent_block_hash is None else rep.by_vllm.get(event.parent_block_hash)
        if parent is None:
            rep.unchained += len(event.block_hashes)
            return
        tokens = event.token_ids
        for i, vh in enumerate(event.block_hashes):
            parent = hash((parent, tuple(tokens[i * size:(i + 1) * size])))
            rep.held[parent] = vh
            rep.by_vllm[vh] = parent
            rep.pending.pop(parent, None)
    elif kind == "BlockRemoved":
        index = rep.routed.index
        for vh in event.block_hashes:
            ours = rep.by_vllm.pop(vh, None)
            if ours is not None:
                rep.held.pop(ours, None)
                for key in rep.keys_on.pop(ours, ()):
                    if rep.evict_keys and key in index.keys:
                        index.size -= index.keys.pop(key)
    elif kind == "AllBlocksCleared":
        rep.held.clear()
        rep.by_vllm.clear()
        rep.keys_on.clear()
        if rep.evict_keys:
            rep.routed.index.keys.clear()
            rep.routed.index.size = 0


class Router:
    """The bench's router: a policy, the replicas, the tokenizer, and what each request saw."""

    def __init__(self, replicas: list[Replica], tokenizer: Any) -> None:
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.policy = "least_outstanding"
        self.in_flight = 0
        self.log: list[dict[str, Any]] = []  # per request: the decision's cost, the events' view of the choice

    def block_size(self) -> int | None:
        return next((r.block_size for r in self.replicas if r.block_size), None)

    def choose(self, prompt: str | list[int]) -> Replica:
        now = time.monotonic()
        t0 = time.perf_counter()
        tokens: list[int] = prompt if isinstance(prompt, list) else self.tokenizer(prompt).input_ids
        size = self.block_size()
        chain = chain_of(tokens, size) if size else []
        t_tok = time.perf_counter()
        t1: float | None = None
        if self.policy == "events":
            chosen = self._by_events(chain, now)
        elif self.policy in ("prefix", "prefix_evictions"):
            raw = prompt.encode() if isinstance(prompt, str) else json.dumps(prompt).encode()
            t_tok = time.perf_counter()  # the estimate needs no tokenizer: its cost starts here
            keys = prefix_keys(raw)
            estimate: Any = pick("prefix", self.replicas, self.in_flight,  # type: ignore[arg-type]
                                 len(self.replicas), keys)  # the engine's own, on these stand-ins
            chosen = estimate
            t1 = time.perf_counter()
            if self.policy == "prefix_evictions" and isinstance(prompt, str) and size and chain:
                # after the request is on its way (the next turn of the loop), as a real router would off its path
                asyncio.get_running_loop().call_soon(self._keys_on_blocks, chosen, prompt, keys, size, chain)
        else:
            chosen = min(self.replicas, key=lambda r: r.outstanding)
        t1 = time.perf_counter() if t1 is None else t1
        held = [r.holds(chain) for r in self.replicas]
        mine = held[self.replicas.index(chosen)]
        self.log.append({"policy": self.policy, "decision_us": 1e6 * (t1 - t0), "choice_us": 1e6 * (t1 - t_tok),
                         "blocks": len(chain), "best_held": max(held, default=0), "chosen_held": mine})
        if chain and self.policy == "events":
            until = now + PENDING_S
            for h in chain:
                if h not in chosen.held:
                    chosen.pending[h] = until
            if len(self.log) % 1024 == 0:  # what was routed and never confirmed (a prompt shorter than it)
                for rep in self.replicas:
                    rep.pending = {h: t for h, t in rep.pending.items() if t > now}
        return chosen

    def _keys_on_blocks(self, chosen: Replica, prompt: str, keys: list[int], size: int, chain: list[int]) -> None:
        """Which of vLLM's blocks each of the estimate's keys stands on: the block of the key's last token, or the
        prompt's last whole block (vLLM caches whole blocks, and evicts a prefix's tail first: once that block goes,
        the key's prefix is no longer all held)."""
        offsets = self.tokenizer(prompt, return_offsets_mapping=True).offset_mapping
        ends = [end for _start, end in offsets]  # each token's end, in characters of the prompt
        if not prompt.isascii():  # the keys count bytes: characters to bytes
            at = [0]
            for ch in prompt:
                at.append(at[-1] + len(ch.encode()))
            ends = [at[e] for e in ends]
        for i, key in enumerate(keys):
            last = bisect.bisect_right(ends, KEY_ENDS[i] * BLOCK_BYTES) - 1  # the key's last token
            block = max(0, min(len(chain) - 1, last // size))
            chosen.keys_on.setdefault(chain[block], set()).add(key)

    def _by_events(self, chain: list[int], now: float) -> Replica:
        """The replica that holds the longest prefix (by events, or just routed there), else the prompt's home."""
        free = self.replicas
        if not chain:
            return min(free, key=lambda r: r.outstanding)
        bound = math.ceil(LOAD_FACTOR * (self.in_flight + 1) / len(free)) + LOAD_SLACK
        under = [r for r in free if r.outstanding < bound]
        best, best_len = None, 0
        for r in under:
            n = r.holds(chain, now)
            if n > best_len or (n == best_len and n and best is not None and r.outstanding < best.outstanding):
                best, best_len = r, n
        if best is not None:
            return best
        if under:  # the home of the prompt's first HOME_BLOCKS x BLOCK_BYTES bytes, in tokens, as the estimate's
            size = self.block_size() or 1
            first = max(1, math.ceil(HOME_BLOCKS * BLOCK_BYTES / BYTES_PER_TOKEN / size))
            home = chain[min(first, len(chain)) - 1] & ((1 << 64) - 1)
            return max(under, key=lambda r: _mix(home ^ r.salt))
        return min(free, key=lambda r: r.outstanding)


async def _subscribe(rep: Replica, stop: asyncio.Event) -> None:
    import msgspec
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.connect(rep.endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        while not stop.is_set():
            if not await sock.poll(200):
                continue
            parts = await sock.recv_multipart()
            for event in decoder.decode(parts[-1]).events:
                rep.events += 1
                apply_event(rep, event)
    except Exception as exc:  # said by the next run's check, then raised here
        rep.failure = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        sock.close(linger=0)


class Proxy:
    """POST /v1/completions to the replica the router chooses, the response relayed as it comes (aiohttp)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.port = _free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.stop_event: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import vllm.distributed.kv_events  # noqa: F401  (imported here, not in the router's loop)

        self.thread.start()
        if not self.ready.wait(60):
            raise SystemExit("the bench's router did not start")

    def check(self) -> None:
        """Fail the run if a replica's subscriber stopped (its figures would come from a frozen view)."""
        for rep in self.router.replicas:
            if rep.failure is not None:
                raise SystemExit(f"the KV-events subscriber of {rep.name} stopped: {rep.failure}")

    def close(self) -> None:
        if self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)
        if not self.thread.is_alive():
            self.loop.close()

    def _run(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        import aiohttp
        from aiohttp import web

        self.stop_event = asyncio.Event()
        subs = [asyncio.create_task(_subscribe(r, self.stop_event)) for r in self.router.replicas]
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(
            limit=0))
        router = self.router

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            doc = json.loads(body)
            rep = router.choose(doc.get("prompt") or "")
            rep.outstanding += 1
            router.in_flight += 1
            try:
                async with session.post(f"{rep.url}/v1/completions", data=body,
                                        headers={"content-type": "application/json"}) as up:
                    resp = web.StreamResponse(status=up.status, headers={
                        "content-type": up.headers.get("content-type", "application/json")})
                    await resp.prepare(request)
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                    await resp.write_eof()
                    return resp
            finally:
                rep.outstanding -= 1
                router.in_flight -= 1

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self.ready.set()
        await self.stop_event.wait()
        await runner.cleanup()
        await session.close()
        for t in subs:
            await t


def start_replica(a: argparse.Namespace, name: str, folder: Path) -> Replica:
    port = _free_port()
    endpoint = f"ipc://{folder}/kv-{name}.sock"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    model = a.model or str(REPO / "data" / "models" / "demo")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
            "--model", model, "--served-model-name", "bench", "--max-model-len", str(a.max_model_len),
            "--max-num-seqs", str(a.max_num_seqs), "--load-format", a.load_format, "--enable-prefix-caching",
            "--kv-events-config", json.dumps(config)]
    if a.model:
        argv += ["--gpu-memory-utilization", str(a.utilization)]
    else:
        argv += ["--kv-cache-memory-bytes", str(int(a.cpu_kv_cache_gib * (1 << 30)))]
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "OPENAI_API_KEY")}
    env |= {"VLLM_NO_USAGE_STATS": "1", "PYTHONUNBUFFERED": "1"}
    if not a.model:  # the CPU build: each replica's threads on a core of its own, not both on every core
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[int(name.rsplit("-", 1)[1]) % len(cores)])
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Replica(name, f"http://127.0.0.1:{port}", endpoint, proc, log, salt=instance_salt(name))


def wait_ready(reps: list[Replica], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    for rep in reps:
        while True:
            if rep.proc.poll() is not None:
                raise SystemExit(f"replica {rep.name} exited:\n{rep.log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{rep.url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"replica {rep.name} did not come up within {within_s:.0f} s")
            time.sleep(0.5)
        m = KV_LINE.search(rep.log.read_text().replace("CPU KV cache", "GPU KV cache"))
        if m:
            rep.routed.index = PrefixIndex.for_tokens(int(m.group(1).replace(",", "")))


def stop_replicas(reps: list[Replica]) -> None:
    """SIGTERM to each replica's process group, up to 30 s for the servers, then SIGKILL to the groups (an engine
    core left behind by its server goes too)."""
    for rep in reps:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rep.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for rep in reps:
        with contextlib.suppress(subprocess.TimeoutExpired):
            rep.proc.wait(max(0.1, deadline - time.monotonic()))
    for rep in reps:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(rep.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            rep.proc.wait(10)


@contextlib.contextmanager
def replicas_up(a: argparse.Namespace, folder: Path) -> Iterator[list[Replica]]:
    reps: list[Replica] = []
    try:
        for name in ("replica-0", "replica-1"):
            reps.append(start_replica(a, name, folder))
            if a.model:  # one GPU: the second starts once the first has its memory (started side by side, the
                # first try on an H100 failed as vLLM's engine core started; its cause was cut from the log's tail)
                wait_ready(reps[-1:], 1800)
        wait_ready(reps, 1800)
        yield reps
    except SystemExit:
        for rep in reps:  # what each replica said, beside the results (the message keeps only a log's tail)
            with contextlib.suppress(OSError):
                shutil.copy(rep.log, a.out / rep.log.name)
        raise
    finally:
        stop_replicas(reps)


def scrape(rep: Replica) -> str | None:
    return scrape_one({"url": rep.url})


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1)


def run_once(router: Router, proxy: Proxy, a: argparse.Namespace, workdir: Path, tag: str) -> dict[str, Any]:
    out = workdir / f"{tag}.json"
    seed = fresh_seed()
    tokenizer = a.model or str(REPO / "data" / "models" / "demo")
    argv = ["--backend", "openai", "--base-url", proxy.url, "--endpoint", "/v1/completions", "--model", "bench",
            "--tokenizer", tokenizer, "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len",
            str(a.prefix_len), "--prefix-repetition-suffix-len", str(a.suffix_len),
            "--prefix-repetition-num-prefixes", str(a.prefixes), "--prefix-repetition-output-len", str(a.output_len),
            "--ignore-eos", "--num-prompts", str(a.prompts), "--max-concurrency", str(a.clients),
            "--request-rate", "inf", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
            "--seed", str(seed), "--disable-tqdm"]
    before = {r.name: scrape(r) for r in router.replicas}
    events_before = {r.name: (r.events, r.unchained) for r in router.replicas}
    first = len(router.log)
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    done = subprocess.run([sys.executable, "-m", "bench.scenarios.gateway_overhead", "--vllm-bench", str(out), "--",
                           *argv], cwd=REPO, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vLLM's benchmark failed ({tag}):\n{done.stderr[-3000:]}")
    proxy.check()
    r = json.loads(out.read_text())
    queries = hits = 0.0
    per = {}
    for rep in router.replicas:
        use = cache_over(before[rep.name], scrape(rep))
        per[rep.name] = {"hit_pct": use.hit_pct if use else None,
                         "events": rep.events - events_before[rep.name][0], "held_blocks": len(rep.held),
                         "unchained_blocks": rep.unchained - events_before[rep.name][1]}
        if use is not None:
            queries, hits = queries + use.queries, hits + use.hits
    seen = router.log[first:]
    with_blocks = [x for x in seen if x["blocks"]]
    best = [x for x in with_blocks if x["best_held"]]
    cold = [x for x in with_blocks if not x["best_held"]]
    return {"tag": tag, "policy": router.policy, "seed": seed, "prompts": a.prompts,
            "completed": r.get("completed"), "failed": int(r.get("failed") or 0),
            "request_s": r.get("request_throughput"), "output_tok_s": r.get("output_throughput"),
            "ttft_p50_ms": r.get("median_ttft_ms"), "ttft_p99_ms": r.get("p99_ttft_ms"),
            "e2el_p95_ms": r.get("p95_e2el_ms"), "wall_s": r.get("duration"),
            "hit_pct": round(100 * hits / queries, 1) if queries else None, "replicas": per,
            "errors": sorted({str(e)[:300] for e in r.get("errors") or [] if e})[:5],
            # by the events, when each request was routed: was it sent where the longest cached prefix was?
            "on_longest_pct": round(100 * sum(x["chosen_held"] == x["best_held"] for x in best) / len(best), 1)
            if best else None,
            "held_there_pct": round(100 * sum(x["chosen_held"] for x in with_blocks)
                                    / max(1, sum(x["best_held"] for x in with_blocks)), 1) if with_blocks else None,
            # prompts no replica held any of, by the events
            "cold_pct": round(100 * len(cold) / len(with_blocks), 1) if with_blocks else None,
            "decision_us": {"p50": _pct([x["decision_us"] for x in seen], 0.5),
                            "p99": _pct([x["decision_us"] for x in seen], 0.99)},
            "choice_us": {"p50": _pct([x["choice_us"] for x in seen], 0.5),
                          "p99": _pct([x["choice_us"] for x in seen], 0.99)}}


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for policy in dict.fromkeys(POLICIES):
        rs = [r for r in runs if r["policy"] == policy]
        if not rs:
            continue

        def mean(k: str, rs: list[dict[str, Any]] = rs) -> float | None:
            vals = [r[k] for r in rs if r.get(k) is not None]
            return round(statistics.fmean(vals), 2) if vals else None

        rows.append({"policy": policy, "runs": len(rs), "request_s": mean("request_s"),
                     "ttft_p50_ms": mean("ttft_p50_ms"), "ttft_p99_ms": mean("ttft_p99_ms"),
                     "hit_pct": mean("hit_pct"), "on_longest_pct": mean("on_longest_pct"),
                     "held_there_pct": mean("held_there_pct"), "cold_pct": mean("cold_pct"),
                     "choice_us_p99": max((r["choice_us"]["p99"] or 0) for r in rs),
                     "decision_us_p99": max((r["decision_us"]["p99"] or 0) for r in rs),
                     "failed": sum(int(r["failed"]) for r in rs)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| policy | runs | req/s | TTFT P50 ms | TTFT P99 ms | vLLM prefix-cache hits % | sent to the longest "
             "cached prefix % | of the blocks cached anywhere, held where it went % | held by none % | choice µs P99 "
             "| with tokenizing µs P99 | failed |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cells = [r["policy"], r["runs"], *(("–" if r[k] is None else f"{r[k]:.1f}") for k in (
            "request_s", "ttft_p50_ms", "ttft_p99_ms", "hit_pct", "on_longest_pct", "held_there_pct", "cold_pct",
            "choice_us_p99", "decision_us_p99")), r["failed"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    replica_and_load_options(p)
    p.add_argument("--prompts", type=int, default=240, help="requests per run (≥ 30 s of them on a GPU; vLLM's dataset "
                   "makes a multiple of --prefixes)")
    p.add_argument("--rounds", type=int, default=1, help="the policies in --policies' order each")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=sorted(set(POLICIES)))


def run(a: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "pending_s": PENDING_S, "runs": []}

    def save() -> None:
        report["summary"] = summary(report["runs"])
        (a.out / "routing-events.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "routing-events.md").write_text(table(report["summary"]) + "\n")

    tokenizer = AutoTokenizer.from_pretrained(a.model or str(REPO / "data" / "models" / "demo"))
    folder = Path(tempfile.mkdtemp(prefix="llmops-kv-events-"))  # 0700: the events carry the prompts' tokens
    try:
        with replicas_up(a, folder) as reps:
            router = Router(reps, tokenizer)
            proxy = Proxy(router)
            proxy.start()
            try:
                n = 0
                for _ in range(a.rounds):
                    for policy in a.policies:
                        router.policy = policy
                        for rep in reps:
                            rep.evict_keys = policy == "prefix_evictions"
                        n += 1
                        row = run_once(router, proxy, a, folder, f"{n:02d}-{policy}")
                        report["runs"].append(row)
                        print(json.dumps(row), flush=True)
                        save()
            finally:
                proxy.close()
                for rep in reps:  # kept when a run fails too
                    shutil.copy(rep.log, a.out / rep.log.name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(table(report["summary"]))
