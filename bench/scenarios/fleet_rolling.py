"""A deployment of two replicas on a real Ray cluster of two nodes on this host, under N streaming clients: the
throughput before, the longest stretch with no completed request and the throughput during a rolling apply, then
the second node killed: how long the gateway still sent new requests to its instance, what failed (only requests
in flight there may), and how long until the replica served again on the head.

    python -m bench fleet --out DIR [--clients 16] [--window 60] [--node-cores]

``--node-cores``: each Ray node's processes (and what they start: its actors, their vLLM) on a core of its own,
as on separate machines, where a replica that starts on one node takes no CPU from the one that serves on the
other; the engine and the clients, the driver's side, keep every core.

Fresh prompts every request (tests/testkit/load.py: a random word first, no seed to repeat), the prefix cache's hit
rate over the window before the apply read from each replica's own metrics; writes ``fleet-rolling.json`` under
``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from engine.benchmarks.runs import cache_warning
from engine.metrics import CacheUse, Scrape, cache_use, parse
from tests.testkit.engine import COLD_START_S, EngineHandle, instance_headers, running_engine
from tests.testkit.load import Load, longest_gap_span, summary, tokens_per_s
from tests.testkit.ray_cluster import ray_cluster
from tests.testkit.wait import wait_until


def _tree(pid: int) -> list[Any]:
    """Process ``pid`` and its descendants (psutil processes); none if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def confine_nodes(cluster: Any) -> dict[str, list[int]]:
    """Node i's processes and their descendants on core i (mod the cores here); what they start later inherits
    it. The cores each node got, by node id."""
    import psutil

    cores = sorted(os.sched_getaffinity(0))
    placed: dict[str, list[int]] = {}
    for i, node in enumerate(cluster.list_all_nodes()):
        mine = [cores[i % len(cores)]]
        for proc in (p for _, popen in node.live_processes() for p in _tree(popen.pid)):
            with contextlib.suppress(psutil.Error):
                proc.cpu_affinity(mine)
        placed[node.node_id] = mine
    return placed


def instance_cores(engine: EngineHandle) -> dict[str, list[int]]:
    """The cores each instance's processes may run on (its group, threads included), by instance name: with
    ``--node-cores``, whether vLLM kept to its node's (the CPU build may pin its own threads)."""
    import psutil

    cores: dict[str, list[int]] = {}
    for inst in engine.client.status().instances:
        seen: set[int] = set()
        for proc in _tree(inst.pid) if inst.pid is not None else []:
            with contextlib.suppress(psutil.Error, OSError):  # a thread or process that has just ended
                for thread in proc.threads():
                    seen.update(os.sched_getaffinity(thread.id))
        if seen:
            cores[inst.name] = sorted(seen)
    return cores


def scrape_serving(engine: EngineHandle) -> dict[str, Scrape]:
    """Each serving instance's own /metrics (vLLM's, with its key), by instance name."""
    out: dict[str, Scrape] = {}
    for inst in engine.client.status().instances:
        if inst.serving and inst.address:
            with contextlib.suppress(httpx.HTTPError):
                resp = httpx.get(f"{inst.address}/metrics", headers=instance_headers(inst.pid), timeout=10)
                resp.raise_for_status()
                out[inst.name] = parse(resp.text, time.time())
    return out


def window_cache(before: dict[str, Scrape], after: dict[str, Scrape]) -> CacheUse | None:
    """The prefix cache's lookups and hits over a window, summed over the instances that served all of it."""
    uses = [use for name in before.keys() & after.keys() if (use := cache_use(after[name], before[name]))]
    return sum(uses[1:], uses[0]) if uses else None


