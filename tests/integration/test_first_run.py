"""The first run of an engine on a data dir: a model folder that is not there is said, not started."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.engine_process import start_engine, stop_engine

pytestmark = pytest.mark.integration


def test_a_data_dir_without_the_demo_model_builds_it_then_starts_vllm(tmp_path: Path) -> None:
    handle = start_engine(tmp_path / "fresh", demo=False)
    try:
        deadline = time.monotonic() + 60
        status = handle.client.status()
        while "building the demo model" not in status.reason:
            assert time.monotonic() < deadline and status.state != "failed", status
            time.sleep(0.2)
            status = handle.client.status()
        assert status.state == "starting" and status.pid is None  # no vLLM on a missing folder
        deadline = time.monotonic() + 600
        while not any(e.kind == "starting" for e in handle.client.events(kinds=["starting"])):
            assert time.monotonic() < deadline, handle.client.status()
            time.sleep(1)
        kinds = [e.kind for e in handle.client.events(kinds=["demo_model_building", "demo_model_built",
                                                             "starting", "model_missing"])]
        assert kinds[:3] == ["demo_model_building", "demo_model_built", "starting"]
        assert (handle.data_dir / "models" / "demo" / "config.json").is_file()
    finally:
        stop_engine(handle)


def test_a_missing_model_folder_is_named_with_what_to_do_and_vllm_is_not_started(tmp_path: Path) -> None:
    data_dir = tmp_path / "gone"
    model = data_dir / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    handle = start_engine(data_dir, ("LLMOPS_AUTOSTART", "false"))
    try:
        base = handle.client.settings()
        rev = handle.client.put_settings(base.revision, {"model": str(model)}, force=True)
        shutil.rmtree(model)  # the folder goes away before the start (a moved disk, a typo in a copy)
        handle.client.engine_action("start")
        deadline = time.monotonic() + 60
        status = handle.client.status()
        while status.state != "failed":
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
            status = handle.client.status()
        assert str(model) in status.reason and "has no config.json" in status.reason and status.pid is None
        missing = handle.client.events(kinds=["model_missing"])
        assert len(missing) == 1 and missing[0].revision == rev.revision  # said once, not every retry
        assert handle.client.revision(rev.revision).status == "pending"  # not rejected: copy the model back
    finally:
        stop_engine(handle)
