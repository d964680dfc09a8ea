"""The request ledger on a real database (SQLite, or PostgreSQL on make test's second pass): KPIs per revision
from known requests."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from engine.db import open_database
from engine.events import EventLog
from engine.gateway import Ledger, Record, percentile

pytestmark = pytest.mark.store


def rec(ts: float, revision: int, latency: float, tokens: tuple[int, int] | None = (10, 20), status: int = 200,
        ttft: float | None = None) -> Record:
    return Record(ts=ts, revision_id=revision, model="demo", endpoint="/v1/completions", stream=ttft is not None,
                  status=status, latency_s=latency, client="test", input_tokens=tokens[0] if tokens else None,
                  output_tokens=tokens[1] if tokens else None, ttft_s=ttft)


@pytest.fixture
def ledger(db_target: Path | str) -> Ledger:
    return Ledger(open_database(db_target))


def test_kpis_per_revision(ledger: Ledger) -> None:
    now = time.time()
    for i in range(10):
        ledger.record(rec(now - 100 + i, 1, latency=1.0 + i / 10, ttft=0.1 * (i + 1)))
    ledger.record(rec(now - 50, 1, latency=0.2, tokens=None, status=500))
    ledger.record(rec(now - 40, 2, latency=3.0, tokens=(100, 50)))
    ledger.record(rec(now - 4000, 2, latency=9.0))  # outside the window
    assert ledger.flush() == 13
    k = {r["revision"]: r for r in ledger.kpis(3600, now=now)}
    one, two = k[1], k[2]
    assert (one["requests"], one["succeeded"], one["error_rate"]) == (11, 10, round(1 / 11, 4))
    assert one["avg_input_tokens"] == 10 and one["avg_output_tokens"] == 20
    assert one["latency_p50_s"] == pytest.approx(1.45) and one["latency_p99_s"] == pytest.approx(1.891)
    assert one["ttft_p95_s"] == pytest.approx(0.955)
    assert one["output_tokens_per_s"] == round(200 / (now - 50 + 0.2 - (now - 100)), 2)
    assert (two["requests"], two["avg_input_tokens"], two["avg_output_tokens"]) == (1, 100, 50)
    assert [r["revision"] for r in ledger.kpis(3600, revision=2, now=now)] == [2]


def test_oom_rate_comes_from_diagnosed_failures(db_target: Path | str) -> None:
    db = open_database(db_target)
    ledger, events = Ledger(db), EventLog(db)
    events.add("diagnosis", "kv_cache_too_small", revision_id=3, data={"kind": "kv_cache_too_small",
                                                                             "is_oom": True})
    events.add("diagnosis", "unknown", revision_id=3, data={"kind": "unknown", "is_oom": False})
    k = {r["revision"]: r for r in ledger.kpis(7200)}
    assert k[3]["oom_failures"] == 1 and k[3]["oom_per_hour"] == 0.5 and k[3]["requests"] == 0


def test_percentile_matches_numpy_linear() -> None:
    assert percentile([1, 2, 3, 4], 0.5) == 2.5
    assert percentile([5.0], 0.95) == 5.0
    assert percentile([], 0.5) is None


def test_sampled_prompt_text_is_the_messages_as_json_cut_at_4000_characters() -> None:
    from engine.gateway.datapath import prompt_text

    assert prompt_text({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}) == \
        '[{"role": "user", "content": "hi"}]'
    long = prompt_text({"prompt": "x" * 10_000})
    assert long is not None and len(long) == 4000 and long.startswith('"xxx')
    assert prompt_text(None) is None and prompt_text(["not", "an", "object"]) is None


def test_longest_request_is_the_p99_of_successful_requests_and_is_cached(ledger: Ledger) -> None:
    now = time.time()
    for i in range(19):
        ledger.record(rec(now - 10, 1, latency=0.1, tokens=(100 * (i + 1), 0)))
    ledger.flush()
    assert ledger.longest_request(3600, cache_s=0) is None  # fewer than 20: no claim about traffic
    ledger.record(rec(now - 10, 1, latency=0.1, tokens=(2000, 50)))
    ledger.record(rec(now - 10, 1, latency=0.1, tokens=(99_999, 0), status=500))  # failed: not traffic's need
    ledger.flush()
    assert ledger.longest_request(3600, cache_s=0) == 1900  # 20 rows: nearest rank of p99 is the 19th
    ledger.record(rec(now - 10, 1, latency=0.1, tokens=(50_000, 0)))
    ledger.flush()
    assert ledger.longest_request(3600, cache_s=0) == 2050  # 21 rows: the 20th; the new row counts ...
    ledger.record(rec(now - 10, 1, latency=0.1, tokens=(60_000, 0)))
    ledger.flush()
    assert ledger.longest_request(3600) == 2050  # ... and is kept for 30 s


def test_what_traffic_needs_of_max_model_len_counts_the_max_tokens_asked_for(ledger: Ledger) -> None:
    """A playground request of 20 prompt tokens that asks for max_tokens 128 and stops after 8 needs 148 tokens of
    max_model_len: a max_model_len sized from its 28 tokens would refuse it with HTTP 400."""
    now = time.time()
    ledger.record(Record(ts=now - 5 * 86400, revision_id=1, model="demo", endpoint="/v1/chat/completions",
                         stream=True, status=200, latency_s=0.5, client="console", input_tokens=20, output_tokens=8,
                         max_tokens=128))
    for i in range(50):  # requests that asked for no max_tokens: what they produced is what they needed
        ledger.record(rec(now - 60 - i, 1, latency=0.1, tokens=(10, 30)))
    ledger.record(rec(now - 30, 1, latency=0.1, tokens=(5000, 0), status=400))  # refused: not a need
    ledger.flush()
    tokens, requests, span_s = ledger.longest_need(7 * 86400, cache_s=0) or (0, 0, 0.0)
    assert (tokens, requests) == (148, 51) and span_s == pytest.approx(5 * 86400, abs=60)
    assert ledger.longest_need(3600, cache_s=0) == pytest.approx((40, 50, 109), abs=2)


def test_the_gateway_records_the_max_tokens_a_request_asks_for() -> None:
    from engine.bodies import asked_max_tokens

    assert asked_max_tokens({"max_tokens": 128}) == 128
    assert asked_max_tokens({"max_completion_tokens": 64, "max_tokens": 9}) == 64
    # with both, the larger: vLLM's completions read max_tokens only, its chat max_completion_tokens unless null
    assert asked_max_tokens({"max_completion_tokens": 1, "max_tokens": 4000}) == 4000
    assert asked_max_tokens({"max_completion_tokens": None, "max_tokens": 9}) == 9
    assert asked_max_tokens({"max_tokens": "9"}) == asked_max_tokens({"max_tokens": 9.0}) == 9  # as vLLM reads it
    assert [asked_max_tokens(x) for x in ({}, {"max_tokens": "nine"}, {"max_tokens": True}, {"max_tokens": -1},
                                           {"max_tokens": 2**40}, {"max_tokens": 9.5}, None, [1])] == [None] * 8


def test_what_alert_rules_watch_per_deployment_is_read_from_a_sample_across_the_window(ledger: Ledger) -> None:
    """Each deployment's TTFT and latency P95 and error rate over the window; past ``max_rows`` requests, every
    n-th of them (chosen by the database), so that a busy window is never built whole in Python."""
    now = time.time()
    for i in range(400):
        r = rec(now - 200 + i * 0.5, 1, latency=0.1 + (i % 100) / 100, ttft=0.01 * (i % 100),
                status=500 if i % 10 == 0 else 200)
        r.deployment_id = 1 if i % 2 else 2
        ledger.record(r)
    ledger.record(rec(now - 4000, 1, latency=99.0))  # outside the window
    ledger.flush()
    whole = ledger.by_deployment(300, max_rows=10_000)
    assert set(whole) == {1, 2} and whole[1][0] == 200 and whole[2][0] == 200
    assert whole[2][3] == pytest.approx(0.2)  # every 10th request (the even ones: deployment 2) failed
    assert whole[1][3] == 0.0 and whole[1][2] is not None and whole[1][2] < 99.0
    sampled = ledger.by_deployment(300, max_rows=100)
    assert sum(n for n, *_ in sampled.values()) <= 100
    assert sampled[2][3] == pytest.approx(whole[2][3], abs=0.1)
    assert sampled[1][2] == pytest.approx(whole[1][2], abs=0.1)
