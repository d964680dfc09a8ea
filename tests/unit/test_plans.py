"""Apply plans from the capacity model and the device's free memory: the H200 cases measured on 2026-12-01
(../shared/gpu/bridge-2026-12-01.txt: A at 0.85 holds 119.3 GiB; a bridge at 0.13 beside it held 17,312 KV
tokens; C at 0.85 started beside the bridge) and the CPU build's host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.capacity.model import GIB, Device, load_shape
from engine.capacity.plans import Company, PlanInputs, Running, StepEta, plan_apply
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut, StepAction
from tests.testkit.data import DEMO_SHAPE

LLAMA8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "vocab_size": 128256,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
TOTAL = int(139.8 * GIB)


@pytest.fixture
def m8b(tmp_path: Path) -> Path:
    (tmp_path / "m8b").mkdir()
    (tmp_path / "m8b" / "config.json").write_text(json.dumps(LLAMA8B))
    return tmp_path / "m8b"


def gpu(model: Path, **values: object) -> EngineSettings:
    base: dict[str, object] = {"model": str(model), "load_format": "dummy", "gpu_memory_utilization": 0.85,
                               "max_model_len": 4096, "max_num_seqs": 256}
    return EngineSettings.model_validate({**base, **values})


def inputs(m8b: Path, new: EngineSettings, old: EngineSettings | None, used: float, replicas: int = 1,
           eta: float | None = 60.0) -> PlanInputs:
    """``used``: GiB the old instance holds; the device's free memory counts it as free (as Planner.device
    does for a restart)."""
    free = TOTAL - int(0.6 * GIB)
    shape = load_shape(m8b)
    return PlanInputs(new=new, running=None if old is None else Running(old, replicas, int(used * GIB)),
                      device=Device("cuda", TOTAL, free), shape_old=shape, shape_new=shape, eta_new_s=eta,
                      eta_bridge_s=74.0)


def test_nothing_running_is_a_plain_start(m8b: Path) -> None:
    assert plan_apply(inputs(m8b, gpu(m8b), None, 0)).kind == "start"


def test_small_old_and_new_side_by_side_is_blue_green(m8b: Path) -> None:
    old, new = gpu(m8b, gpu_memory_utilization=0.4), gpu(m8b, gpu_memory_utilization=0.45)
    plan = plan_apply(inputs(m8b, new, old, used=0.4 * 139.8))
    assert plan.kind == "blue_green" and plan.pause_s == 0 and plan.capacity_dip_pct == 0


def test_085_to_085_on_one_h200_takes_a_bridge_that_holds_a_max_length_request(m8b: Path) -> None:
    old, new = gpu(m8b), gpu(m8b, max_num_seqs=128)
    plan = plan_apply(inputs(m8b, new, old, used=119.3))
    assert plan.kind == "bridge" and plan.bridge is not None
    b = plan.bridge
    assert 0.10 <= b.gpu_memory_utilization <= 0.14  # 0.13 was measured to fit beside 0.85
    assert b.kv_tokens >= 4096 and b.max_concurrency >= 1
    assert plan.pause_s == 0 and plan.expected_s == pytest.approx(134.0)
    assert plan.capacity_dip_pct is not None and plan.capacity_dip_pct > 90  # a bridge carries far fewer at once
    short = inputs(m8b, new, old, used=119.3)
    short.request_tokens = 328  # traffic of 200-token prompts and 128-token answers
    sized = plan_apply(short).bridge
    assert sized is not None and sized.max_num_seqs >= 16  # sized by what requests need, not max_model_len


def test_no_bridge_fits_beside_a_greedy_old_instance_then_pause_with_its_length(m8b: Path) -> None:
    old, new = gpu(m8b, gpu_memory_utilization=0.95), gpu(m8b, gpu_memory_utilization=0.95)
    plan = plan_apply(inputs(m8b, new, old, used=0.95 * 139.8))
    assert plan.kind == "pause" and plan.pause_s == 60.0
    assert any("no bridge fits" in w for w in plan.warnings)


def test_two_replicas_roll_one_at_a_time(m8b: Path) -> None:
    old, new = gpu(m8b, replicas=2, gpu_memory_utilization=0.45), gpu(m8b, replicas=2, gpu_memory_utilization=0.45)
    plan = plan_apply(inputs(m8b, new, old, used=0.9 * 139.8, replicas=2))
    assert plan.kind == "rolling" and plan.capacity_dip_pct == 50.0 and plan.expected_s == 120.0


def test_cpu_build_blue_green_when_the_host_has_room_else_pause(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text(json.dumps(DEMO_SHAPE))
    shape = load_shape(tmp_path / "demo")
    demo = EngineSettings.model_validate({"model": str(tmp_path / "demo"), "cpu_kv_cache_gib": 0.5})
    running = Running(demo, 1, int(2 * GIB))
    roomy = PlanInputs(new=demo, running=running, device=Device("cpu", 24 * GIB, 20 * GIB), shape_old=shape,
                       shape_new=shape)
    assert plan_apply(roomy).kind == "blue_green"
    tight = PlanInputs(new=demo, running=running, device=Device("cpu", 8 * GIB, int(3.5 * GIB)), shape_old=shape,
                       shape_new=shape)
    plan = plan_apply(tight)
    assert plan.kind == "pause" and "needs" in plan.reason


class Times:
    """StepTimes as the controller's table gives them: a start by its company, each other step by its action."""

    def __init__(self, **seconds: float) -> None:
        self.seconds = seconds
        self.asked: list[tuple[str, str]] = []

    def start(self, settings: EngineSettings, company: Company) -> StepEta:
        self.asked.append((company, str(settings.gpu_memory_utilization)))
        kind = {"alone": "warm", "beside": "beside", "bridge": "bridge"}[company]
        return StepEta(self.seconds[f"start_{company}"], f"{kind} starts", kind)  # type: ignore[arg-type]

    def step(self, action: StepAction) -> StepEta:
        return StepEta(self.seconds[action], f"earlier {action}s")

    def note(self) -> str | None:
        return "the host is loaded now"


