"""The system tier's session engine, with the real vLLM (the CPU build): what clients and operators do to it, in
the order a person would — serve through /v1, measure, apply under streaming load, change max_num_seqs within its
ceiling, benchmark, survive a crash, stop and start, serve a second deployment beside it. Every plan and fault is
proven in milliseconds in the serving tier; here each journey runs once against the real thing."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.schemas import BenchmarkRunOut, GatewayCounts, GatewayWorkerOut, KpiRow, StatusOut
from engine.vllm import group_members
from tests.system.test_adapters_system import ADAPTER, register_demo_adapter
from tests.testkit.engine import COLD_START_S, ENGINE_ONLY_ENV, HF_TOKEN, EngineHandle
from tests.testkit.load import PAUSE_BOUND_S, Load, longest_gap, summary
from tests.testkit.wait import wait_until

# Streaming clients while max_num_seqs changes within its ceiling: more than any max_num_seqs tried, so some wait.
CLIENTS = 8
# During the apply: clients that always have a request in flight or about to be (a pause would fail or hold them),
# each with a short wait between requests so that the new instance, started at a low priority beside the one that
# serves, gets some of the two cores: with 8 back-to-back clients the start took 300 s on CI, with this about a
# minute. The figure under 16 back-to-back clients is `python -m bench apply-gap`'s.
APPLY_CLIENTS, APPLY_PAUSE_S = 4, 0.5
CEILING = 8  # the max_num_seqs vLLM runs with after the apply: max_num_seqs changes below it restart nothing


def last_run_args(handle: EngineHandle) -> str:
    """vLLM's own "non-default args" line of its latest start."""
    lines = re.findall(r"non-default args: (\{.*\})", handle.vllm_log())
    assert lines, "vLLM logged no non-default args line"
    return str(lines[-1])


def test_completion_through_the_gateway(engine: EngineHandle) -> None:
    resp = httpx.post(f"{engine.url}/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": "Return the value of the", "max_tokens": 12,
                            "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "demo"
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] >= 1
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_streamed_chat_arrives_in_chunks(engine: EngineHandle) -> None:
    chunks: list[dict[str, object]] = []
    done = False
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", timeout=60,
                      json={"model": "demo", "messages": [{"role": "user", "content": "Describe a file."}],
                            "max_tokens": 16, "stream": True, "temperature": 0.8, "seed": 1}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done
    assert len(chunks) >= 3  # role chunk, at least one content chunk, the finish chunk
    assert chunks[0]["object"] == "chat.completion.chunk"


def test_a_gateway_worker_serves_v1_on_the_data_port_and_one_killed_is_started_again(engine: EngineHandle) -> None:
    """Issue 32, item 3, with real vLLM: the session engine has one gateway worker (tests/conftest.py)."""
    info = engine.client.gateway()
    assert info.data_base_url is not None and [w.alive for w in info.workers] == [True]
    data, before = info.data_base_url, info.workers[0]

    def chat() -> list[str]:
        with httpx.stream("POST", f"{data}/chat/completions", timeout=60,
                          json={"model": "demo", "messages": [{"role": "user", "content": "Name a file."}],
                                "max_tokens": 8, "stream": True}) as resp:
            assert resp.status_code == 200, resp.read()
            return [line for line in resp.iter_lines() if line.startswith("data: ")]

    lines = chat()
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3
    assert not any('"usage"' in line for line in lines)  # asked of vLLM for the ledger, hidden as on the engine's port
    models = httpx.get(f"{data}/models", timeout=30).json()
    assert [m["id"] for m in models["data"]][:1] == ["demo"]
    elsewhere = httpx.get(data.removesuffix("/v1") + "/api/status", timeout=30)
    assert elsewhere.status_code == 404 and f"port {engine.port}" in elsewhere.json()["error"]["message"]
    after = engine.client.gateway().workers[0]
    assert after.requests >= before.requests + 1 and after.in_flight == 0
    assert before.pid is not None
    os.kill(before.pid, signal.SIGKILL)
    def replaced() -> GatewayWorkerOut | None:
        worker = engine.client.gateway().workers[0]
        return worker if worker.alive and worker.pid != before.pid else None

    again = wait_until(replaced, 30, what="the gateway worker started again")
    assert again.restarts == before.restarts + 1 and again.last_exit == -signal.SIGKILL
    assert chat()[-1] == "data: [DONE]"


