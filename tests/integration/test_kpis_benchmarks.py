"""Serving KPIs from a known set of requests, and benchmarks with vLLM's own module, on the real vLLM."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.schemas import BenchmarkRunOut
from tests.support.engine import COLD_START_S, EngineHandle
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
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
        # fresh prompts: vLLM looked up every prompt token in its prefix cache (its /metrics counters over the
        # level) and found next to none there; no warning
        assert level.prefix_cache_queries is not None and level.prefix_cache_queries >= 6 * 100
        assert level.prefix_cache_hit_pct is not None and level.prefix_cache_hit_pct <= 20 and not level.warnings
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


def test_guided_search_proposes_a_valid_max_num_seqs_and_restores(engine: EngineHandle) -> None:
    engine.client.wait_for({"ready"}, COLD_START_S)
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