def serving_nodes(engine: EngineHandle) -> set[str]:
    return {i.node or "" for i in engine.client.status().instances if i.serving}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--window", type=float, default=60.0, help="seconds of steady load measured before the apply")
    p.add_argument("--node-cores", action="store_true", help="each node on a core of its own (see above)")


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "clients": a.clients}

    def save() -> None:
        (a.out / "fleet-rolling.json").write_text(json.dumps(report, indent=1, default=str))

    data_dir = Path(tempfile.mkdtemp(prefix="fleet-rolling-"))
    # the nodes confined before the engine starts any instance: each vLLM inherits its node's core
    with ray_cluster(nodes=2) as cluster, contextlib.nullcontext(
            confine_nodes(cluster) if a.node_cores else None) as cores, running_engine(data_dir, env={
            "LLMOPS_RAY_ADDRESS": cluster.address, "LLMOPS_CRASHLOOP_MAX_FAILURES": "20"}) as engine:
        report["node_cores"] = cores
        engine.client.wait_for({"ready"}, COLD_START_S)
        base = engine.client.settings()
        rev = engine.client.put_settings(base.revision, {"replicas": 2}, "bench: two replicas")
        wait_until(lambda: len(serving_nodes(engine)) == 2 and engine.client.status().running_revision ==
                   rev.revision, 2 * COLD_START_S, every=1.0, what="two replicas on two nodes")
        plan = engine.client.capacity({"max_num_seqs": 6}).plan
        report["plan"] = plan.model_dump() if plan else None
        load = Load(engine.url, clients=a.clients, stream=True, max_tokens=a.max_tokens).start()
        load.wait_for(2 * a.clients, timeout=600)
        report["instance_cores_before"] = instance_cores(engine)
        t_before, scraped = time.monotonic(), scrape_serving(engine)
        time.sleep(a.window)  # a measuring window of steady load, not a wait for a state
        t_apply = time.monotonic()
        use = window_cache(scraped, scrape_serving(engine))  # fresh prompts: a high figure would be a fault
        rolled = engine.client.put_settings(rev.revision, {"max_num_seqs": 6}, "bench: rolling apply")

        def applied() -> bool:
            st = engine.client.status()
            return st.apply is not None and st.apply.revision == rolled.revision and st.apply.outcome != "running"

        wait_until(applied, 2 * COLD_START_S, every=0.5, what="the rolling apply")
        t_applied = time.monotonic()
        report["instance_cores_after"] = instance_cores(engine)
        outcomes = list(load.outcomes)
        gap_from, gap_to = longest_gap_span(outcomes, t_apply, t_applied)
        wall0 = time.time() - (time.monotonic() - t_apply)  # the apply's write, in wall-clock time
        report["rolling"] = {
            "throughput_before_tok_s": tokens_per_s(outcomes, t_before, t_apply, a.max_tokens),
            "prefix_cache_hit_pct_before": use.hit_pct if use is not None else None,
            "cache_warning": cache_warning(use.hit_pct if use is not None else None),
            "throughput_during_tok_s": tokens_per_s(outcomes, t_apply, t_applied, a.max_tokens),
            "longest_gap_s": round(gap_to - gap_from, 3),
            "longest_gap_at_s": [round(gap_from - t_apply, 2), round(gap_to - t_apply, 2)],
            # what the engine did meanwhile, in seconds after the write: where the longest gap lies among them
            "events": [f"{e.ts.timestamp() - wall0:.2f} s: {e.kind}: {e.message}"[:240] for e in engine.client.events(
                since=0, limit=1000) if e.ts.timestamp() >= wall0 - 1],
            "apply_s": round(t_applied - t_apply, 1),
            "failed": sum(1 for o in outcomes if not o.ok and o.finished >= t_apply),
            "engine_gap_s": engine.client.status().apply.longest_gap_s,  # type: ignore[union-attr]
        }
        r = report["rolling"]
        r["during_over_before"] = round(r["throughput_during_tok_s"] / r["throughput_before_tok_s"], 3) \
            if r["throughput_before_tok_s"] else None
        save()
        load.wait_for(load.count() + 2 * a.clients, timeout=600)
        status = engine.client.status()
        other = next(n for n in cluster.list_all_nodes() if not n.head)
        lost = next(i for i in status.instances if i.node == other.node_id)
        kill_wall, kill = time.time(), time.monotonic()
        first = load.count()
        cluster.remove_node(other, allow_graceful=False)
        wait_until(lambda: engine.client.events(kinds=["instance_exited"], since=0, limit=1000) and
                   any(e.data.get("instance") == lost.name for e in engine.client.events(
                       kinds=["instance_exited"], since=0, limit=1000)), 120, every=0.1, what="the exit")
        exited = next(e for e in reversed(engine.client.events(kinds=["instance_exited"], since=0, limit=1000))
                      if e.data.get("instance") == lost.name)
        head = next(n for n in cluster.list_all_nodes() if n.head).node_id
        wait_until(lambda: serving_nodes(engine) == {head} and len([
            i for i in engine.client.status().instances if i.serving]) == 2, 2 * COLD_START_S, every=1.0,
            what="two replicas on the head")
        back = time.monotonic()
        # the replica started again takes the lost one's name: requests sent to that name before it was ready
        again = [e for e in engine.client.events(kinds=["ready"], since=exited.id, limit=1000)
                 if e.data.get("instance") == lost.name]
        again_wall = again[0].ts.timestamp() if again else time.time()
        load.wait_for(load.count() + 2 * a.clients, timeout=600)
        outcomes = load.stop()
        engine.client.close()
        with sqlite3.connect(data_dir / "llmops.db") as db:  # which instance served each request: the ledger
            sent_after = db.execute("SELECT MAX(ts) FROM request_log WHERE instance = ? AND ts > ? AND ts < ?",
                                    (lost.name, kill_wall, again_wall)).fetchone()[0]
        window = outcomes[first:]
        report["node_loss"] = {
            "exit_seen_s": round((seen if isinstance(seen := exited.data.get("seen_at"), int | float)
                                  else exited.ts.timestamp()) - kill_wall, 3),
            "exit_event_written_s": round(exited.ts.timestamp() - kill_wall, 3),
            "exit_message": exited.message,
            "last_request_sent_to_it_s": round(sent_after - kill_wall, 3) if sent_after else None,
            "failed": sum(1 for o in window if not o.ok),
            "failed_after_exit_seen": sum(1 for o in window if not o.ok and
                                          o.finished - o.seconds > kill + (exited.ts.timestamp() - kill_wall)),
            "replica_back_on_head_s": round(back - kill, 1),
            "requests": len(window),
        }
        report["load"] = summary(outcomes)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(json.dumps({k: report[k] for k in ("rolling", "node_loss", "load")}, indent=1))