def test_simple_generate_endpoint(engine: EngineHandle) -> None:
    resp = httpx.post(f"{engine.url}/v1/generate", json={"prompt": "This module", "max_tokens": 8}, timeout=60)
    assert resp.status_code == 200
    assert isinstance(resp.json()["result"], str)


def test_hub_token_reaches_vllm_through_its_environment_only(engine: EngineHandle) -> None:
    pid = engine.client.status().pid
    assert pid is not None
    vllm = psutil.Process(pid)
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    assert f"HF_TOKEN={HF_TOKEN}" in environ
    names = {item.partition("=")[0] for item in environ}
    assert names & {*ENGINE_ONLY_ENV, "LLMOPS_ADMIN_PASSWORD", "LLMOPS_HF_TOKEN"} == set()  # an allow-list
    assert "VLLM_API_KEY" in names  # the instance's own key: its /v1 answers the gateway only
    port = engine.client.status().instances[0].port  # vLLM's own port: no key, no answer
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                        json={"model": "demo", "prompt": "x", "max_tokens": 1})
    assert direct.status_code == 401
    # nor any other path of it (vLLM's own key guarded /v1 only: /invocations served completions to anyone)
    for path in ("/invocations", "/tokenize", "/detokenize", "/metrics", "/health", "/docs", "/openapi.json",
                 "/load", "/scale_elastic_ep", "/v1/models"):
        resp = httpx.post(f"http://127.0.0.1:{port}{path}", timeout=30, json={"model": "demo", "prompt": "x"})
        assert resp.status_code == 401, (path, resp.status_code, resp.text[:200])
    key = dict(item.split("=", 1) for item in environ if "=" in item)["VLLM_API_KEY"]
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=30,
                     headers={"authorization": f"Bearer {key}"}).status_code == 200  # the engine's probes do so
    # vLLM works in the data dir: a relative --model (a hub id) cannot name a folder where the engine was started
    assert Path(os.readlink(f"/proc/{pid}/cwd")) == engine.data_dir.resolve()
    assert not any(HF_TOKEN in arg for p in [vllm, *vllm.children(recursive=True)] for arg in p.cmdline())
    places = {"vLLM's log": engine.vllm_log(),
              "engine output": (engine.data_dir / "engine-stdout.log").read_text(errors="replace"),
              "engine log": (engine.data_dir / "logs" / "engine.log").read_text(errors="replace"),
              "events": str([e.model_dump() for e in engine.client.events(limit=5000)]),
              "audit": str(engine.client.audit(limit=10_000)), "status": engine.client.status().model_dump_json()}
    assert [where for where, text in places.items() if HF_TOKEN in text or engine.token in text] == []


def test_bad_input_gets_422_and_no_revision(engine: EngineHandle) -> None:
    before = engine.client.settings().revision
    resp = httpx.put(f"{engine.url}/api/settings", headers=engine.auth,
                     json={"base_revision": before, "values": {"max_num_seqs": 0, "dtype": "int4"}})
    assert resp.status_code == 422
    assert {e["loc"][-1] for e in resp.json()["detail"]} == {"max_num_seqs", "dtype"}
    assert engine.client.settings().revision == before
    assert engine.client.status().state == "ready"


