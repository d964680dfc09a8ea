"""A start you can watch: phases read from real vLLM logs (CPU build and H200), the ETA from earlier starts."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from engine.schemas.engine import ApplyProgress
from engine.schemas.settings import ApplyPlanOut, PlanStepOut
from engine.serving.eta import PRIOR_RATIO, PRIOR_WARM_S, PastStart, StartKind, estimate, past_start, start_view
from engine.serving.progress import Progress
from engine.vllm import StartTracker, compile_key
from tests.testkit.clock import FakeClock

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
    view = start_view(tracker, eta, now=12)
    assert view["phase"] == "weights" and view["elapsed_s"] == 12
    assert view["remaining_s"] == 3 + 2 + 3 + 10 + 10  # the rest of this phase, then the ones ahead


def test_the_log_says_whether_the_compile_cache_was_warm_or_cold() -> None:
    """vLLM says it: a GPU loads the cached graphs ("Directly load"); the CPU build 0.32 finds them, fails to load
    them and compiles again on torch's warm cache (10 s against 28 s cold on this host, over the old 5 s line
    that told a warm start from a cold one by its compile phase)."""
    assert replay("cpu-startup-demo.log").compile_cache == "cold"
    warm_cpu = replay("cpu-startup-demo-warm.log")
    assert warm_cpu.compile_cache == "warm"
    assert replay("startup-util085-len4096.log").compile_cache == "cold"
    assert replay("h200-startup-warm-pause.log").compile_cache == "warm"
    assert replay("startup-util0125-eager.log").compile_cache is None  # enforce_eager: nothing compiled
def test_a_start_that_overruns_says_by_how_much_and_never_shows_a_frozen_countdown() -> None:
    """The warm-up request usually takes 2.3 s; this one has run 100 s: the view said "2.3 s left" throughout."""
    tracker = StartTracker(t0=0.0)
    eta = estimate("k", "m", [PastStart("k", "m", 40.0, False, {"process": 10, "weights": 5, "kv_cache": 10,
                                                                 "api": 12.7, "warmup": 2.3})])
    assert eta is not None
    for line, at in (("Starting to load model", 10), ("KV cache size: 10 tokens", 15), ("Supported tasks", 25),
                     ("Application startup complete", 37.7)):
        tracker.feed(line, now=at)
    shown = [start_view(tracker, eta, now=t) for t in (38.0, 45.0, 80.0, 140.0)]
    assert shown[0]["remaining_s"] == 2.0 and shown[0]["overrun_s"] is None  # counting down
    overruns = [v["overrun_s"] for v in shown[1:]]
    assert overruns == [5.0, 40.0, 100.0]  # past the ETA of 40 s, growing with the clock
    assert all(v["remaining_s"] is None for v in shown[1:])  # no number that stands still


def test_a_phase_past_its_usual_length_is_an_overrun_before_the_total_eta_is() -> None:
    tracker = StartTracker(t0=0.0)
    eta = estimate("k", "m", [PastStart("k", "m", 40.0, False, {"process": 10, "weights": 5, "api": 25})])
    assert eta is not None
    tracker.feed("Starting to load model", now=2)  # process was quick: 2 s of its usual 10
    early, late = start_view(tracker, eta, now=6), start_view(tracker, eta, now=20)
    assert early["remaining_s"] == 1 + 25 and early["overrun_s"] is None  # weights: 4 s of its usual 5
    assert late["overrun_s"] == 13.0 and late["remaining_s"] is None  # 18 s of 5, while 20 s of 40 have passed


def test_gpu_memory_utilization_is_outside_the_compile_key_and_max_model_len_inside() -> None:
    base = {"model": "m", "max_model_len": 4096, "gpu_memory_utilization": 0.85, "max_num_seqs": 64}
    assert compile_key(base) == compile_key({**base, "gpu_memory_utilization": 0.8})
    assert compile_key(base) != compile_key({**base, "max_model_len": 8192})
    # vLLM hashes its VLLM_* environment: a CPU instance started unpinned beside another compiles apart
    assert compile_key(base, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) != compile_key(base)
    assert compile_key(base, {"VLLM_API_KEY": "per-instance", "PATH": "/bin"}) == compile_key(base)


def test_the_compile_key_is_of_the_max_num_seqs_vllm_is_started_with() -> None:
    """Under a ceiling vLLM runs with the ceiling and the gateway holds it to max_num_seqs: on the H200 (2026-12-04)
    the ceiling brought back to 256 over max_num_seqs 128 had a key of its own, though it launched the vLLM of the
    engine's first start (max_num_seqs 256) again."""
    base = {"model": "m", "max_model_len": 4096, "max_num_seqs": 256, "max_num_seqs_ceiling": None}
    capped = {**base, "max_num_seqs": 128, "max_num_seqs_ceiling": 256}
    assert compile_key(capped) == compile_key(base) == compile_key({**base, "max_num_seqs_ceiling": 256})
    assert compile_key(capped) == compile_key({**capped, "max_num_seqs": 32})
    # a new ceiling is a new vLLM: its CUDA graphs are sized from it
    assert compile_key({**capped, "max_num_seqs_ceiling": 128}) != compile_key(capped)
    assert compile_key({**base, "max_num_seqs": 128}) != compile_key(base)


