"""The engine with the real vLLM: serving through /v1, applying revisions by restart, stopping cleanly."""

from __future__ import annotations

import json
import re
import sqlite3

import httpx
import psutil
import pytest

from engine.child import group_members
from tests.integration.conftest import COLD_START_S, EngineHandle

pytestmark = pytest.mark.integration


def last_run_args(handle: EngineHandle) -> str:
    """vLLM's own "non-default args" line of its latest start."""
    lines = re.findall(r"non-default args: (\{.*\})", handle.vllm_log())
    assert lines, "vLLM logged no non-default args line"
    return str(lines[-1])


def test_completion_through_the_gateway(engine: EngineHandle) -> None:
    resp = httpx.post(f"{engine.url}/v1/completions", timeout=60,
                      json={"model": "demo", "prompt": "Return the value of the", "max_tokens": 12,
                            "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "demo"
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["completion_tokens"] >= 1
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_streamed_chat_arrives_in_chunks(engine: EngineHandle) -> None:
    chunks: list[dict[str, object]] = []
    done = False
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", timeout=60,
                      json={"model": "demo", "messages": [{"role": "user", "content": "Describe a file."}],
                            "max_tokens": 16, "stream": True, "temperature": 0.8, "seed": 1}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    assert done
    assert len(chunks) >= 3  # role chunk, at least one content chunk, the finish chunk
    assert chunks[0]["object"] == "chat.completion.chunk"


def test_simple_generate_endpoint(engine: EngineHandle) -> None:
    resp = httpx.post(f"{engine.url}/v1/generate", json={"prompt": "This module", "max_tokens": 8}, timeout=60)
    assert resp.status_code == 200
    assert isinstance(resp.json()["result"], str)


def test_bad_input_gets_422_and_no_revision(engine: EngineHandle) -> None:
    before = engine.client.settings().revision
    resp = httpx.put(f"{engine.url}/api/settings", json={"base_revision": before,
                                                         "values": {"max_num_seqs": 0, "dtype": "int4"}})
    assert resp.status_code == 422
    assert {e["loc"][-1] for e in resp.json()["detail"]} == {"max_num_seqs", "dtype"}
    assert engine.client.settings().revision == before
    assert engine.client.status().state == "ready"


def test_max_num_seqs_change_restarts_vllm_with_it(engine: EngineHandle) -> None:
    old = engine.client.status()
    assert old.pid is not None
    rev = engine.client.put_settings(old.desired_revision or 0, {"max_num_seqs": 5}, "test: smaller batch")
    status = engine.client.wait_for({"ready"}, COLD_START_S, revision=rev.revision)
    assert status.pid != old.pid
    assert "'max_num_seqs': 5" in last_run_args(engine)
    assert group_members(old.pid) == [] and not psutil.pid_exists(old.pid)
    assert engine.client.revision(rev.revision).status == "applied"
    assert engine.client.revision(old.running_revision or 0).status == "superseded"
    kinds = [e.kind for e in engine.client.events(kinds=["drained", "stopped", "starting", "ready"])]
    assert kinds[-4:] == ["drained", "stopped", "starting", "ready"]


def test_revision_written_straight_into_sqlite_is_applied(engine: EngineHandle) -> None:
    current = engine.client.settings()
    values = {**current.values, "max_num_seqs": 7}
    with sqlite3.connect(engine.data_dir / "llmops.db") as conn:
        cur = conn.execute('INSERT INTO revision ("values", author, note) VALUES (?, ?, ?)',
                           (json.dumps(values), "dba", "written with sqlite3"))
        new_id = cur.lastrowid
    status = engine.client.wait_for({"ready"}, COLD_START_S, revision=new_id)
    assert status.running_revision == new_id
    assert "'max_num_seqs': 7" in last_run_args(engine)


def test_stop_and_start_leave_no_stray_process(engine: EngineHandle) -> None:
    pid = engine.client.status().pid
    assert pid is not None and len(group_members(pid)) >= 2  # API server plus engine core / worker
    engine.client.engine_action("stop")
    stopped = engine.client.wait_for({"stopped"}, 60)
    assert stopped.pid is None
    assert group_members(pid) == []
    resp = httpx.post(f"{engine.url}/v1/completions", json={"model": "demo", "prompt": "x"}, timeout=10)
    assert resp.status_code == 503 and "stopped" in resp.json()["error"]["message"]  # refused, not left waiting
    assert resp.headers["retry-after"]
    engine.client.engine_action("start")
    started = engine.client.wait_for({"ready"}, COLD_START_S)
    assert started.pid not in (None, pid)