def test_an_apply_under_streaming_load_never_pauses(engine: EngineHandle) -> None:
    """The zero-pause bar (issue 14): clients stream in a loop while a new max_num_seqs (and a ceiling above it) is
    applied. The plan, shown before the write, is blue/green (two demo instances fit this host); the new instance
    starts beside the old one, takes the traffic, and the old one drains: no request fails and something serves
    throughout.

    What must always hold is asserted: 0 failed, the engine never had nothing serving, the plan ran. How long
    clients went without a completed request is a figure of this machine's load (1.3-2.6 s seen on a busy 2-core
    host), measured by `python -m bench apply-gap`; the bound here only tells a pause (a whole start, 30 s or more)
    from a blue/green apply, with a margin that holds on a shared CI machine."""
    old = engine.client.status()
    assert old.pid is not None and len(old.instances) == 1
    change = {"max_num_seqs": 5, "max_num_seqs_ceiling": CEILING}
    plan = engine.client.capacity(change).plan
    assert plan is not None and plan.kind == "blue_green" and plan.pause_s == 0
    register_demo_adapter(engine)  # and a LoRA adapter's clients: an apply keeps it (the new instance starts with it)
    load = Load(engine.url, clients=APPLY_CLIENTS, stream=True, pause_s=APPLY_PAUSE_S).start()
    tuned = Load(engine.url, clients=1, stream=True, pause_s=APPLY_PAUSE_S, model=ADAPTER).start()
    load.wait_for(8, timeout=120)  # traffic flows before the change
    t0 = time.monotonic()
    rev = engine.client.put_settings(old.desired_revision or 0, change, "test: smaller batch, with headroom")
    seen: list[int] = []
    starting_nice: set[int] = set()  # the new instance's priority while it starts beside the one that serves

    def starting_pids(status: StatusOut) -> set[int]:
        return {i.pid for i in status.instances if i.role == "starting" and i.pid is not None}

    def applied() -> StatusOut | None:
        status = engine.client.status()
        seen.append(len(status.instances))
        sampled: dict[int, int] = {}
        for pid in starting_pids(status):
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if time.time() - proc.create_time() > 1.0:  # past the fork and `nice`'s own exec (the engine's
                    sampled[pid] = proc.nice()  # priority until then: CI saw -10 once, in the sandbox's start)
        if sampled:  # a sample counts only if the instance still starts after it: one that began to serve in
            # between is reniced to vllm_nice (the role changes with the renice, so a later "starting" is proof)
            still = starting_pids(engine.client.status())
            starting_nice.update(nice for pid, nice in sampled.items() if pid in still)
        done = status.apply is not None and status.apply.revision == rev.revision and status.apply.outcome != "running"
        return status if done else None

    status = wait_until(applied, COLD_START_S, every=0.2, what="the apply's end")
    t1 = time.monotonic()
    after = load.count()
    load.wait_for(after + 8, timeout=120)  # and flows on the new instance
    tuned.wait_for(tuned.count() + 2, timeout=120)
    outcomes = load.stop()
    counts = summary(outcomes)
    assert counts["ok"] == counts["total"], (counts, [o for o in outcomes if not o.ok][:3])
    adapter_outcomes = tuned.stop()
    assert all(o.ok for o in adapter_outcomes) and len(adapter_outcomes) >= 4, summary(adapter_outcomes)
    gap = longest_gap(outcomes, t0, t1)
    assert gap < PAUSE_BOUND_S, f"{gap:.2f} s with no completed request during the apply: that is a pause"
    assert status.apply is not None and status.apply.outcome == "applied" and status.apply.longest_gap_s in (None, 0)
    assert max(seen) == 2 and len(status.instances) == 1  # both side by side, then the new one alone
    assert status.running_revision == rev.revision and status.pid != old.pid
    # it started at start_beside_nice, the cores left to the instance that served; it serves at vllm_nice
    assert starting_nice == {19}, starting_nice
    refused = engine.client.events(kinds=["nice_refused"], since=0)
    assert psutil.Process(status.pid).nice() == 0 or refused, psutil.Process(status.pid).nice()
    # the state's reason says what serves now, not the apply's last step ("draining instance b", for minutes)
    assert "draining" not in status.reason and f"revision {rev.revision} serving" in status.reason, status.reason
    ready = httpx.get(f"{engine.url}/readyz", timeout=10).json()
    assert "draining" not in ready["reason"], ready
    new = status.instances[0].name
    wait_until(lambda: next(a for a in engine.client.adapters("demo") if a.name == ADAPTER).loaded_on == [new], 30,
               what="the adapter on the new instance")
    assert f"'max_num_seqs': {CEILING}" in last_run_args(engine)  # vLLM runs with the ceiling
    assert group_members(old.pid) == [] and not psutil.pid_exists(old.pid)
    assert engine.client.revision(rev.revision).status == "applied"
    assert engine.client.revision(old.running_revision or 0).status == "superseded"
    kinds = [e.kind for e in engine.client.events(kinds=["apply_plan", "starting", "ready", "drained", "stopped",
                                                          "apply_done"], since=0) if e.revision in (
        rev.revision, old.running_revision)]
    assert kinds[-6:] == ["apply_plan", "starting", "ready", "drained", "stopped", "apply_done"]


