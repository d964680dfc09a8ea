"""Built-in benchmarks with vLLM's own benchmark module, against the gateway, stored per settings revision.

A *sweep* runs one preset at several client concurrencies on the running revision. A *guided search* tries
max_num_seqs values (each applied as a revision, with the gateway's zero-drop restart), benchmarks each at a
saturating concurrency, restores the original settings, and proposes the value with the best throughput whose
P95 end-to-end latency meets a target, as a revision the operator can apply. Runs are one at a time.

Every level sends fresh prompts: vLLM's random dataset is drawn from a new seed each time (recorded with the
level), because the same prompts a second time are served from vLLM's prefix cache (on an H200, +26 % output
tokens/s and TTFT P50 120 against 306 ms at a 96 % hit rate): a benchmark of the cache, not of the settings. Each
level also records the share of prompt tokens vLLM found in its prefix cache (its own /metrics counters, before
and after the level), and warns when it is high.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
from sqlmodel import col, select

from engine.aio import cancel_and_wait
from engine.benchmarks.runner import RESULT_PREFIX
from engine.db import BenchmarkRun, Database
from engine.errors import EngineError
from engine.events import EventLog
from engine.gateway import Ledger
from engine.metrics import CacheUse, cache_use, parse
from engine.revisions import RevisionStore, resolve_local_model
from engine.serving import Controller
from engine.vllm import at_nice, child_env

log = logging.getLogger("llmops.benchmarks")

PRESETS: dict[str, dict[str, Any]] = {
    "short_chat": {"title": "Short chat", "input_len": 128, "output_len": 128, "num_prompts": 64},
    "rag": {"title": "Long-prompt RAG", "input_len": 1536, "output_len": 64, "num_prompts": 32},
    "summarize": {"title": "Batch summarise", "input_len": 1024, "output_len": 256, "num_prompts": 32},
}
KEPT = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "p50_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p95_tpot_ms", "mean_itl_ms",
        "p50_itl_ms", "p95_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p50_e2el_ms", "p95_e2el_ms", "p99_e2el_ms",
        "total_input_tokens", "total_output_tokens")
CACHE_TEST_PCT = 20.0  # a level with more of its prompt tokens found in the prefix cache measured the cache
CACHE_WARNING = "prompts were served from the prefix cache: the figures are a cache test"
SEED_MAX = 2**31 - 1


class BenchmarkBusyError(EngineError):
    """A benchmark is already running: one at a time."""


def lengths(preset: str, max_model_len: int) -> tuple[int, int]:
    """The preset's input and output lengths, shrunk to fit max_model_len (random prompts vary by ±10 %)."""
    p = PRESETS[preset]
    inp, out = int(p["input_len"]), int(p["output_len"])
    room = int(max_model_len * 0.85)
    if inp + out > room:
        scale = room / (inp + out)
        inp, out = max(8, int(inp * scale)), max(4, int(out * scale))
    return inp, out


def fresh_seed() -> int:
    """A seed for vLLM's random dataset that no earlier level used (in all likelihood: 1 in 2^31)."""
    return 1 + secrets.randbelow(SEED_MAX)


def cache_warning(hit_pct: float | None) -> str | None:
    """The warning a level gets when its prompts were largely served from vLLM's prefix cache."""
    if hit_pct is None or hit_pct <= CACHE_TEST_PCT:
        return None
    return f"{CACHE_WARNING} ({hit_pct:.0f} % of prompt tokens were found in it)"


def level_command(*, base_url: str, model: str, tokenizer: str, input_len: int, output_len: int, num_prompts: int,
                  concurrency: int, tag: str, seed: int) -> list[str]:
    """vLLM's benchmark for one level (engine/benchmarks/runner.py), its random prompts drawn from ``seed``."""
    return [sys.executable, "-m", "engine.benchmarks.runner", "--base-url", base_url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts), "--max-concurrency",
            str(concurrency), "--ignore-eos", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,95,99", "--header", f"x-llmops-client={tag}", "--seed", str(seed),
            "--label", tag]


REPO = Path(__file__).resolve().parents[2]  # where `python -m engine.benchmarks.runner` finds the package