def test_eta_takes_warm_starts_for_a_known_key_and_compiling_ones_for_a_new_key() -> None:
    cold = {"process": 20, "compile": 30, "api": 5}
    warm = {"process": 20, "compile": 1, "api": 5}
    history = [PastStart("a", "m", 60.0, True, cold), PastStart("a", "m", 30.0, False, warm),
               PastStart("b", "m", 64.0, True, cold), PastStart("b", "m", 32.0, False, warm)]
    same = estimate("a", "m", history)
    assert same.kind == "warm" and same.basis == "kind" and same.total_s == 31.0
    new = estimate("c", "m", history)
    assert new.kind == "cold" and new.basis == "kind" and new.total_s == 62.0
    other_model = estimate("x", "other", history)
    assert other_model.kind == "cold" and other_model.total_s == 62.0  # no start of that model: all models


def test_each_kind_of_start_is_estimated_from_starts_of_its_own_kind() -> None:
    """The CPU build showed "3 min expected" for a 25 s start: the median mixed slow starts (beside a busy
    instance, cold) with the warm one it was."""
    phases = {"process": 8.0, "compile": 1.0, "api": 4.0}
    history = [PastStart("k", "m", 25.0, False, phases, "warm"), PastStart("k", "m", 180.0, False, phases, "beside"),
               PastStart("k", "m", 170.0, False, phases, "beside"), PastStart("k", "m", 26.0, False, phases, "warm"),
               PastStart("k", "m", 190.0, False, phases, "beside")]
    alone = estimate("k", "m", history, company="alone")
    assert (alone.kind, alone.total_s, alone.samples) == ("warm", 25.5, 2)
    beside = estimate("k", "m", history, company="beside")
    assert (beside.kind, beside.total_s, beside.samples) == ("beside", 180.0, 3)
    assert "beside an instance that serves" in beside.describe()