def with_ceiling(engine: EngineHandle) -> StatusOut:
    """The session engine serving with CEILING as its max_num_seqs_ceiling (the apply above left it so; alone, this
    test applies it first)."""
    base = engine.client.settings()
    if base.values.max_num_seqs_ceiling != CEILING:
        rev = engine.client.put_settings(base.revision, {"max_num_seqs": 2, "max_num_seqs_ceiling": CEILING},
                                         "test: headroom for max_num_seqs")
        return engine.client.wait_for({"ready"}, COLD_START_S, revision=rev.revision)
    return engine.client.wait_for({"ready"}, COLD_START_S)


def test_max_num_seqs_within_its_ceiling_takes_effect_without_a_restart(engine: EngineHandle) -> None:
    """vLLM's KV cache does not depend on max_num_seqs: started with a ceiling, the instance keeps running and the
    gateway holds it to each new max_num_seqs from the next request (the plan says so before the write)."""
    started = with_ceiling(engine)
    assert f"'max_num_seqs': {CEILING}" in last_run_args(engine)  # vLLM runs with the ceiling
    plan = engine.client.capacity({"max_num_seqs": 6}).plan
    assert plan is not None and plan.kind == "soft" and plan.pause_s == 0
    load = Load(engine.url, clients=CLIENTS, stream=True).start()
    try:
        load.wait_for(CLIENTS, timeout=300)
        for seqs in (6, 3):
            rev = engine.client.put_settings(engine.client.settings().revision, {"max_num_seqs": seqs},
                                             f"test: max_num_seqs {seqs}")
            status = engine.client.wait_for({"ready"}, 60, revision=rev.revision, poll=0.1)
            assert status.pid == started.pid and len(status.instances) == 1  # no restart
            # requests let in under the higher cap end as they would; none more are let in meanwhile
            wait_until(lambda: engine.client.status().gateway.in_flight <= seqs, 60, every=0.05,  # noqa: B023
                       what=f"the requests in flight down to {seqs}")
            # held to it: never more in flight, and some wait (8 clients; looked at until one is seen waiting,
            # as 20 looks in a row once found none between requests on CI)
            seen: list[GatewayCounts] = []

            def one_waits(seen: list[GatewayCounts] = seen) -> bool:  # (called in this turn of the loop)
                seen.append(engine.client.status().gateway)
                return seen[-1].waiting > 0

            wait_until(one_waits, 30, every=0.05, what=f"a request waiting for one of the {seqs} slots")
            assert max(g.in_flight for g in seen) <= seqs, seen
        outcomes = load.stop()
        assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
    finally:
        if not load._stop.is_set():
            load.stop()
    soft = [e for e in engine.client.events(kinds=["applied_soft"], limit=10, newest_first=True)]
    assert soft and "in effect now" in soft[0].message and "nothing restarts" in soft[0].message
    assert engine.client.revision(rev.revision).status == "applied"


TAG = {"x-llmops-client": "kpi-test"}


def stream_chat(url: str, include_usage: bool) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    body: dict[str, Any] = {"model": "demo", "messages": [{"role": "user", "content": "Describe a module."}],
                            "max_tokens": 8, "ignore_eos": True, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=TAG, timeout=120) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    usage = next((e["usage"] for e in events if e.get("usage")), None)
    return events, usage


def wait_run(engine: EngineHandle, run_id: int, timeout: float) -> BenchmarkRunOut:
    def ended() -> BenchmarkRunOut | None:
        run = engine.client.benchmark(run_id)
        return run if run.status != "running" else None

    return wait_until(ended, timeout, every=1, what=f"the end of benchmark {run_id}")


