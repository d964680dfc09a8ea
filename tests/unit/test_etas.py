"""The ETAs of a plan's steps from what the engine measured before (engine/serving/etas.py): starts by their kind,
handovers and drains by the traffic in flight, stops and sleeps by the earlier ones; priors that say so."""

from __future__ import annotations

from engine.revisions import EngineSettings
from engine.serving.eta import PRIOR_STEP_S, EtaTable, PastStart, PastStep, past_steps

DEMO = EngineSettings.model_construct(model="m", max_num_seqs=16, replicas=1, tensor_parallel_size=1)
STARTS = [PastStart(None, "m", 24.0, False, {}, "warm"), PastStart(None, "m", 26.0, False, {}, "warm"),
          PastStart(None, "m", 40.0, False, {}, "beside"), PastStart(None, "m", 44.0, False, {}, "beside")]


def key_of_demo() -> list[PastStart]:
    """The starts above, under the demo settings' own compile key (their cache is warm)."""
    from engine.vllm import compile_key

    key = compile_key(DEMO.model_dump())
    return [PastStart(key, s.model, s.total_s, s.compiled, s.phases, s.kind) for s in STARTS]


def test_a_start_beside_an_instance_that_serves_requests_is_timed_as_one_and_alone_otherwise() -> None:
    busy = EtaTable(key_of_demo(), [], in_flight=16)
    eta = busy.start(DEMO, "beside")
    assert (eta.start_kind, eta.seconds) == ("beside", 42.0)
    idle = EtaTable(key_of_demo(), [], in_flight=0)  # the old instance serves nobody: the new one starts alone
    eta = idle.start(DEMO, "beside")
    assert (eta.start_kind, eta.seconds) == ("warm", 25.0)
    neighbour = EtaTable(key_of_demo(), [], in_flight=0, neighbours=True)  # another deployment's on the cores
    assert neighbour.start(DEMO, "alone").start_kind == "beside"


def test_handovers_and_drains_take_no_time_without_traffic_and_the_median_of_loaded_ones_with() -> None:
    steps = [PastStep("drain", 0.0, 0), PastStep("drain", 1.2, 16), PastStep("drain", 1.6, 16),
             PastStep("drain", 1.4, 14), PastStep("handover", 2.5, 16), PastStep("stop", 3.0, 0),
             PastStep("stop", 2.0, 16)]
    loaded = EtaTable([], steps, in_flight=16)
    assert loaded.step("drain").seconds == 1.4 and "with requests in flight" in loaded.step("drain").basis
    assert loaded.step("handover").seconds == 2.5
    assert loaded.step("stop").seconds == 2.5  # a stop is of a drained instance: traffic does not matter
    quiet = EtaTable([], steps, in_flight=0)
    assert quiet.step("drain").seconds == 0.0 and quiet.step("handover").seconds == 0.0
    nothing = EtaTable([], [], in_flight=3, build="cuda")
    sleep = nothing.step("sleep")
    assert sleep.seconds == PRIOR_STEP_S["cuda"]["sleep"] and sleep.basis.startswith("a prior")


def test_past_steps_come_from_apply_done_events() -> None:
    data = {"timings": [{"action": "start", "instance": "b", "seconds": 31.2, "start_kind": "beside",
                         "in_flight": 16}, {"action": "drain", "instance": "a", "seconds": 1.1, "in_flight": 9},
                        {"action": 3}], "plan": {}}
    assert past_steps(data) == [PastStep("start", 31.2, 16), PastStep("drain", 1.1, 9)]
    assert past_steps({"plan": {}}) == []  # an apply recorded before steps were timed


def test_the_note_says_each_reason_once() -> None:
    table = EtaTable([], [], in_flight=16, load_1m=9.0, cores=2)
    table.start(DEMO, "beside")
    table.start(DEMO, "alone")
    note = table.note() or ""
    assert note.count("the host is loaded now") == 1 and note.count("a prior") == 1