def test_the_process_phase_is_taken_from_the_latest_start_of_its_peers() -> None:
    """This host's imports got faster within the hour (43 s, then 34 s) while the compile phase of a kind stayed:
    the median of five totals ran 20-34 % over. The process phase comes from the latest start that shared the
    conditions it runs in (alone on the CPU build; beside a serving instance apart, which shares its cores), the
    rest from the kind's median."""
    def start(total: float, process: float, kind: StartKind) -> PastStart:
        return PastStart("k", "m", total, kind == "cold", {"process": process, "compile": total - process - 5,
                                                           "api": 5.0}, kind)

    history = [start(60.0, 43.0, "warm"), start(62.0, 44.0, "warm"), start(150.0, 100.0, "beside"),
               start(70.0, 34.0, "cold")]
    warm = estimate("k", "m", history, company="alone")
    assert (warm.kind, warm.samples) == ("warm", 2)
    assert warm.phases["process"] == 34.0 and warm.total_s == 61.0 - 43.5 + 34.0
    assert "process and imports 34 s as in the latest cold start" in warm.describe()
    beside = estimate("k", "m", history, company="beside", load_1m=10.0, cores=2)
    assert beside.phases["process"] == 100.0 and beside.total_s == 150.0  # the starts alone are not its peers
    # on a GPU the process phase runs on the host's CPUs whatever shares the GPU: every start is a peer
    on_gpu = estimate("k", "m", history[:3], company="alone", build="cuda")
    assert on_gpu.phases["process"] == 100.0 and on_gpu.total_s == 61.0 - 43.5 + 100.0
    # a start recorded without its phases keeps the totals' median, and the estimate does not claim otherwise
    bare = estimate("k", "m", [PastStart("k", "m", 30.0, False, {}, "warm"), *history], company="alone")
    assert bare.total_s == 60.0 and bare.process_from is None and "process and imports" not in bare.describe()


def test_a_start_expected_warm_that_compiled_counts_as_cold() -> None:
    cold = PastStart("k", "m", 40.0, True, {"compile": 18.0}, "warm")  # its cache had been wiped
    assert cold.effective_kind == "cold"
    assert PastStart("k", "m", 22.0, False, {"compile": 1.0}, "beside_cold").effective_kind == "beside"
    assert estimate("k", "m", [cold], company="alone").kind == "warm"  # the key was seen: the cache is warm now


def test_a_host_whose_vllm_missed_its_compile_cache_on_a_repeat_is_expected_to_compile_again() -> None:
    """On the H200 (2026-12-04) vLLM compiled on every start, a repeat of a compile key too: the start after such
    a miss was launched as warm, estimated at 56 s, and took 96 s. A repeat that found the cache cold makes the
    next repeat cold, and the estimate says why; a repeat found warm later makes the cache count again."""
    phases = {"process": 30.0, "compile": 15.0, "cuda_graphs": 20.0}
    warm = {"process": 25.0, "compile": 1.5, "cuda_graphs": 15.0}
    first = PastStart("a", "m", 95.0, True, phases, "cold", cache="cold")
    missed = PastStart("a", "m", 90.0, True, phases, "warm", cache="cold")  # launched warm, vLLM compiled
    eta = estimate("a", "m", [first, missed])
    assert eta.kind == "cold" and eta.cache_missed
    assert "compile again" in eta.why() and "found vLLM's compile cache cold" in eta.why()
    assert estimate("b", "m", [first, missed]).cache_missed is False  # a new key is cold anyway: nothing to say
    hit = PastStart("b", "m", 45.0, False, warm, "warm", cache="warm")
    again = estimate("a", "m", [first, missed, PastStart("b", "m", 95.0, True, phases, "cold", cache="cold"), hit])
    assert again.kind == "warm" and not again.cache_missed and "compile again" not in again.why()
    unknown = PastStart("a", "m", 40.0, False, warm, "warm")  # a log that said neither (older records) counts not
    assert estimate("a", "m", [first, missed, unknown]).kind == "cold"


def test_a_kind_never_started_gets_a_prior_and_says_so() -> None:
    history = [PastStart("k", "m", 20.0, False, {"process": 10.0}, "warm"),
               PastStart("k", "m", 22.0, False, {"process": 12.0}, "warm")]
    beside = estimate("k", "m", history, company="beside")
    assert beside.basis == "prior" and beside.source == "warm"
    assert beside.total_s == round(21.0 * PRIOR_RATIO["cpu"]["beside"], 1)
    assert beside.phases["process"] == round(11.0 * PRIOR_RATIO["cpu"]["beside"], 2)
    assert "a prior: no earlier starts beside" in beside.describe()
    assert "a prior" in (beside.note() or "")
    nothing = estimate("k", "m", [], company="alone", build="cuda")  # a first start: its compile cache is cold
    assert nothing.basis == "default" and nothing.kind == "cold"
    assert nothing.total_s == round(PRIOR_WARM_S["cuda"] * PRIOR_RATIO["cuda"]["cold"], 1)
    assert "no earlier start of this engine" in nothing.describe()