def test_kpis_from_a_known_set_of_requests(engine: EngineHandle) -> None:
    engine.client.wait_for({"ready"}, COLD_START_S)
    prompt_tokens = []
    for i in range(6):
        resp = httpx.post(f"{engine.url}/v1/completions", headers=TAG, timeout=120,
                          json={"model": "demo", "prompt": "Return the value " * (i + 1), "max_tokens": 8,
                                "ignore_eos": True})
        assert resp.status_code == 200
        prompt_tokens.append(resp.json()["usage"]["prompt_tokens"])
        assert resp.json()["usage"]["completion_tokens"] == 8
    events, usage = stream_chat(engine.url, include_usage=True)
    assert usage is not None and usage["completion_tokens"] == 8  # asked for: passed through
    for _ in range(3):
        events, hidden = stream_chat(engine.url, include_usage=False)
        assert hidden is None and all(e.get("choices") for e in events)  # not asked for: the gateway's own is hidden
        prompt_tokens.append(usage["prompt_tokens"])
    prompt_tokens.append(usage["prompt_tokens"])
    rows = engine.client.kpis("10m", client="kpi-test")
    assert len(rows) == 1
    k = rows[0]
    assert k.revision == engine.client.status().running_revision
    assert (k.requests, k.succeeded, k.error_rate) == (10, 10, 0.0)
    assert k.avg_output_tokens == 8.0
    assert k.avg_input_tokens == pytest.approx(sum(prompt_tokens) / 10)
    assert k.latency_p50_s is not None and k.latency_p95_s is not None and k.latency_p99_s is not None
    assert 0 < k.latency_p50_s <= k.latency_p95_s <= k.latency_p99_s
    assert k.ttft_p95_s is not None and k.ttft_p95_s <= k.latency_p99_s
    assert (k.output_tokens_per_s or 0) > 0
    metrics = httpx.get(f"{engine.url}/metrics", headers=engine.auth).text
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    ok = [s for s in families["llmops_requests"].samples
          if s.name == "llmops_requests_total" and s.labels["outcome"] == "ok"]
    assert sum(s.value for s in ok) >= 10


def test_benchmark_sweep_is_stored_under_its_revision(engine: EngineHandle) -> None:
    status = engine.client.wait_for({"ready"}, COLD_START_S)
    run = engine.client.start_sweep("short_chat", [1, 2], num_prompts=6)
    with pytest.raises(Exception, match="409"):
        engine.client.start_sweep("short_chat", [1])  # one run at a time
    done = wait_run(engine, run.id, 600)
    assert done.status == "done", done.error
    assert done.revision_id == status.running_revision
    assert [lv.concurrency for lv in done.results] == [1, 2]
    for level in done.results:
        assert level.completed == 6 and level.failed == 0 and (level.output_throughput or 0) > 0
        assert (level.p95_e2el_ms or 0) >= (level.p50_e2el_ms or 0) > 0
        assert level.tokens_per_joule is None  # no GPU energy counter here, so no invented figure
        # vLLM looked up every prompt token in its prefix cache (its /metrics counters over the level), and a level
        # past 20 % of them found there says it measured the cache, no other way round
        assert level.prefix_cache_queries is not None and level.prefix_cache_queries >= 6 * 100
        assert level.prefix_cache_hit_pct is not None
        assert bool(level.warnings) == (level.prefix_cache_hit_pct > 20), (level.prefix_cache_hit_pct, level.warnings)
    # fresh prompts: next to none found in the cache. Random prompts of the demo model's 2,048-token vocabulary can
    # still begin alike now and then (CI, 2026-12-06: one level of 6 prompts at 33 %, with its warning), so one
    # level may; prompts sent again (one seed for both) would put both far past it
    assert min(lv.prefix_cache_hit_pct or 0 for lv in done.results) <= 20, [lv.prefix_cache_hit_pct
                                                                           for lv in done.results]
    seeds = [lv.seed for lv in done.results]
    assert None not in seeds and len(set(seeds)) == 2  # each level its own prompts (they were both seed 0)
    listed = engine.client.benchmarks(revision=status.running_revision)
    assert run.id in [r.id for r in listed]
    compared = engine.client.compare_benchmarks(run.id, run.id)
    assert compared.levels[0].output_throughput.change_pct == 0.0


