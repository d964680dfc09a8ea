"""Apply plans from the capacity model and the device's free memory: the H200 cases measured on 2026-12-01
(../shared/gpu/bridge-2026-12-01.txt: A at 0.85 holds 119.3 GiB; a bridge at 0.13 beside it held 17,312 KV
tokens; C at 0.85 started beside the bridge) and the CPU build's host memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.capacity.model import GIB, Device, load_shape
from engine.capacity.plans import PlanInputs, Running, plan_apply
from engine.revisions import EngineSettings
from engine.schemas import ApplyPlanOut
from tests.support.data import DEMO_SHAPE

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
    from engine.cli.main import _print_plan

    expect = plan.expectation()
    _print_plan(plan)
    assert expect in capsys.readouterr().out and expect in plan_text(plan)
    # only a pause (or a first start) holds requests in the queue; a plan that keeps serving never says so
    assert ("queue" in expect) == (plan.kind in ("pause", "start"))
    assert ("It should take about" in plan.summary()) == (plan.expected_s is not None)