def test_a_loaded_host_is_said_in_the_estimate() -> None:
    history = [PastStart("k", "m", 20.0, False, {}, "warm")]
    quiet = estimate("k", "m", history, load_1m=1.2, cores=2)
    assert not quiet.loaded and "loaded" not in quiet.describe() and quiet.note() is None
    busy = estimate("k", "m", history, load_1m=8.9, cores=2)
    assert busy.loaded and busy.total_s == quiet.total_s
    assert "the host is loaded now (load average 8.9 on 2 cores)" in busy.describe()
    assert "loaded" in (busy.note() or "")
    # beside a busy instance the load is always high: against starts made at such a load it is no surprise
    usual = [PastStart("k", "m", 160.0, False, {}, "beside", 19.0, 2), PastStart("k", "m", 150.0, False, {}, "beside",
                                                                               21.0, 2)]
    assert not estimate("k", "m", usual, company="beside", load_1m=22.0, cores=2).loaded
    high = estimate("k", "m", usual, company="beside", load_1m=40.0, cores=2)
    assert high.loaded and "against 20.0 for the starts this is taken from" in high.describe()


def test_past_starts_come_from_ready_events_and_old_events_are_skipped() -> None:
    assert past_start({"startup_s": 12.0}) is None  # written before phases were recorded
    start = past_start({"startup_s": 40.0, "startup": {"phases": {"compile": 12.0, "process": 5},
                                                       "compile_key": "k", "model": "m"}})
    assert start == PastStart("k", "m", 40.0, True, {"compile": 12.0, "process": 5.0})
    assert start.effective_kind == "cold"  # recorded before kinds: alone, and it compiled
    bridge = past_start({"startup_s": 64.1, "bridge": True, "startup": {"phases": {}, "model": "m"}})
    assert bridge is not None and bridge.kind == "bridge"
    kinded = past_start({"startup_s": 31.0, "startup": {"phases": {"compile": 11.0}, "model": "m", "kind": "beside",
                                                        "load_1m": 3.5, "cores": 2, "compile_cache": "warm"}})
    assert kinded is not None and (kinded.kind, kinded.load_1m, kinded.cores) == ("beside", 3.5, 2)
    assert not kinded.compiled and kinded.effective_kind == "beside"  # the log said warm: 11 s is a warm compile


def test_an_apply_step_is_compared_with_the_plans_step_of_the_same_order_whatever_kind_it_launched_as() -> None:
    """A start's kind is worked out again at its launch: a bridge that misses vLLM's compile cache during the apply
    turns the next start from warm to cold. Its timing still carries the plan's ETA for that step (matched by kind
    it had none)."""
    plan = ApplyPlanOut(kind="bridge", reason="r", step_etas=[
        PlanStepOut(action="start", text="bridge", start_kind="bridge", eta_s=70.0),
        PlanStepOut(action="stop", text="old", eta_s=0.7),
        PlanStepOut(action="start", text="new", start_kind="warm", eta_s=63.7),
        PlanStepOut(action="stop", text="bridge", eta_s=0.5)])
    progress = Progress(FakeClock())
    progress.apply = ApplyProgress(revision=2, from_revision=1, plan=plan, step="s", started=datetime.now(UTC))
    for action, kind, took in (("start", "bridge", 63.4), ("stop", None, 0.6), ("start", "cold", 93.0),
                               ("stop", None, 0.4)):
        progress.timed(action, "a", took, 0, kind)  # type: ignore[arg-type]
    assert [(t.action, t.start_kind, t.eta_s) for t in progress.apply.timings] == [
        ("start", "bridge", 70.0), ("stop", None, 0.7), ("start", "cold", 63.7), ("stop", None, 0.5)]