def test_the_same_prompts_again_are_a_cache_test_and_say_so(engine: EngineHandle) -> None:
    """A seed given on purpose sends the same long prompts at both levels: vLLM serves the second level's from its
    prefix cache (its own counters say so) and the level is flagged, as fixed seeds went unnoticed before."""
    engine.client.wait_for({"ready"}, COLD_START_S)
    run = engine.client.start_sweep("rag", [1, 1], num_prompts=3, seed=4242)
    done = wait_run(engine, run.id, 600)
    assert done.status == "done", done.error
    first, second = done.results
    assert first.seed == second.seed == 4242
    assert second.prefix_cache_hit_pct is not None and second.prefix_cache_hit_pct > 80  # whole 1.5k-token prompts
    assert (first.prefix_cache_hit_pct or 0) < (second.prefix_cache_hit_pct or 0)
    assert any("prompts were served from the prefix cache: the figures are a cache test" in w for w in second.warnings)


def test_guided_search_within_the_ceiling_proposes_a_valid_max_num_seqs_and_restores(engine: EngineHandle) -> None:
    """The search applies each candidate max_num_seqs, benchmarks it and restores the settings: under the ceiling
    vLLM runs with, each apply is in effect at once (the same vLLM process throughout)."""
    started = with_ceiling(engine)
    before = engine.client.settings()
    run = engine.client.start_search("short_chat", target_p95_s=120, candidates=[1, 2], num_prompts=4)
    done = wait_run(engine, run.id, 3 * COLD_START_S)
    assert done.status == "done", done.error
    assert [r.max_num_seqs for r in done.results] == [1, 2]
    proposal = done.proposal
    assert proposal is not None and proposal.p95_e2e_s <= 120
    best = max(done.results, key=lambda r: r.output_throughput or 0)  # both meet a 120 s target here
    assert proposal.max_num_seqs == best.max_num_seqs
    assert best.output_throughput and done.results[0].output_throughput
    assert proposal.gain_over_max_num_seqs_1 == pytest.approx(
        best.output_throughput / done.results[0].output_throughput, rel=0.01)
    after = engine.client.wait_for({"ready"}, COLD_START_S)
    assert engine.client.settings().values == before.values  # the original settings are back
    assert after.running_revision == engine.client.settings().revision
    assert after.pid == started.pid  # no restart: every candidate was within the ceiling


def test_sigkill_of_vllm_under_load_recovers_on_the_same_revision(engine: EngineHandle) -> None:
    before = engine.client.status()
    assert before.pid is not None and before.running_revision is not None
    load = Load(engine.url, clients=8).start()
    load.wait_for(16, timeout=120)
    marker = engine.client.events(limit=1, newest_first=True)[0].id
    killed_at = time.time()
    os.kill(before.pid, signal.SIGKILL)  # the API server only: its engine core and worker are left behind

    def exit_seen() -> float | None:  # the exit is seen through the process itself, not its log pipe or /health
        found = engine.client.events(kinds=["instance_exited"], since=marker)
        return found[0].ts.timestamp() if found else None

    seen_at = wait_until(exit_seen, 60, every=0.1, what="the instance_exited event")
    # at once on a quiet machine (`python -m bench crash-detect` measures it under load); the margin holds on a busy CI
    # host, where the engine core's held log pipe or three failed /health probes took 8-20 s before
    assert seen_at - killed_at < 5.0, f"the exit was seen {seen_at - killed_at:.1f} s after the SIGKILL"
    def replaced() -> StatusOut | None:
        status = engine.client.status()
        return status if status.state == "ready" and status.pid != before.pid else None

    after = wait_until(replaced, COLD_START_S, every=0.5, what="a new vLLM, ready")
    assert after.running_revision == before.running_revision
    seen = load.count()
    load.wait_for(seen + 16, timeout=120)
    outcomes = load.stop()
    counts = summary(outcomes)
    assert counts["exceptions"] == 0 and counts["other"] == 0, counts  # nothing left hanging or odd
    assert counts["ok"] + counts["503"] + counts["stream_errors"] == counts["total"]
    assert counts["ok"] >= 32
    assert after.pid != before.pid and group_members(before.pid) == []
    kinds = [e.kind for e in engine.client.events(kinds=["failed", "diagnosis", "restart_scheduled", "ready"])]
    assert kinds[-4:] == ["failed", "diagnosis", "restart_scheduled", "ready"]