TIMES = {"start_alone": 25.0, "start_beside": 31.0, "start_bridge": 64.0, "handover": 2.0, "drain": 1.5,
         "stop": 1.0, "sleep": 17.0}


def etas(plan: ApplyPlanOut) -> list[tuple[str, str | None, float | None]]:
    return [(s.action, s.start_kind, s.eta_s) for s in plan.step_etas]


def test_a_blue_green_plan_is_a_start_beside_a_handover_a_drain_and_a_stop(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "config.json").write_text(json.dumps(DEMO_SHAPE))
    shape = load_shape(tmp_path / "demo")
    demo = EngineSettings.model_validate({"model": str(tmp_path / "demo"), "cpu_kv_cache_gib": 0.5})
    times = Times(**TIMES)
    plan = plan_apply(PlanInputs(new=demo, running=Running(demo, 1, int(2 * GIB)),
                                 device=Device("cpu", 24 * GIB, 20 * GIB), shape_old=shape, shape_new=shape,
                                 times=times))
    assert plan.kind == "blue_green"
    assert etas(plan) == [("start", "beside", 31.0), ("handover", None, 2.0), ("drain", None, 1.5),
                          ("stop", None, 1.0)]
    assert plan.expected_s == 35.5 and plan.pause_s == 0
    assert plan.steps == [s.text for s in plan.step_etas]  # the texts older clients read, the same steps
    assert plan.eta_note == "the host is loaded now"
    assert plan.step_etas[0].basis == "beside starts"


