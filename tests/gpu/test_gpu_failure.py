"""On a GPU: a forced revision that cannot start (utilization 0.11 for an 8B model) is diagnosed and rolled back."""

from __future__ import annotations

import time

import pytest

from console.client import SettingsRejectedError
from tests.gpu.conftest import START_S, GpuEngine, needs_gpu, report

pytestmark = needs_gpu


def test_too_little_memory_is_refused_then_forced_diagnosed_and_rolled_back(gpu_engine: GpuEngine) -> None:
    c = gpu_engine.client
    good = c.settings()
    assert good.status == "applied", "run test_gpu_engine.py first: it leaves an applied revision"
    bad = {"gpu_memory_utilization": 0.11, "enforce_eager": True, "max_num_seqs": 256}
    with pytest.raises(SettingsRejectedError) as refused:
        c.put_settings(good.revision, bad, "gpu validation: too small")
    rev = c.put_settings(good.revision, bad, "gpu validation: forced failure", force=True)
    c.engine_action("start")
    deadline = time.monotonic() + START_S
    while c.revision(rev.revision).status != "rejected":
        assert time.monotonic() < deadline, c.status()
        time.sleep(1)
    diagnosis = [e for e in c.events(kinds=["diagnosis"]) if e.revision == rev.revision][-1]
    back = c.wait_for({"ready"}, START_S, revision=good.revision)
    rollback = [e for e in c.events(kinds=["rollback"]) if e.revision == rev.revision][-1]
    report("failure", {"preflight": refused.value.detail, "diagnosis": diagnosis.data,
                       "rollback": rollback.message, "back_ready": back.model_dump(),
                       "oom_count": c.revision(rev.revision).oom_count})
    assert diagnosis.data["kind"] == "no_cache_memory"
    assert back.running_revision == good.revision