def test_stop_and_start_leave_no_stray_process(engine: EngineHandle) -> None:
    pid = engine.client.status().pid
    assert pid is not None and len(group_members(pid)) >= 2  # API server plus engine core / worker
    engine.client.engine_action("stop")
    stopped = engine.client.wait_for({"stopped"}, 60)
    assert stopped.pid is None
    assert group_members(pid) == []
    resp = httpx.post(f"{engine.url}/v1/completions", json={"model": "demo", "prompt": "x"}, timeout=10)
    assert resp.status_code == 503 and "stopped" in resp.json()["error"]["message"]  # refused, not left waiting
    assert resp.headers["retry-after"]
    engine.client.engine_action("start")
    started = engine.client.wait_for({"ready"}, COLD_START_S)
    assert started.pid not in (None, pid)


def test_a_second_deployment_serves_beside_the_first_through_the_one_gateway(engine: EngineHandle) -> None:
    """Two deployments of the demo model on this host: each serves its own name through the one gateway, the first
    untouched while the second starts and goes (its apply and its failures: the serving tier; the figures:
    `python -m bench deployments`)."""
    a = engine.client.wait_for({"ready"}, COLD_START_S)
    # traffic on the first throughout, light enough to leave the second's start some of the two cores (4 clients
    # back to back stretched it to six minutes on CI)
    load = Load(engine.url, clients=2, stream=True, model="demo", pause_s=0.5).start()
    model = str(engine.data_dir / "models" / "demo")
    created = engine.client.create_deployment("demo-b", {"model": model, "max_num_seqs": 4,
                                                         "cpu_kv_cache_gib": 0.25}, note="test: a second name")
    b = engine.client.of("demo-b")
    try:
        ready_b = b.wait_for({"ready"}, COLD_START_S)
        assert ready_b.deployment == "demo-b" and ready_b.running_revision == created.revision
        assert ready_b.pid not in (None, a.pid)
        for name in ("demo", "demo-b"):  # one gateway, two names: each request reaches the deployment it names
            resp = httpx.post(f"{engine.url}/v1/completions", timeout=120,
                              json={"model": name, "prompt": "Return the", "max_tokens": 4})
            assert resp.status_code == 200 and resp.json()["model"] == name, resp.text
        listed = {m["id"] for m in httpx.get(f"{engine.url}/v1/models", timeout=30).json()["data"]
                  if m.get("parent") is None}  # (a LoRA adapter of demo is listed too, with demo as its parent)
        assert listed == {"demo", "demo-b"}
        rows = {d.name: d for d in engine.client.deployments()}
        assert rows["demo-b"].serving == 1 and rows["demo"].serving == 1
        assert {e.kind for e in engine.client.events(since=0, limit=5000) if e.revision == created.revision} == set()
    finally:
        try:
            pid = b.status().pid
            engine.client.delete_deployment("demo-b", confirm="demo-b")
            wait_until(lambda: "demo-b" not in {d.name for d in engine.client.deployments()}, 60, what="b deleted")
            if pid is not None:
                wait_until(lambda: (not group_members(pid) and not psutil.pid_exists(pid)) or None, 120,
                           what="b's vLLM stopped")
        finally:  # its clients stop whatever failed: left running, they kept every later test's engine busy
            outcomes = load.stop()
    counts = summary(outcomes)
    assert counts["ok"] == counts["total"], (counts, [o for o in outcomes if not o.ok][:3])  # a served throughout
    after = engine.client.status()
    assert after.pid == a.pid and after.running_revision == a.running_revision and after.state == "ready"