def test_a_bridge_plan_times_both_starts_by_their_kinds(m8b: Path) -> None:
    old, new = gpu(m8b), gpu(m8b, max_num_seqs=128)
    times = Times(**TIMES)
    inp = inputs(m8b, new, old, used=119.3)
    inp.times = times
    plan = plan_apply(inp)
    assert plan.kind == "bridge" and plan.bridge is not None
    assert etas(plan) == [("start", "bridge", 64.0), ("handover", None, 2.0), ("drain", None, 1.5),
                          ("stop", None, 1.0), ("start", "beside", 31.0), ("handover", None, 2.0),
                          ("drain", None, 1.5), ("stop", None, 1.0)]
    assert plan.expected_s == 104.0
    assert plan.dip_s == 1.5 + 1.0 + 31.0 + 2.0  # the bridge alone serves from the old one's drain to the handover
    assert times.asked[0] == ("bridge", str(plan.bridge.gpu_memory_utilization))  # the bridge's own settings


def test_rolling_is_n_times_drain_stop_and_start_with_handovers_and_a_pause_is_drain_stop_start(m8b: Path) -> None:
    old, new = gpu(m8b, replicas=2, gpu_memory_utilization=0.45), gpu(m8b, replicas=3, gpu_memory_utilization=0.45)
    inp = inputs(m8b, new, old, used=0.9 * 139.8, replicas=2)
    inp.times = Times(**TIMES)
    rolling = plan_apply(inp)
    one = [("drain", None, 1.5), ("stop", None, 1.0), ("start", "beside", 31.0)]
    # the second replica drains once the first new one has taken its first requests (a handover between them)
    assert etas(rolling) == [*one, ("handover", None, 2.0), *one, ("start", "beside", 31.0)]
    assert rolling.expected_s == 2 * 33.5 + 2.0 + 31.0
    greedy = gpu(m8b, gpu_memory_utilization=0.95)
    paused = inputs(m8b, greedy, greedy, used=0.95 * 139.8)
    paused.times = Times(**TIMES)
    plan = plan_apply(paused)
    assert plan.kind == "pause" and etas(plan) == [("drain", None, 1.5), ("stop", None, 1.0), ("start", "warm", 25.0)]
    assert plan.pause_s == plan.expected_s == 27.5  # nothing serves from the drain to the new instance's start
    paused.sleep = True
    asleep = plan_apply(paused)
    assert [s.action for s in asleep.step_etas] == ["drain", "sleep", "start"] and asleep.pause_s == 43.5


def test_without_step_times_a_plan_keeps_its_start_etas_and_leaves_the_others_unknown(m8b: Path) -> None:
    plan = plan_apply(inputs(m8b, gpu(m8b, gpu_memory_utilization=0.45), gpu(m8b, gpu_memory_utilization=0.4),
                             used=0.4 * 139.8))
    assert plan.kind == "blue_green" and plan.expected_s == 60.0
    assert [s.eta_s for s in plan.step_etas] == [60.0, None, None, None]
PLANS = [ApplyPlanOut(kind="blue_green", reason="fits beside", expected_s=76.0, pause_s=0.0, capacity_dip_pct=0.0),
         ApplyPlanOut(kind="pause", reason="no room", expected_s=130.0, pause_s=130.0, capacity_dip_pct=100.0),
         ApplyPlanOut(kind="bridge", reason="a bridge fits", expected_s=None, pause_s=0.0, capacity_dip_pct=40.0,
                      dip_s=60.0),
         ApplyPlanOut(kind="rolling", reason="2 replicas", expected_s=150.0, pause_s=0.0, capacity_dip_pct=50.0),
         ApplyPlanOut(kind="start", reason="nothing serves", expected_s=None)]


@pytest.mark.parametrize("plan", PLANS, ids=[p.kind for p in PLANS])
def test_what_clients_should_expect_is_written_once_for_the_console_and_the_cli(
        plan: ApplyPlanOut, capsys: pytest.CaptureFixture[str]) -> None:
    from console.restart import plan_text
    from engine.cli.remote import _print_plan

    expect = plan.expectation()
    _print_plan(plan)
    assert expect in capsys.readouterr().out and expect in plan_text(plan)
    # only a pause (or a first start) holds requests in the queue; a plan that keeps serving never says so
    assert ("queue" in expect) == (plan.kind in ("pause", "start"))
    assert ("It should take about" in plan.summary()) == (plan.expected_s is not None)
