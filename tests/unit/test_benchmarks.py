"""The parts of the benchmarks that need no vLLM: preset lengths and the search's proposal."""

from __future__ import annotations

from typing import Any

from engine.benchmarks import lengths, propose
from engine.benchmarks.runs import CACHE_WARNING, cache_warning, fresh_seed, level_command


def test_preset_lengths_shrink_to_fit_max_model_len() -> None:
    assert lengths("short_chat", 4096) == (128, 128)
    inp, out = lengths("rag", 1024)
    assert inp + out <= 0.85 * 1024 and inp > out


def level(seqs: int, throughput: float, p95_ms: float) -> dict[str, Any]:
    return {"max_num_seqs": seqs, "output_throughput": throughput, "p95_e2el_ms": p95_ms}


def test_proposal_is_the_fastest_value_meeting_the_target() -> None:
    results: list[dict[str, Any]] = [level(1, 200, 700), level(16, 2400, 1500), level(64, 6700, 1400),
                                     level(256, 5800, 6900), {"max_num_seqs": 512, "error": "did not become ready"}]
    proposal = propose(results, target_p95_s=2.0)
    assert proposal is not None
    assert proposal["max_num_seqs"] == 64 and proposal["gain_over_max_num_seqs_1"] == 33.5
    assert propose(results, target_p95_s=0.5) is None  # nothing meets it


def test_each_level_draws_its_prompts_from_a_fresh_seed_on_its_command_line() -> None:
    """The same prompts a second time are served from vLLM's prefix cache (H200: +26 % tokens/s at a 96 % hit
    rate): a level's seed is its own, and it is the one vLLM's benchmark is given."""
    seeds = {fresh_seed() for _ in range(200)}
    assert len(seeds) == 200 and all(0 < s < 2**31 for s in seeds)
    args = level_command(base_url="http://127.0.0.1:8000", model="demo", tokenizer="/m", input_len=128,
                         output_len=128, num_prompts=64, concurrency=4, tag="bench-1-c4", seed=123456)
    assert args[args.index("--seed") + 1] == "123456" and args.count("--seed") == 1


def test_a_level_served_from_the_prefix_cache_is_called_a_cache_test() -> None:
    assert cache_warning(None) is None and cache_warning(0.0) is None and cache_warning(20.0) is None
    warning = cache_warning(96.0)
    assert warning is not None and warning.startswith(CACHE_WARNING) and "96 %" in warning