def test_idle_it_scales_to_zero_and_the_first_request_after_is_answered(engine: EngineHandle) -> None:
    """Issue 33 with the real vLLM (the CPU build): idle, the deployment scales to zero (stopped here: no sleep mode
    on CPU; no process of it is left), it is still listed, and the first request after waits for the cold start in
    the gateway's queue and is answered. Each decision is an event with its reason. Replicas that follow the load
    (1 -> 2 -> 1, 0 failed) with the real vLLM are `python -m bench autoscale`'s (docs/benchmarks.md): a second
    start beside one that serves cost this tier minutes on CI; every plan and fault of it is the serving tier's."""
    before = engine.client.wait_for({"ready"}, COLD_START_S)
    base = engine.client.settings()
    newest = engine.client.events(limit=1, newest_first=True)
    since = newest[0].id if newest else 0
    zero = engine.client.put_settings(base.revision, {"scale_to_zero_after_s": 5.0}, note="test: to zero")

    def scaled_to_zero() -> StatusOut | None:  # (its instance is gone a tick before the state says stopped)
        s = engine.client.status()
        return s if s.autoscale is not None and s.autoscale.asleep and not s.instances and s.state == "stopped" \
            else None

    try:
        asleep = wait_until(scaled_to_zero, 60, what="scaled to zero")
        assert "scaled to zero" in asleep.reason and asleep.pid is None
        assert asleep.autoscale is not None and asleep.autoscale.wake == "cold_start"
        assert before.pid is not None and group_members(before.pid) == []  # nothing of it left running
        listed = httpx.get(f"{engine.url}/v1/models", timeout=30).json()["data"]
        assert "demo" in {m["id"] for m in listed}  # asleep, still listed: a request for it wakes it
        resp = httpx.post(f"{engine.url}/v1/completions", timeout=COLD_START_S,
                          json={"model": "demo", "prompt": "Return the", "max_tokens": 4})
        assert resp.status_code == 200, resp.text  # it waited for the cold start in the gateway's queue
        decisions = engine.client.events(since=since, limit=500, kinds=["autoscale"])
        assert [e.data["action"] for e in decisions] == ["to_zero", "wake"]
        assert all(e.data["reason"] and "load" in e.data for e in decisions)
        assert engine.client.status().running_revision == zero.revision
    finally:
        current = engine.client.settings()
        engine.client.put_settings(current.revision, {"scale_to_zero_after_s": None}, note="test: never again")
        wait_until(lambda: (s := engine.client.status()).state == "ready" and len(s.instances) == 1, COLD_START_S,
                   what="serving again")


def test_the_responses_api_and_anthropic_messages_through_the_gateway_are_metered_as_vllm_counts_them(
        engine: EngineHandle) -> None:
    """Real vLLM's Responses API and Anthropic Messages, streamed and not, through the gateway: each answers, and
    the ledger (KPIs, usage, budgets) counts the tokens vLLM itself reported for it. They were passed on unmetered
    (the service tier proves the budgets over a stub; this proves vLLM's own shapes)."""
    engine.client.wait_for({"ready"}, COLD_START_S)
    tag = {"x-llmops-client": "named-events-test"}
    reported: list[tuple[int, int]] = []
    asks: list[tuple[str, dict[str, Any]]] = [
        ("/v1/responses", {"model": "demo", "input": "Describe a file.", "max_output_tokens": 8}),
        ("/v1/messages", {"model": "demo", "max_tokens": 8, "messages": [{"role": "user", "content": "Describe it."}]})]
    for path, body in asks:
        answer = httpx.post(f"{engine.url}{path}", json=body, headers=tag, timeout=120)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        reported.append((usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0)
                         + (usage.get("cache_creation_input_tokens") or 0), usage["output_tokens"]))
        with httpx.stream("POST", f"{engine.url}{path}", json={**body, "stream": True}, headers=tag,
                          timeout=120) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        final: dict[str, Any] = {}
        for event in events:  # the last usage vLLM sent (response.completed; message_start, then message_delta)
            for usage in (event.get("usage"), (event.get("response") or {}).get("usage"),
                          (event.get("message") or {}).get("usage")):
                if isinstance(usage, dict):
                    final = {**final, **usage}
        assert final, f"{path}: no usage in the stream"
        reported.append((final["input_tokens"] + (final.get("cache_read_input_tokens") or 0)
                         + (final.get("cache_creation_input_tokens") or 0), final["output_tokens"]))
    def recorded() -> KpiRow | None:
        rows = engine.client.kpis("10m", client="named-events-test")
        return rows[0] if rows and rows[0].requests == 4 else None

    k = wait_until(recorded, 30, what="the four requests in the ledger")
    assert k.succeeded == 4 and k.avg_output_tokens is not None and k.avg_input_tokens is not None
    assert k.avg_input_tokens == pytest.approx(sum(i for i, _ in reported) / 4)
    assert k.avg_output_tokens == pytest.approx(sum(o for _, o in reported) / 4)
