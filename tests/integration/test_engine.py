"""The engine with the real vLLM: serving through /v1, applying revisions by restart, stopping cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import psutil
import pytest

from engine.client import SettingsRejectedError
from engine.schemas import StatusOut
from engine.vllm import group_members
from tests.support.engine import COLD_START_S, ENGINE_ONLY_ENV, HF_TOKEN, EngineHandle
from tests.support.load import Load, longest_gap, summary
from tests.support.wait import wait_until

pytestmark = pytest.mark.integration
# Longer than any stretch without a completed request that an apply beside the serving instance causes on a busy
# 2-core machine (2.6 s the worst seen), shorter than a pause (a whole vLLM start, 30 s or more): the tests tell the
# two apart; bench/apply_gap.py measures the figure itself.
PAUSE_BOUND_S = 15.0


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


def test_hub_token_reaches_vllm_through_its_environment_only(engine: EngineHandle) -> None:
    pid = engine.client.status().pid
    assert pid is not None
    vllm = psutil.Process(pid)
    environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    assert f"HF_TOKEN={HF_TOKEN}" in environ
    names = {item.partition("=")[0] for item in environ}
    assert names & {*ENGINE_ONLY_ENV, "LLMOPS_ADMIN_PASSWORD", "LLMOPS_HF_TOKEN"} == set()  # an allow-list
    assert "VLLM_API_KEY" in names  # the instance's own key: its /v1 answers the gateway only
    port = engine.client.status().instances[0].port  # vLLM's own port: no key, no answer
    direct = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                        json={"model": "demo", "prompt": "x", "max_tokens": 1})
    assert direct.status_code == 401
    # vLLM works in the data dir: a relative --model (a hub id) cannot name a folder where the engine was started
    assert Path(os.readlink(f"/proc/{pid}/cwd")) == engine.data_dir.resolve()
    assert not any(HF_TOKEN in arg for p in [vllm, *vllm.children(recursive=True)] for arg in p.cmdline())
    places = {"vLLM's log": engine.vllm_log(),
              "engine output": (engine.data_dir / "engine-stdout.log").read_text(errors="replace"),
              "engine log": (engine.data_dir / "logs" / "engine.log").read_text(errors="replace"),
              "events": str([e.model_dump() for e in engine.client.events(limit=5000)]),
              "audit": str(engine.client.audit(limit=10_000)), "status": engine.client.status().model_dump_json()}
    assert [where for where, text in places.items() if HF_TOKEN in text or engine.token in text] == []


def test_bad_input_gets_422_and_no_revision(engine: EngineHandle) -> None:
    before = engine.client.settings().revision
    resp = httpx.put(f"{engine.url}/api/settings", headers=engine.auth,
                     json={"base_revision": before, "values": {"max_num_seqs": 0, "dtype": "int4"}})
    assert resp.status_code == 422
    assert {e["loc"][-1] for e in resp.json()["detail"]} == {"max_num_seqs", "dtype"}
    assert engine.client.settings().revision == before
    assert engine.client.status().state == "ready"


def test_an_apply_under_16_streams_never_pauses(engine: EngineHandle) -> None:
    """The zero-pause bar (issue 14): 16 clients stream in a loop while a new max_num_seqs is applied. The
    plan, shown before the write, is blue/green (two demo instances fit this host); the new instance starts beside
    the old one, takes the traffic, and the old one drains: no request fails and something serves throughout.

    What must always hold is asserted: 0 failed, the engine never had nothing serving, the plan ran. How long
    clients went without a completed request is a figure of this machine's load (1.3-2.6 s seen on a busy 2-core
    host), measured by bench/apply_gap.py; the bound here only tells a pause (a whole start, 30 s or more) from a
    blue/green apply, with a margin that holds on a shared CI machine."""
    old = engine.client.status()
    assert old.pid is not None and len(old.instances) == 1
    plan = engine.client.capacity({"max_num_seqs": 5}).plan
    assert plan is not None and plan.kind == "blue_green" and plan.pause_s == 0
    load = Load(engine.url, clients=16, stream=True).start()
    load.wait_for(32, timeout=120)  # traffic flows before the change
    t0 = time.monotonic()
    rev = engine.client.put_settings(old.desired_revision or 0, {"max_num_seqs": 5}, "test: smaller batch")
    seen: list[int] = []
    starting_nice: set[int] = set()  # the new instance's priority while it starts beside the one that serves

    def starting_pids(status: StatusOut) -> set[int]:
        return {i.pid for i in status.instances if i.role == "starting" and i.pid is not None}

    def applied() -> StatusOut | None:
        status = engine.client.status()
        seen.append(len(status.instances))
        sampled: dict[int, int] = {}
        for pid in starting_pids(status):
            with contextlib.suppress(psutil.Error):
                sampled[pid] = psutil.Process(pid).nice()
        if sampled:  # a sample counts only if the instance still starts after it: one that began to serve in
            # between is reniced to vllm_nice (the role changes with the renice, so a later "starting" is proof)
            still = starting_pids(engine.client.status())
            starting_nice.update(nice for pid, nice in sampled.items() if pid in still)
        done = status.apply is not None and status.apply.revision == rev.revision and status.apply.outcome != "running"
        return status if done else None

    status = wait_until(applied, COLD_START_S, every=0.2, what="the apply's end")
    t1 = time.monotonic()
    after = load.count()
    load.wait_for(after + 32, timeout=120)  # and flows on the new instance
    outcomes = load.stop()
    counts = summary(outcomes)
    assert counts["ok"] == counts["total"], (counts, [o for o in outcomes if not o.ok][:3])
    gap = longest_gap(outcomes, t0, t1)
    assert gap < PAUSE_BOUND_S, f"{gap:.2f} s with no completed request during the apply: that is a pause"
    assert status.apply is not None and status.apply.outcome == "applied" and status.apply.longest_gap_s in (None, 0)
    assert max(seen) == 2 and len(status.instances) == 1  # both side by side, then the new one alone
    assert status.running_revision == rev.revision and status.pid != old.pid
    # it started at start_beside_nice, the cores left to the instance that served; it serves at vllm_nice
    assert starting_nice == {19}, starting_nice
    refused = engine.client.events(kinds=["nice_refused"], since=0)
    assert psutil.Process(status.pid).nice() == 0 or refused, psutil.Process(status.pid).nice()
    # the state's reason says what serves now, not the apply's last step ("draining instance b", for minutes)
    assert "draining" not in status.reason and f"revision {rev.revision} serving" in status.reason, status.reason
    ready = httpx.get(f"{engine.url}/readyz", timeout=10).json()
    assert "draining" not in ready["reason"], ready
    assert "'max_num_seqs': 5" in last_run_args(engine)
    assert group_members(old.pid) == [] and not psutil.pid_exists(old.pid)
    assert engine.client.revision(rev.revision).status == "applied"
    assert engine.client.revision(old.running_revision or 0).status == "superseded"
    kinds = [e.kind for e in engine.client.events(kinds=["apply_plan", "starting", "ready", "drained", "stopped",
                                                          "apply_done"], since=0) if e.revision in (
        rev.revision, old.running_revision)]
    assert kinds[-6:] == ["apply_plan", "starting", "ready", "drained", "stopped", "apply_done"]


def test_revision_written_straight_into_sqlite_is_applied(engine: EngineHandle) -> None:
    current = engine.client.settings()
    values = {**current.values.model_dump(), "max_num_seqs": 7}
    with sqlite3.connect(engine.data_dir / "llmops.db") as conn:
        cur = conn.execute('INSERT INTO revision ("values", author, note) VALUES (?, ?, ?)',
                           (json.dumps(values), "dba", "written with sqlite3"))
        new_id = cur.lastrowid
    status = engine.client.wait_for({"ready"}, COLD_START_S, revision=new_id)
    assert status.running_revision == new_id
    assert "'max_num_seqs': 7" in last_run_args(engine)


def test_forced_revision_that_cannot_start_is_rolled_back_and_diagnosed(engine: EngineHandle) -> None:
    good = engine.client.status()
    assert good.running_revision is not None
    before = engine.client.settings()
    with pytest.raises(SettingsRejectedError) as refused:  # pre-flight refuses it first ...
        engine.client.put_settings(before.revision, {"cpu_kv_cache_gib": 0.001}, "too small")
    assert refused.value.fields[0][0] == "cpu_kv_cache_gib"
    load = Load(engine.url, clients=16, stream=True).start()
    load.wait_for(16, timeout=120)
    t0 = time.monotonic()
    bad = engine.client.put_settings(before.revision, {"cpu_kv_cache_gib": 0.001}, "forced", force=True)
    assert bad.forced
    wait_until(lambda: engine.client.revision(bad.revision).status == "rejected", COLD_START_S, every=0.5,
               what="the forced revision's rejection")  # ... forced, it fails and is rejected
    t1 = time.monotonic()
    outcomes = load.stop()
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
    # traffic never left the instance that served (a pause would be a whole start, ~30 s); the failing start
    # beside it shares this machine's two cores, which slows it for a few seconds
    assert longest_gap(outcomes, t0, t1) < PAUSE_BOUND_S
    rejected = engine.client.revision(bad.revision)
    assert rejected.status_reason.startswith("kv_cache_too_small")
    assert rejected.oom_count == 1
    back = engine.client.wait_for({"ready"}, COLD_START_S, revision=good.running_revision)
    assert back.desired_revision == good.running_revision
    events = {e.kind: e for e in engine.client.events(kinds=["diagnosis", "rollback"])
              if e.revision == bad.revision}
    assert events["diagnosis"].data["kind"] == "kv_cache_too_small"
    assert events["rollback"].data["back_to"] == good.running_revision


def test_sigkill_of_vllm_under_load_recovers_on_the_same_revision(engine: EngineHandle) -> None:
    before = engine.client.status()
    assert before.pid is not None and before.running_revision is not None
    load = Load(engine.url, clients=8).start()
    load.wait_for(16, timeout=120)
    marker = engine.client.events(limit=1, newest_first=True)[0].id
    killed_at = time.time()
    os.kill(before.pid, signal.SIGKILL)  # the API server only: its engine core and worker are left behind

    def exit_seen() -> float | None:  # the exit is seen through the process itself, not its log pipe or /health
        found = engine.client.events(kinds=["instance_exited"], since=marker)
        return found[0].ts.timestamp() if found else None

    seen_at = wait_until(exit_seen, 60, every=0.1, what="the instance_exited event")
    # at once on a quiet machine (bench/crash_detect.py measures it under load); the margin holds on a busy CI
    # host, where the engine core's held log pipe or three failed /health probes took 8-20 s before
    assert seen_at - killed_at < 5.0, f"the exit was seen {seen_at - killed_at:.1f} s after the SIGKILL"
    def replaced() -> StatusOut | None:
        status = engine.client.status()
        return status if status.state == "ready" and status.pid != before.pid else None

    after = wait_until(replaced, COLD_START_S, every=0.5, what="a new vLLM, ready")
    assert after.running_revision == before.running_revision
    seen = load.count()
    load.wait_for(seen + 16, timeout=120)
    outcomes = load.stop()
    counts = summary(outcomes)
    assert counts["exceptions"] == 0 and counts["other"] == 0, counts  # nothing left hanging or odd
    assert counts["ok"] + counts["503"] + counts["stream_errors"] == counts["total"]
    assert counts["ok"] >= 32
    assert after.pid != before.pid and group_members(before.pid) == []
    kinds = [e.kind for e in engine.client.events(kinds=["failed", "diagnosis", "restart_scheduled", "ready"])]
    assert kinds[-4:] == ["failed", "diagnosis", "restart_scheduled", "ready"]


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


def test_max_num_seqs_within_its_ceiling_takes_effect_without_a_restart(engine: EngineHandle) -> None:
    """vLLM's KV cache does not depend on max_num_seqs: started with a ceiling, the instance keeps running and the
    gateway holds it to each new max_num_seqs from the next request (the plan says so before the write)."""
    base = engine.client.settings()
    ceiling = engine.client.put_settings(base.revision, {"max_num_seqs": 2, "max_num_seqs_ceiling": 8},
                                         "test: headroom for max_num_seqs")
    started = engine.client.wait_for({"ready"}, COLD_START_S, revision=ceiling.revision)
    assert "'max_num_seqs': 8" in last_run_args(engine)  # vLLM runs with the ceiling
    plan = engine.client.capacity({"max_num_seqs": 6}).plan
    assert plan is not None and plan.kind == "soft" and plan.pause_s == 0
    load = Load(engine.url, clients=16, stream=True).start()
    try:
        load.wait_for(16, timeout=300)
        for seqs in (6, 3):
            rev = engine.client.put_settings(engine.client.settings().revision, {"max_num_seqs": seqs},
                                             f"test: max_num_seqs {seqs}")
            status = engine.client.wait_for({"ready"}, 60, revision=rev.revision, poll=0.1)
            assert status.pid == started.pid and len(status.instances) == 1  # no restart
            # requests let in under the higher cap end as they would; none more are let in meanwhile
            wait_until(lambda: engine.client.status().gateway.in_flight <= seqs, 60, every=0.05,  # noqa: B023
                       what=f"the requests in flight down to {seqs}")
            seen = [engine.client.status().gateway for _ in range(20)]
            assert max(g.in_flight for g in seen) <= seqs and max(g.waiting for g in seen) > 0  # held to it
        outcomes = load.stop()
        assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok][:3]
    finally:
        if not load._stop.is_set():
            load.stop()
    soft = [e for e in engine.client.events(kinds=["applied_soft"], limit=10, newest_first=True)]
    assert soft and "in effect now" in soft[0].message and "nothing restarts" in soft[0].message
    assert engine.client.revision(rev.revision).status == "applied"
