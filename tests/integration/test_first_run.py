"""The first run of an engine on a data dir: a model folder that is not there is said, not started."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.schemas import StatusOut as EngineStatus
from tests.support.engine import running_engine
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration


def test_a_data_dir_without_the_demo_model_builds_it_then_starts_vllm(tmp_path: Path) -> None:
    with running_engine(tmp_path / "fresh", demo=False) as handle:
        def building() -> EngineStatus | None:
            status = handle.client.status()
            assert status.state != "failed", status
            return status if "building the demo model" in status.reason else None

        status = wait_until(building, 60, what="the demo model's build")
        assert status.state == "starting" and status.pid is None  # no vLLM on a missing folder
        wait_until(lambda: handle.client.events(kinds=["starting"]), 600, every=1, what="vLLM's start")
        kinds = [e.kind for e in handle.client.events(kinds=["demo_model_building", "demo_model_built",
                                                             "starting", "model_missing"])]
        assert kinds[:3] == ["demo_model_building", "demo_model_built", "starting"]
        assert (handle.data_dir / "models" / "demo" / "config.json").is_file()


def test_a_missing_model_folder_is_named_with_what_to_do_and_vllm_is_not_started(tmp_path: Path) -> None:
    data_dir = tmp_path / "gone"
    model = data_dir / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with running_engine(data_dir, {"LLMOPS_AUTOSTART": "false"}) as handle:
        base = handle.client.settings()
        rev = handle.client.put_settings(base.revision, {"model": str(model)}, force=True)
        shutil.rmtree(model)  # the folder goes away before the start (a moved disk, a typo in a copy)
        handle.client.engine_action("start")
        def failed() -> EngineStatus | None:
            status = handle.client.status()
            return status if status.state == "failed" else None

        status = wait_until(failed, 60, what="the failed state")
        assert str(model) in status.reason and "has no config.json" in status.reason and status.pid is None
        missing = handle.client.events(kinds=["model_missing"])
        assert len(missing) == 1 and missing[0].revision == rev.revision  # said once, not every retry
        assert handle.client.revision(rev.revision).status == "pending"  # not rejected: copy the model back