def bench_env(environ: Mapping[str, str], hf_token: str | None = None) -> dict[str, str]:
    """The benchmark's environment: the allow-listed part of the engine's (engine/vllm/command.py child_env),
    nothing of the engine's own (no LLMOPS_* setting: the admin password, the hub token, tokens). A hub tokenizer
    gets the hub token as HF_TOKEN, as vLLM does."""
    env = child_env(environ)
    if hf_token:
        env["HF_TOKEN"] = hf_token
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Benchmarks:
    def __init__(self, db: Database, revisions: RevisionStore, events: EventLog, controller: Controller,
                 ledger: Ledger, gateway_url: str,
                 energy: Callable[[], float | None], gateway_key: Callable[[], str | None] = lambda: None,
                 revoke: Callable[[str], object] = lambda _: None) -> None:
        self.db = db
        self.revisions = revisions
        self.events = events
        self.controller = controller
        self.ledger = ledger
        self.gateway_url = gateway_url
        self.energy = energy
        self.gateway_key = gateway_key  # mints a /v1 key for a run when the gateway requires keys
        self._revoke = revoke
        config_token = controller.config.hf_token
        self.hf_token = config_token.get_secret_value() if config_token else None
        self._key: str | None = None
        self._closing = False
        self._task: asyncio.Task[None] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._starting = asyncio.Lock()
        self.deployment_id = revisions.deployment_id  # whose benchmarks these are
        with db.session() as s:  # runs of an engine that stopped mid-run never finish
            for stale in s.exec(select(BenchmarkRun).where(BenchmarkRun.status == "running",
                                                           BenchmarkRun.deployment_id == self.deployment_id)).all():
                stale.status, stale.error = "failed", "the engine stopped during the run"
                stale.finished_at = time.time()
                s.add(stale)

    # --- storage ------------------------------------------------------------------------------------------

    def get(self, run_id: int) -> BenchmarkRun | None:
        """One of this deployment's runs."""
        with self.db.read() as s:
            run = s.get(BenchmarkRun, run_id)
            return run if run is not None and run.deployment_id == self.deployment_id else None

    def list(self, revision: int | None = None, limit: int = 50) -> list[BenchmarkRun]:
        with self.db.read() as s:
            q = select(BenchmarkRun).where(BenchmarkRun.deployment_id == self.deployment_id) \
                .order_by(col(BenchmarkRun.id).desc()).limit(limit)
            if revision is not None:
                q = q.where(BenchmarkRun.revision_id == revision)
            return list(s.exec(q).all())

    def _save(self, run: BenchmarkRun) -> BenchmarkRun:
        with self.db.session() as s:
            merged = s.merge(run)
        return merged

    # --- starting -----------------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self, kind: str, preset: str, params: dict[str, Any], author: str) -> BenchmarkRun:
        """Begin a run in the background (on the event loop; its SQLite writes on a thread)."""
        async with self._starting:  # a second start meanwhile waits, then finds this one running
            if self.busy:
                raise BenchmarkBusyError("a benchmark is already running; wait for it or cancel it")
            run = await asyncio.to_thread(self._save, BenchmarkRun(
                kind=kind, preset=preset, params=params, author=author, deployment_id=self.deployment_id,
                revision_id=self.controller.running.id if self.controller.running else None,
                progress={"stage": "starting", "done": 0, "total": 0}))
            assert run.id is not None
            await self.events.emit("benchmark_started", f"{kind} {run.id} ({preset}) by {author}",
                                   revision_id=run.revision_id, data={"benchmark": run.id, **params})
            self._task = asyncio.create_task(self._execute(run), name=f"benchmark-{run.id}")
            return run

    async def cancel(self, run_id: int) -> BenchmarkRun | None:
        """Stop a running run (it winds down in the background; a search restores the original settings); the
        run, or None when it is not the one running."""
        run = await asyncio.to_thread(self.get, run_id)
        if run is None or run.status != "running" or not self.busy or self._task is None:
            return None
        self._task.cancel()
        return run

    async def close(self) -> None:
        """At engine shutdown: a search's original settings are written back, without waiting for a start."""
        self._closing = True
        await cancel_and_wait(self._task)

    async def _execute(self, run: BenchmarkRun) -> None:
        try:
            if run.kind == "search":
                await self._search(run)
            else:
                await self._sweep(run)
            run.status = "done"
        except asyncio.CancelledError:
            run.status, run.error = "cancelled", "cancelled" + (" by an engine shutdown" if self._closing else "")
            if run.kind == "search":
                await asyncio.shield(self._restore(run, wait=not self._closing))
            raise
        except Exception as exc:  # a background run: its failure is stored, evented and logged
            log.exception("benchmark %s failed", run.id)
            run.status, run.error = "failed", f"{type(exc).__name__}: {exc}"
            if run.kind == "search":
                await self._restore(run)
        finally:
            if self._proc is not None and self._proc.returncode is None:
                self._proc.kill()  # no benchmark load left behind, whatever ended the run
            if self._key is not None:
                self._revoke(self._key)
                self._key = None
            run.finished_at = time.time()
            run.progress = {**run.progress, "stage": run.status}
            await asyncio.to_thread(self._save, run)
            await self.events.emit("benchmark_finished", f"{run.kind} {run.id}: {run.status}"
                                   + (f" ({run.error})" if run.error else ""),
                                   severity="info" if run.status == "done" else "warning",
                                   revision_id=run.revision_id, data={"benchmark": run.id, "proposal": run.proposal})

    # --- one level ----------------------------------------------------------------------------------------

    async def _level(self, run: BenchmarkRun, concurrency: int, num_prompts: int, stage: str) -> dict[str, Any]:
        """vLLM's benchmark at one concurrency, through the gateway, with progress from the request ledger."""
        rev = self.controller.running
        if rev is None or self.controller.sm.state != "ready":
            raise RuntimeError(f"vLLM is not ready ({self.controller.sm.state}): cannot benchmark")
        values = rev.values
        max_len = values.get("max_model_len") or 2048
        inp, out = lengths(run.preset, int(max_len))
        local = resolve_local_model(str(values["model"]), self.controller.config.data_dir.resolve())
        tag = f"bench-{run.id}-{stage}-c{concurrency}"
        given = run.params.get("seed")  # a seed asked for on purpose: the same prompts at every level (a cache test)
        seed = int(given) if isinstance(given, int) else fresh_seed()
        args = level_command(base_url=self.gateway_url, model=str(values["served_model_name"]),
                             tokenizer=str(local or values["model"]), input_len=inp, output_len=out,
                             num_prompts=num_prompts, concurrency=concurrency, tag=tag, seed=seed)
        scraped = await self._cache_counters()
        # SQLite and NVML off the event loop while it carries the benchmark's own traffic
        energy0, since = await asyncio.to_thread(self.energy), time.time()
        env = bench_env(os.environ, hf_token=None if local is not None else self.hf_token)
        if self._key is None:
            self._key = self.gateway_key()  # one key per run, revoked when it ends
        if self._key:  # vLLM's benchmark sends OPENAI_API_KEY as its bearer token
            env["OPENAI_API_KEY"] = self._key
        args = at_nice(args, self.controller.config.vllm_nice)  # the client competes with vLLM as any client would
        self._proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE,
                                                          stderr=asyncio.subprocess.STDOUT, start_new_session=True,
                                                          cwd=str(REPO), env=env)
        assert self._proc.stdout is not None
        reader = asyncio.create_task(self._proc.stdout.read())
        while not reader.done():
            done = await asyncio.to_thread(self.ledger.count, since, tag)
            run.progress = {**run.progress, "stage": stage, "level_done": done, "level_total": num_prompts}
            await asyncio.to_thread(self._save, run)
            await asyncio.wait({reader}, timeout=1.0)
        await self._proc.wait()
        text = reader.result().decode("utf-8", "replace")
        line = next((ln for ln in text.splitlines() if ln.startswith(RESULT_PREFIX)), None)
        if line is None:
            raise RuntimeError(f"vLLM's benchmark gave no result (exit {self._proc.returncode}): {text[-600:]}")
        result = json.loads(line[len(RESULT_PREFIX):])
        run.progress = {**run.progress, "level_done": result.get("completed"), "level_total": num_prompts}
        energy1 = await asyncio.to_thread(self.energy)
        use = await self._cache_use(scraped)
        hit_pct = use.hit_pct if use is not None else None
        level = {"concurrency": concurrency, "revision": rev.id, "input_len": inp, "output_len": out, "seed": seed,
                 **{k: result.get(k) for k in KEPT},
                 "prefix_cache_hit_pct": hit_pct, "prefix_cache_queries": None if use is None else int(use.queries)}
        warning = cache_warning(hit_pct)
        if warning is not None:
            level["warnings"] = [warning]
        if energy0 is not None and energy1 is not None and energy1 > energy0:
            level["energy_j"] = round(energy1 - energy0, 1)
            level["tokens_per_joule"] = round((result.get("total_output_tokens") or 0) / (energy1 - energy0), 3)
        return level

    async def _cache_counters(self) -> dict[str, str]:
        """The text of each serving instance's /metrics now, by its address (an instance that does not answer is
        left out: its level gets no hit rate rather than a wrong one)."""
        instances = [i for i in list(self.controller.instances) if i.serving and i.child.started]
        texts: dict[str, str] = {}
        async with httpx.AsyncClient(timeout=5.0) as client:
            for inst in instances:
                try:
                    resp = await client.get(f"{inst.child.url}/metrics", headers=inst.child.headers)
                    resp.raise_for_status()
                except httpx.HTTPError as exc:
                    log.warning("benchmark: no /metrics from instance %s: %s", inst.name, exc)
                    continue
                texts[inst.child.url] = resp.text
        return texts

    async def _cache_use(self, before: dict[str, str]) -> CacheUse | None:
        """The prefix cache's lookups and hits over a level, summed over the instances that served it."""
        after = await self._cache_counters()
        total: CacheUse | None = None
        for url, text in after.items():
            now = parse(text, time.time())
            earlier = parse(before[url], 0.0) if url in before else None
            use = cache_use(now, earlier)
            if use is not None:
                total = use if total is None else total + use
        return total

    # --- a sweep ------------------------------------------------------------------------------------------

    async def _sweep(self, run: BenchmarkRun) -> None:
        levels = [int(c) for c in run.params["concurrency"]]
        num = int(run.params.get("num_prompts") or PRESETS[run.preset]["num_prompts"])
        for i, concurrency in enumerate(levels):
            run.progress = {"stage": f"concurrency {concurrency}", "done": i, "total": len(levels)}
            run.results = [*run.results, await self._level(run, concurrency, max(num, concurrency),
                                                           f"c{concurrency}")]
            await asyncio.to_thread(self._save, run)
        run.progress = {**run.progress, "done": len(levels)}

    # --- a guided search ------------------------------------------------------------------------------------

    async def _search(self, run: BenchmarkRun) -> None:
        candidates = sorted({int(c) for c in run.params["candidates"]})
        target = float(run.params["target_p95_s"])
        num = int(run.params.get("num_prompts") or PRESETS[run.preset]["num_prompts"])
        origin = await asyncio.to_thread(self.revisions.desired_revision)
        if origin is None:
            raise RuntimeError("no desired revision to search from")
        run.params = {**run.params, "origin_revision": origin.id}
        for i, seqs in enumerate(candidates):
            run.progress = {"stage": f"max_num_seqs {seqs}: applying", "done": i, "total": len(candidates)}
            await asyncio.to_thread(self._save, run)
            rev_id = await self._apply({**origin.values, "max_num_seqs": seqs},
                                       f"guided search {run.id}: max_num_seqs={seqs}")
            if rev_id is None:
                run.results = [*run.results, {"max_num_seqs": seqs, "error": "did not become ready"}]
                continue
            level = await self._level(run, max(2, 2 * seqs), max(num, 4 * seqs), f"seqs{seqs}")
            run.results = [*run.results, {"max_num_seqs": seqs, **level}]
            await asyncio.to_thread(self._save, run)
        await self._restore(run)
        run.proposal = propose(run.results, target)
        run.progress = {**run.progress, "done": len(candidates), "stage": "done"}

    async def _apply(self, values: dict[str, Any], note: str, wait: bool = True) -> int | None:
        """Write a revision and wait until it is ready (its id) or rolled back (None)."""
        rev = await asyncio.to_thread(self.revisions.create_revision, values, base_revision=None,
                                      author="benchmark", note=note)
        assert rev.id is not None
        self.controller.wake()
        if not wait:
            return rev.id
        deadline = time.monotonic() + self.controller.config.startup_timeout_s + 120
        while time.monotonic() < deadline:
            running = self.controller.running
            if self.controller.sm.state == "ready" and running is not None and running.id == rev.id:
                return rev.id
            if (await asyncio.to_thread(self.revisions.get_revision, rev.id)).status == "rejected":
                return None
            await asyncio.sleep(0.5)
        raise TimeoutError(f"revision {rev.id} did not become ready")

    async def _restore(self, run: BenchmarkRun, wait: bool = True) -> None:
        origin_id = run.params.get("origin_revision")
        if origin_id is None:
            return
        origin = await asyncio.to_thread(self.revisions.get_revision, int(origin_id))
        current = await asyncio.to_thread(self.revisions.desired_revision)
        if current is not None and current.values == origin.values:
            return
        run.progress = {**run.progress, "stage": "restoring the original settings"}
        await asyncio.to_thread(self._save, run)
        await self._apply(origin.values, f"guided search {run.id}: restore revision {origin_id}", wait)


def propose(results: list[dict[str, Any]], target_p95_s: float) -> dict[str, Any] | None:
    """The max_num_seqs with the best output throughput whose P95 end-to-end latency meets the target."""
    ok = [r for r in results if r.get("output_throughput") and r.get("p95_e2el_ms") is not None]
    meeting = [r for r in ok if r["p95_e2el_ms"] / 1000 <= target_p95_s]
    if not meeting:
        return None
    best = max(meeting, key=lambda r: r["output_throughput"])
    one = next((r for r in ok if r["max_num_seqs"] == 1), None)
    return {"max_num_seqs": best["max_num_seqs"], "output_throughput": round(best["output_throughput"], 2),
            "p95_e2e_s": round(best["p95_e2el_ms"] / 1000, 3), "target_p95_s": target_p95_s,
            "gain_over_max_num_seqs_1": round(best["output_throughput"] / one["output_throughput"], 2) if one else None}
