"""On a GPU: a forced revision that cannot start (utilization 0.11 for an 8B model) is diagnosed and rolled back."""

from __future__ import annotations

import pytest

from engine.client import SettingsRejectedError
from tests.gpu.conftest import START_S, needs_gpu, report
from tests.testkit.engine import EngineHandle
from tests.testkit.wait import wait_until

pytestmark = needs_gpu


def test_too_little_memory_is_refused_then_forced_diagnosed_and_rolled_back(gpu_engine: EngineHandle,
                                                                           serving_8b: int) -> None:
    c = gpu_engine.client
    good = c.wait_for({"ready"}, START_S)
    assert good.running_revision is not None and c.revision(good.running_revision).status == "applied"
    base = c.settings()
    bad = {"gpu_memory_utilization": 0.11, "enforce_eager": True, "max_num_seqs": 256}
    with pytest.raises(SettingsRejectedError) as refused:
        c.put_settings(base.revision, bad, "gpu validation: too small")
    rev = c.put_settings(base.revision, bad, "gpu validation: forced failure", force=True)
    wait_until(lambda: c.revision(rev.revision).status == "rejected", START_S, every=1, what="the rejection")
    diagnosis = [e for e in c.events(kinds=["diagnosis"]) if e.revision == rev.revision][-1]
    back = c.wait_for({"ready"}, START_S, revision=good.running_revision)
    rollback = [e for e in c.events(kinds=["rollback"]) if e.revision == rev.revision][-1]
    report("failure", {"preflight": refused.value.detail, "diagnosis": diagnosis.data,
                       "rollback": rollback.message, "back_ready": back.model_dump(),
                       "oom_count": c.revision(rev.revision).oom_count})
    assert diagnosis.data["kind"] == "no_cache_memory"
    assert back.running_revision == good.running_revision
