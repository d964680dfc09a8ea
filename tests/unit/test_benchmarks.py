"""The parts of the benchmarks that need no vLLM: preset lengths and the search's proposal."""

from __future__ import annotations

from typing import Any

from engine.benchmarks import lengths, propose


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
