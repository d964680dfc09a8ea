"""A start you can watch: phases read from real vLLM logs (CPU build and H200), the ETA from earlier starts."""

from __future__ import annotations

from pathlib import Path

from engine.serving import PastStart, StartTracker, compile_key, estimate, past_start

LOGS = Path(__file__).parent.parent / "fixtures" / "vllm_logs"


def replay(name: str) -> StartTracker:
    """Feed a real log one line per second of 'arrival', as the child's pump would."""
    tracker = StartTracker(t0=0.0)
    lines = (LOGS / name).read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        tracker.feed(line, now=float(i))
    tracker.ready(now=float(len(lines)))
    return tracker


def test_the_h200_start_goes_through_every_phase_in_order() -> None:
    tracker = replay("startup-util085-len4096.log")
    assert [p.name for p in tracker.phases] == ["process", "weights", "compile", "kv_cache", "cuda_graphs", "api",
                                                "warmup"]
    assert all(p.ended_s is not None for p in tracker.phases)
    assert tracker.ready_s == sum(tracker.durations().values())


def test_the_cpu_build_start_has_no_cuda_graphs() -> None:
    names = [p.name for p in replay("cpu-startup-demo.log").phases]
    assert names == ["process", "weights", "compile", "kv_cache", "api", "warmup"]


def test_an_eager_start_skips_torch_compile() -> None:
    names = [p.name for p in replay("startup-util0125-eager.log").phases]
    assert "compile" not in names and names[:2] == ["process", "weights"]


def test_a_phase_marker_seen_again_later_does_not_go_back() -> None:
    tracker = StartTracker(t0=0.0)
    tracker.feed("Starting to load model", now=1)
    tracker.feed("GPU KV cache size: 10 tokens", now=2)
    tracker.feed("Loading weights took 0.01 seconds", now=3)  # a weights line after the KV cache: no going back
    assert tracker.current.name == "kv_cache"


def test_the_view_counts_down_from_the_eta() -> None:
    tracker = StartTracker(t0=0.0)
    tracker.feed("Starting to load model", now=10)
    eta = estimate("k", "m", [PastStart("k", "m", 40.0, False, {"process": 10, "weights": 5, "compile": 2,
                                                                 "kv_cache": 3, "api": 10, "warmup": 10})])
    assert eta is not None
    view = tracker.view(eta, now=12)
    assert view["phase"] == "weights" and view["elapsed_s"] == 12
    assert view["remaining_s"] == 3 + 2 + 3 + 10 + 10  # the rest of this phase, then the ones ahead


def test_a_start_that_overruns_says_by_how_much_and_never_shows_a_frozen_countdown() -> None:
    """The warm-up request usually takes 2.3 s; this one has run 100 s: the view said "2.3 s left" throughout."""
    tracker = StartTracker(t0=0.0)
    eta = estimate("k", "m", [PastStart("k", "m", 40.0, False, {"process": 10, "weights": 5, "kv_cache": 10,
                                                                 "api": 12.7, "warmup": 2.3})])
    assert eta is not None
    for line, at in (("Starting to load model", 10), ("KV cache size: 10 tokens", 15), ("Supported tasks", 25),
                     ("Application startup complete", 37.7)):
        tracker.feed(line, now=at)
    shown = [tracker.view(eta, now=t) for t in (38.0, 45.0, 80.0, 140.0)]
    assert shown[0]["remaining_s"] == 2.0 and shown[0]["overrun_s"] is None  # counting down
    overruns = [v["overrun_s"] for v in shown[1:]]
    assert overruns == [5.0, 40.0, 100.0]  # past the ETA of 40 s, growing with the clock
    assert all(v["remaining_s"] is None for v in shown[1:])  # no number that stands still


def test_a_phase_past_its_usual_length_is_an_overrun_before_the_total_eta_is() -> None:
    tracker = StartTracker(t0=0.0)
    eta = estimate("k", "m", [PastStart("k", "m", 40.0, False, {"process": 10, "weights": 5, "api": 25})])
    assert eta is not None
    tracker.feed("Starting to load model", now=2)  # process was quick: 2 s of its usual 10
    early, late = tracker.view(eta, now=6), tracker.view(eta, now=20)
    assert early["remaining_s"] == 1 + 25 and early["overrun_s"] is None  # weights: 4 s of its usual 5
    assert late["overrun_s"] == 13.0 and late["remaining_s"] is None  # 18 s of 5, while 20 s of 40 have passed


def test_gpu_memory_utilization_is_outside_the_compile_key_and_max_model_len_inside() -> None:
    base = {"model": "m", "max_model_len": 4096, "gpu_memory_utilization": 0.85, "max_num_seqs": 64}
    assert compile_key(base) == compile_key({**base, "gpu_memory_utilization": 0.8})
    assert compile_key(base) != compile_key({**base, "max_model_len": 8192})


def test_eta_takes_warm_starts_for_a_known_key_and_compiling_ones_for_a_new_key() -> None:
    cold = {"process": 20, "compile": 30, "api": 5}
    warm = {"process": 20, "compile": 1, "api": 5}
    history = [PastStart("a", "m", 60.0, True, cold), PastStart("a", "m", 30.0, False, warm),
               PastStart("b", "m", 64.0, True, cold), PastStart("b", "m", 32.0, False, warm)]
    same = estimate("a", "m", history)
    assert same is not None and same.basis == "warm" and same.total_s == 30.0
    new = estimate("c", "m", history)
    assert new is not None and new.basis == "recompile" and new.total_s == 62.0
    assert estimate("c", "m", []) is None
    other_model = estimate("x", "other", history)
    assert other_model is not None and other_model.basis == "recompile"  # no start of that model: all models


def test_past_starts_come_from_ready_events_and_old_events_are_skipped() -> None:
    assert past_start({"startup_s": 12.0}) is None  # written before phases were recorded
    start = past_start({"startup_s": 40.0, "startup": {"phases": {"compile": 12.0, "process": 5},
                                                       "compile_key": "k", "model": "m"}})
    assert start == PastStart("k", "m", 40.0, True, {"compile": 12.0, "process": 5.0})
