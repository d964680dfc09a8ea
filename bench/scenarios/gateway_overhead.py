"""What the /v1 gateway costs clients: vLLM's own serving benchmark, direct to the vLLM child and through the
engine's gateway, alternated in one run, at several concurrencies.

    python -m bench gateway-overhead --out DIR                                   # CPU: the demo model
    python -m bench gateway-overhead --out DIR --model /tmp/m8b --load-format dummy --utilization 0.85 \\
        --max-num-seqs 256 --concurrency 64 256 512 --input-len 200 --output-len 128 --prompts-per-client 4
    python -m bench gateway-overhead --profile h200 --ray          # the H200's knobs, the engine on a Ray head
    python -m bench gateway-overhead --out DIR --tree before=/path/to/old/checkout --tree after=.

Each ``--tree`` is a checkout of this project: its engine is started in turn (one at a time, same settings),
so "before" and "after" are measured side by side in one run. For each concurrency and round it runs
direct, gateway, gateway, direct (so drift does not favour either) and records vLLM's figures, the
inter-token gaps of every request, and the CPU of the engine process (with ``--data-port``, and of its gateway
workers, which then relay the gateway's runs; and of vLLM's API server) during the run. Prints the ratio table
and writes ``gateway-overhead.json`` and ``gateway-overhead.md`` under ``--out``.

Every run sends fresh prompts: vLLM's random dataset is drawn from a new seed each run (recorded with it; ``--seed``
fixes one on purpose, a cache test), since the same prompts a second time are served from vLLM's prefix cache and
the later runs would measure the cache. Each run also records the share of its prompt tokens vLLM found in the
prefix cache (vLLM's own /metrics counters over the run) and warns above 20 %.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.base import REPO
from engine.benchmarks.runs import cache_warning, fresh_seed
from engine.metrics import CacheUse, cache_use, parse

ADMIN_PASSWORD = "gateway-overhead-bench"


def vllm_bench(argv: list[str], out: Path) -> None:
    """Run in a subprocess: vLLM's benchmark, its full result (per-request ITLs included) written to ``out``."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv))
    keep = {k: v for k, v in result.items() if k in ("itls", "ttfts", "output_lens", "errors")
            or isinstance(v, int | float | str | bool) or v is None}
    out.write_text(json.dumps(keep, default=str))


def _environ(pid: int) -> dict[str, str] | None:
    """The environment of process ``pid`` (the same user's), None where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return dict(v.decode(errors="replace").split("=", 1) for v in raw if b"=" in v)


def vllm_key(pid: int) -> str | None:
    """The API key the engine gave its vLLM child (VLLM_API_KEY in its environment): the direct path needs it, as
    vLLM refuses /v1 without it. Readable by the same user only, as the engine intends."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"VLLM_API_KEY=")), None)


def wait_up(url: str, proc: subprocess.Popen[Any], within_s: float, failure: str) -> None:
    """Poll ``url`` until it answers 200; ``failure`` if ``proc`` exits first or ``within_s`` pass."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(failure)
        time.sleep(0.3)


class Engine:
    """One engine of one checkout, started on its own data dir and port, with vLLM serving the bench settings."""

    def __init__(self, tree: Path, label: str, args: argparse.Namespace, workdir: Path) -> None:
        self.tree, self.label, self.args = tree, label, args
        self.data_dir = workdir / f"data-{label}"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "LLMOPS_ADMIN_PASSWORD": ADMIN_PASSWORD, "LLMOPS_AUTOSTART": "false",
               "LLMOPS_STARTUP_TIMEOUT_S": "1200",
               "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.data_url: str | None = None  # the gateway workers' port (--data-port)
        if getattr(args, "workers", None) is not None:
            env["LLMOPS_GATEWAY_WORKERS"] = str(args.workers)
        if getattr(args, "data_port", False):
            data_port = _free_port()
            env["LLMOPS_GATEWAY_PORT"] = str(data_port)
            self.data_url = f"http://127.0.0.1:{data_port}"
        if args.model:
            env["LLMOPS_MODEL_ROOTS"] = json.dumps([str(Path(args.model).resolve().parent)])
        else:
            models = self.data_dir / "models"
            models.mkdir(exist_ok=True)
            if not (models / "demo").exists():
                (models / "demo").symlink_to((REPO / "data" / "models" / "demo").resolve())
            env["LLMOPS_MODEL_ROOTS"] = json.dumps([str((REPO / "data" / "models").resolve())])
        self.log = open(workdir / f"engine-{label}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(self.data_dir),
                                      "--port", str(self.port)], cwd=tree, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        if args.engine_nice is not None:  # an experiment: the engine's CPU priority over vLLM and the client
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(task.name), args.engine_nice)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        wait_up(f"{self.url}/healthz", self.proc, 120, f"engine {label} did not come up: see {self.log.name}")
        token = self.http.post("/api/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}).json()
        self.http.headers["authorization"] = f"Bearer {token['token']}"

    def pids(self) -> list[int]:
        """The engine's process and, with --data-port, its gateway workers' (what relays the gateway's runs)."""
        if self.data_url is None:
            return [self.proc.pid]
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return [self.proc.pid]
        workers = []
        for child in children:
            with contextlib.suppress(psutil.Error):
                if "engine.gateway.worker" in " ".join(child.cmdline()):
                    workers.append(child.pid)
        return [self.proc.pid, *workers]

    def serve(self) -> None:
        a = self.args
        base = self.http.get("/api/settings").json()
        values: dict[str, Any] = {"max_num_seqs": a.max_num_seqs, "served_model_name": "bench",
                                  **(getattr(a, "values", None) or {})}  # a scenario's own settings
        if a.cap_vs_restart:  # headroom asked for: vLLM runs with --max-num-seqs as its ceiling
            values["max_num_seqs_ceiling"] = a.max_num_seqs
        if a.model:
            values.update(model=str(Path(a.model).resolve()), gpu_memory_utilization=a.utilization,
                          max_model_len=a.max_model_len, load_format=a.load_format)
        else:
            values["model"] = str(self.data_dir / "models" / "demo")
        r = self.http.put("/api/settings", json={"base_revision": base["revision"], "values": values,
                                                 "note": "gateway overhead bench", "force": True})
        r.raise_for_status()
        self.http.post("/api/engine/start")
        deadline = time.monotonic() + 1500
        while (st := self.http.get("/api/status").json())["state"] != "ready":
            if time.monotonic() > deadline or st["state"] == "failed":
                raise SystemExit(f"engine {self.label}: vLLM did not become ready: {st['reason']}")
            time.sleep(1)
        self.refresh()

    def refresh(self) -> None:
        """Where the instance that serves now listens, its pid and key (again after an apply replaced it)."""
        st = self.http.get("/api/status").json()
        started = self.http.get("/api/events", params={"kind": "starting", "newest_first": True, "limit": 1}).json()
        args = started[0]["data"]["args"]
        self.direct_url = f"http://127.0.0.1:{args[args.index('--port') + 1]}"
        self.vllm_pid = int(st["pid"])
        # where the gateway reaches it: on Ray the node's actor chooses the address and port, not these args
        serving = [i for i in st.get("instances") or [] if i.get("serving")]
        if serving:
            address = serving[0].get("address") or f"http://127.0.0.1:{serving[0]['port']}"  # a URL (InstanceOut)
            self.direct_url = address.rstrip("/")
            self.vllm_pid = int(serving[0].get("pid") or st["pid"])
        self.vllm_key = vllm_key(self.vllm_pid)

    def save_events(self) -> None:
        """The starts and applies as the engine recorded them (their ETAs against what they took: issue 20 item 3),
        written after each --after step too: on 2026-12-04 a machine taken back before the end kept none."""
        try:
            events = self.http.get("/api/events", params={"limit": 5000}).json()
            (self.args.out / f"events-{self.label}.json").write_text(json.dumps(events, indent=1))
        except (httpx.HTTPError, ValueError) as exc:
            print(f"engine {self.label}: its events could not be read ({exc})", flush=True)

    def stop(self) -> None:
        self.save_events()
        self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        self.log.close()


def probe(engine: Engine, item: str) -> dict[str, Any]:
    """The plan the engine would choose for one change of what it serves now."""
    key, _, value = item.partition("=")
    r = engine.http.get("/api/capacity", params={key: value})
    r.raise_for_status()
    plan = r.json().get("plan") or {}
    return {"change": item, "kind": plan.get("kind"), "reason": plan.get("reason"),
            "expected_s": plan.get("expected_s"), "pause_s": plan.get("pause_s"),
            "capacity_dip_pct": plan.get("capacity_dip_pct"),
            "steps": [s.get("action") for s in plan.get("step_etas") or []], "errors": r.json().get("errors")}


class Beside:
    """vLLM started by the bench itself, beside the engine's instance, with the engine's own arguments but another
    port and ``max_num_seqs`` (and ``extra`` flags): "vLLM restarted with N" of the cap-vs-restart comparison (issue
    20, item 4), direct."""

    def __init__(self, engine: Engine, max_num_seqs: int, workdir: Path, extra: tuple[str, ...] = (),
                 label: str = "") -> None:
        started = engine.http.get("/api/events", params={"kind": "starting", "newest_first": True, "limit": 1}).json()
        recorded = list(started[0]["data"]["args"])  # the argv after its executable (nice's, where it ran at one)
        # the engine's own command and environment, but for the port and max_num_seqs: at its nice value, with what
        # the engine (or Ray's actor: OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES) gave its process
        args = ["nice", *recorded] if recorded[0] == "-n" else [sys.executable, *recorded[recorded.index("-m"):]]
        port = _free_port()
        args[args.index("--port") + 1] = str(port)
        args[args.index("--max-num-seqs") + 1] = str(max_num_seqs)
        args += list(extra)
        self.args = args
        self.proc = engine.proc  # the engine's CPU is still the one read (it idles: the runs go direct)
        self.direct_url = f"http://127.0.0.1:{port}"
        self.vllm_key = None
        self.log_path = workdir / f"beside-{max_num_seqs}{label}.log"
        self.kept = engine.args.out / self.log_path.name  # its start's phases, beside the results
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = {k: v for k, v in (_environ(engine.vllm_pid) or os.environ).items() if k != "VLLM_API_KEY"}
        t0 = time.monotonic()
        self.child = subprocess.Popen(args, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                      start_new_session=True, cwd=engine.data_dir)
        self.vllm_pid = self.child.pid
        try:
            wait_up(f"{self.direct_url}/v1/models", self.child, 900,
                    f"vLLM with max_num_seqs {max_num_seqs} did not come up: see {self.log_path}")
        except SystemExit:  # not left holding the GPU's memory beside the runs that go on without it
            self.stop()
            raise
        self.ready_s = round(time.monotonic() - t0, 1)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.child.pid, 15)
        try:
            self.child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.child.pid, 9)
            self.child.wait()
        self.log.close()
        shutil.copyfile(self.log_path, self.kept)


MEMORY_LINE = re.compile(r"Actual usage is ([\d.]+) GiB for weight, ([\d.]+) GiB for peak activation, ([\d.]+) GiB "
                         r"for non-torch memory, and ([\d.]+) GiB for CUDAGraph memory")
KV_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
GRAPHS_LINE = re.compile(r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB")
GRAPH_SIZES = re.compile(r"Capturing CUDA graphs \((FULL|PIECEWISE)\):\s+\d+%\|[^|]*\|\s*\d+/(\d+)")


def start_report(lines: list[str]) -> dict[str, Any]:
    """What one vLLM start logged of its memory: the last report in ``lines``."""
    out: dict[str, Any] = {}
    for line in lines:
        if m := MEMORY_LINE.search(line):
            out.update(weights_gib=float(m[1]), activation_gib=float(m[2]), non_torch_gib=float(m[3]),
                       cuda_graph_gib=float(m[4]))
        if m := KV_LINE.search(line):
            out["kv_tokens"] = int(m[1].replace(",", ""))
        if m := GRAPHS_LINE.search(line):
            out.update(graph_capture_s=int(m[1]), graph_capture_gib=float(m[2]))
        for kind, sizes in GRAPH_SIZES.findall(line):  # how many batch sizes it captured, per mode
            out[f"graphs_{kind.lower()}"] = int(sizes)
    return out


def apply_values(engine: Engine, values: dict[str, Any], note: str = "cap-vs-restart bench") -> dict[str, Any]:
    """Write ``values`` (an apply, forced past pre-flight) and wait for its end: the plan shown before the write, the
    plan it ran, its outcome, how long it took against the plan's ETA, the start it made (its ready event) and where
    the gateway reaches the instance that serves after it."""
    current = engine.http.get("/api/settings").json()
    shown = engine.http.get("/api/capacity", params=values).json().get("plan") or {}
    marker = engine.http.get("/api/events", params={"limit": 1, "newest_first": True}).json()[0]["id"]
    t0 = time.monotonic()
    r = engine.http.put("/api/settings", json={"base_revision": current["revision"], "values": values,
                                               "force": True, "note": note})
    r.raise_for_status()
    rev = r.json()["revision"]
    while True:  # a plan in effect now leaves no apply record: the revision serves, and that is the end
        st = engine.http.get("/api/status").json()
        apply = st.get("apply") or {}
        if apply.get("revision") == rev and apply.get("outcome") != "running":
            break
        if st.get("running_revision") == rev and apply.get("outcome") != "running":
            break
        if time.monotonic() - t0 > 900:
            raise SystemExit(f"the apply of {values} did not end in 900 s")
        time.sleep(0.1)
    took = round(time.monotonic() - t0, 2)
    events = engine.http.get("/api/events", params={"since": marker, "limit": 500}).json()
    engine.refresh()
    ran = (apply.get("plan") or {}) if apply.get("revision") == rev else {}
    return {"values": values, "revision": rev, "plan_shown": shown.get("kind"), "reason": shown.get("reason"),
            "plan": ran.get("kind") or shown.get("kind"),
            "outcome": apply.get("outcome") if apply.get("revision") == rev else "in effect",
            "apply_s": took, "predicted_s": shown.get("expected_s"),
            "steps_shown": [{"action": x.get("action"), "eta_s": x.get("eta_s"), "basis": x.get("basis")}
                            for x in shown.get("step_etas") or []],
            "timings": (apply.get("timings") or []) if apply.get("revision") == rev else [],
            "ready": [e["data"] for e in events if e["kind"] == "ready"],
            "woken": [e["data"] for e in events if e["kind"] == "woken"],
            "events": [f"{e['kind']}: {e['message'][:200]}" for e in events]}


def plan_settles(engine: Engine, values: dict[str, Any], within_s: float) -> float:
    """Wait (at most ``within_s``) until the engine plans ``values`` as a blue/green: the memory of a vLLM stopped
    a moment ago is seen free (its GPU sampler reads once a second). How long it took; ``within_s`` if it never
    did (the apply then runs the plan it gets, recorded with it)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        plan = engine.http.get("/api/capacity", params=values).json().get("plan") or {}
        if plan.get("kind") == "blue_green":
            break
        time.sleep(1.0)
    return round(time.monotonic() - t0, 1)


def graph_lines(engine: Engine) -> list[str]:
    """vLLM's lines of every start of this engine that say what its CUDA graphs and KV cache took."""
    lines: list[str] = []
    for term in ("Graph capturing finished", "Capturing CUDA graphs", "KV cache size", "GiB for weight"):
        got = engine.http.get("/api/logs", params={"tail": 5000, "contains": term}).json()["lines"]
        lines += [line[-400:] for line in got]  # a tqdm line carries every step of its bar: its end says the count
    return lines


def capture_size(ceiling: int) -> int:
    """vLLM's largest CUDA-graph batch for an instance started with max_num_seqs ``ceiling`` (vLLM 0.26's
    VllmConfig._set_cudagraph_sizes: twice max_num_seqs, at most 512)."""
    return min(2 * ceiling, 512)


def cap_vs_restart(engine: Engine, a: argparse.Namespace, workdir: Path, report: dict[str, Any],
                   save: Any) -> None:
    """For each N, at 2N clients, three ways of running at most N requests at a time:

    - **cap**: the engine's instance, started with the ceiling (--max-num-seqs), held to N by the gateway (a
      max_num_seqs within the ceiling: no restart), through the gateway;
    - **graphs**: vLLM started beside it with --max-num-seqs N and the ceiling's CUDA graphs
      (--max-cudagraph-capture-size, vLLM's default for the ceiling), direct: the cap's like for like;
    - **restarted**: the engine restarted with N (max_num_seqs_ceiling N: an apply), vLLM's own graphs for N,
      through the gateway: what an operator gets without a ceiling.

    Runs: graphs, cap, cap, graphs (drift favours neither), then restarted, restarted; then the ceiling back (an
    apply). Both applies are starts the engine estimates (issue 20 item 3). On 2026-12-03 the cap gave ×1.44-1.56
    the throughput of vLLM restarted with N: vLLM sizes its CUDA graphs from max_num_seqs (twice it, at most 512),
    so with N = 128 a step of 128 decodes and a prefill chunk runs without graphs, where the ceiling's 512 hold it."""
    report["cap"] = {"ceiling": a.max_num_seqs, "capture_size": capture_size(a.max_num_seqs),
                     "ceiling_start": start_report(graph_lines(engine)), "levels": []}
    ready = engine.http.get("/api/events", params={"kind": "ready", "newest_first": True, "limit": 1}).json()
    report["cap"]["ceiling_ready_event"] = ready[0]["data"] if ready else None
    for level_i, n in enumerate(a.cap_vs_restart):
        level: dict[str, Any] = {"n": n, "clients": 2 * n, "soft": apply_values(engine, {"max_num_seqs": n}),
                                 "runs": []}
        report["cap"]["levels"].append(level)
        save()
        prompts = a.cap_prompts[level_i] if level_i < len(a.cap_prompts) else max(2 * n * a.prompts_per_client,
                                                                                  a.min_prompts)

        def measure(path: str, who: Any, url: str, i: int, level: dict[str, Any] = level, n: int = n,
                    prompts: int = prompts) -> None:
            try:
                run = run_once(who, url, 2 * n, a, workdir, f"cap-{n}-{i}-{path}", prompts=prompts)
            except SystemExit as exc:  # recorded; the other arms, levels and --after steps still run
                level["runs"].append({"path": path, "error": str(exc)[-2000:]})
                save()
                print(f"N={n}, {path}: the run failed: {str(exc)[-300:]}", flush=True)
                return
            level["runs"].append({"path": path, **run})
            save()
            print(f"N={n}, {2 * n} clients, {path}: {run['output_tok_s']:.0f} tok/s, "
                  f"P95 latency {run['e2el_p95_ms']:.0f} ms, ITL P50 {run['itl_p50_ms']:.1f} ms, {run['wall_s']} s",
                  flush=True)

        try:
            beside: Beside | None = Beside(engine, n, workdir, ("--max-cudagraph-capture-size",
                                                                str(capture_size(a.max_num_seqs))), "-graphs")
        except SystemExit as exc:  # the cap and the restart are still measured: say why this one is missing
            level["graphs_error"] = str(exc)
            beside = None
        try:
            if beside is not None:
                level["graphs_ready_s"] = beside.ready_s
                level["graphs_start"] = start_report(beside.log_path.read_text(errors="replace").splitlines())
            # both warmed alike, at the level's own clients and lengths
            for who in (beside, engine):
                if who is not None:
                    run_once(who, who.direct_url if who is beside else engine.url, 2 * n, a, workdir,
                             f"cap-warmup-{n}", prompts=4 * n)
            order = (("graphs", beside), ("cap", engine), ("cap", engine), ("graphs", beside))
            for i, (path, who) in enumerate(order[:a.cap_runs]):
                if who is not None:
                    measure(path, who, who.direct_url if who is beside else engine.url, i)
        finally:
            if beside is not None:
                beside.stop()
        # restarted with N: the engine's own apply, a blue/green beside the instance that serves once the engine's
        # GPU reading has seen the stopped vLLM's memory free (on 2026-12-04, written a second after the stop, it
        # was planned as a bridge)
        level["restart_plan_wait_s"] = plan_settles(engine, {"max_num_seqs_ceiling": n}, within_s=30.0)
        level["restart"] = apply_values(engine, {"max_num_seqs_ceiling": n})
        save()
        if level["restart"]["outcome"] == "applied":
            run_once(engine, engine.url, 2 * n, a, workdir, f"cap-warmup-restarted-{n}", prompts=4 * n)
            for i in range(a.cap_runs // 2):
                measure("restarted", engine, engine.url, a.cap_runs + i)
        else:  # the old instance (the ceiling, capped) still serves: its runs would not be a restart's
            print(f"N={n}: the restart was {level['restart']['outcome']}: no restarted runs", flush=True)
        level["back"] = apply_values(engine, {"max_num_seqs_ceiling": a.max_num_seqs})
        for key in ("output_tok_s", "e2el_p95_ms", "ttft_p95_ms", "itl_p50_ms"):
            by = {path: [x[key] for x in level["runs"] if x["path"] == path and x.get(key) is not None]
                  for path in ("cap", "graphs", "restarted")}
            for other in ("graphs", "restarted"):
                if by["cap"] and by[other]:
                    level[f"{key}_cap_over_{other}"] = round(statistics.fmean(by["cap"]) /
                                                             statistics.fmean(by[other]), 3)
        save()
    report["cap"]["graph_lines"] = graph_lines(engine)
    report["cap"]["starts"] = start_report(report["cap"]["graph_lines"])
    apply_values(engine, {"max_num_seqs": a.max_num_seqs})
    save()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except psutil.Error:
        return 0.0


def _cpu_of(pids: list[int]) -> dict[int, float]:
    return {pid: _cpu(pid) for pid in pids}


def _used(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds of the processes between two looks (one that ended meanwhile: what it had at the first)."""
    return sum(after.get(pid, t) - t for pid, t in before.items()) + sum(
        t for pid, t in after.items() if pid not in before)


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _syscalls(pid: int) -> int:
    """Read and write system calls of ``pid`` so far (/proc/PID/io: syscr + syscw)."""
    try:
        io = psutil.Process(pid).io_counters()
    except psutil.Error:
        return 0
    return int(io.read_count + io.write_count)


def _main_thread_cpu(pid: int) -> float:
    """CPU seconds of ``pid``'s main thread (the engine's event loop), user and system: the rest of the process's
    CPU is its other threads' (the ledger's writer, telemetry, the thread pool of SQLite calls)."""
    try:
        fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime (fields 14 and 15 of stat)


class Floor:
    """The floor of a relay in Python in front of vLLM: a byte proxy (``relay-ceiling --workers -1``: each read of
    one socket written to the other from its callback, nothing parsed) on a port of its own, so that what the
    gateway costs above the two system calls per event is measured on vLLM's real stream, side by side."""

    def __init__(self, upstream: str, workdir: Path, label: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"floor-{label}.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "bench", "relay-ceiling", "--host-gateway", "--workers",
                                      "-1", "--port", str(self.port), "--upstream", upstream, "--out",
                                      str(workdir / f"floor-{label}")], cwd=REPO, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        import socket

        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"the byte proxy did not come up: see {self.log.name}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _py_spy() -> str | None:
    """py-spy, to profile the engine during one more gateway run (``--py-spy``): LLMOPS_BENCH_PY_SPY or PATH's."""
    return os.environ.get("LLMOPS_BENCH_PY_SPY") or shutil.which("py-spy")


def scrape(engine: Engine) -> str | None:
    """vLLM's own /metrics (the one child behind both paths)."""
    try:
        resp = httpx.get(f"{engine.direct_url}/metrics", timeout=10,  # every path asks for the key (vllm_guard)
                         headers={"authorization": f"Bearer {engine.vllm_key}"} if engine.vllm_key else None)
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    return resp.text


def cache_over(before: str | None, after: str | None) -> CacheUse | None:
    if after is None:
        return None
    return cache_use(parse(after, 1.0), parse(before, 0.0) if before is not None else None)


def run_once(engine: Any, base_url: str, concurrency: int, a: argparse.Namespace, workdir: Path,
             tag: str, prompts: int | None = None, extra: list[str] | None = None, floor: Floor | None = None,
             profile: Path | None = None) -> dict[str, Any]:
    """One run of vLLM's benchmark against ``base_url``; ``engine`` is an Engine or a Beside (what is measured: its
    /metrics, its API server's CPU). ``prompts``: this many (default: --prompts-per-client, at least --min-prompts).
    ``floor``: the run goes through this byte proxy, whose CPU is measured in the engine's place. ``profile``: py-spy
    records the engine's process there (raw stacks) while the run lasts."""
    out = workdir / f"{tag}.json"
    prompts = prompts or max(concurrency * a.prompts_per_client, a.min_prompts)
    seed = a.seed if a.seed is not None else fresh_seed()
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", "bench",
            "--tokenizer", a.model or str(REPO / "data" / "models" / "demo"), "--dataset-name", "random",
            "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len), "--ignore-eos",
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
            *(["--random-range-ratio", str(a.range_ratio)] if a.range_ratio else []),
            "--seed", str(seed), "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(workdir),
            "--result-filename", f"{tag}-detail.json", *(extra or [])]
    metrics_before = scrape(engine)
    # what relays the run: the byte proxy, or the engine (with --data-port, and its gateway workers)
    measured = [floor.proc.pid] if floor is not None else engine.pids() if isinstance(engine, Engine) else [
        engine.proc.pid]
    loop_before, calls_before = _main_thread_cpu(engine.proc.pid), sum(_syscalls(pid) for pid in measured)
    cpu_before = _cpu_of(measured)
    before = (_cpu(engine.vllm_pid), time.monotonic())
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    if engine.vllm_key and (base_url == engine.direct_url or floor is not None):  # sent as its bearer token
        env["OPENAI_API_KEY"] = engine.vllm_key
    spy = None
    if profile is not None and (binary := _py_spy()) is not None:
        with open(profile.with_suffix(".log"), "wb") as spy_log:  # (the child keeps its own descriptor)
            spy = subprocess.Popen([binary, "record", "--pid", str(engine.proc.pid), "--rate", "200", "--format",
                                    "raw", "--nonblocking", "--output", str(profile)], stdout=subprocess.DEVNULL,
                                   stderr=spy_log)
    done = subprocess.run([sys.executable, "-m", __name__, "--vllm-bench", str(out), "--", *argv], cwd=REPO,
                          capture_output=True, text=True, check=False, env=env)
    relay_cpu = _used(cpu_before, _cpu_of(measured))
    after = (_cpu(engine.vllm_pid), time.monotonic())
    loop_after, calls_after = _main_thread_cpu(engine.proc.pid), sum(_syscalls(pid) for pid in measured)
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it recorded when interrupted
        try:
            spy.wait(timeout=60)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    use = cache_over(metrics_before, scrape(engine))
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"vLLM's benchmark failed ({tag}):\n{done.stderr[-3000:]}")
    r = json.loads(out.read_text())
    detail = workdir / f"{tag}-detail.json"
    if detail.exists():  # per-request inter-token gaps: written by --save-detailed, not returned
        r["itls"] = json.loads(detail.read_text()).get("itls") or []
        detail.unlink()
    wall = float(r.get("duration") or (after[1] - before[1]))  # the traffic's own span: the engine idles meanwhile
    gaps = [g for itl in r.get("itls") or [] for g in itl]
    return {
        "tag": tag, "concurrency": concurrency, "prompts": prompts, "completed": r.get("completed"),
        "failed": r.get("failed", prompts - int(r.get("completed") or 0)),
        "output_tok_s": r.get("output_throughput"), "request_s": r.get("request_throughput"),
        "ttft_p50_ms": r.get("median_ttft_ms"), "ttft_p95_ms": r.get("p95_ttft_ms"),
        "ttft_p99_ms": r.get("p99_ttft_ms"), "e2el_p95_ms": r.get("p95_e2el_ms"),
        "itl_p50_ms": r.get("median_itl_ms"), "itl_p99_ms": r.get("p99_itl_ms"),
        "gaps_under_0_5ms": round(sum(1 for g in gaps if g < 0.0005) / len(gaps), 4) if gaps else None,
        "gap_p10_ms": _pct(gaps, 0.10), "gap_p50_ms": _pct(gaps, 0.5), "gap_p90_ms": _pct(gaps, 0.9),
        "engine_cpu_pct": round(100 * relay_cpu / wall, 1),
        "relay_processes": len(measured),
        "engine_loop_cpu_pct": round(100 * (loop_after - loop_before) / wall, 1),
        # the measured process's reads and writes (the engine's, or the byte proxy's) per output token
        "syscalls_per_token": round((calls_after - calls_before) / r["total_output_tokens"], 3)
        if r.get("total_output_tokens") else None,
        "vllm_api_cpu_pct": round(100 * (after[0] - before[0]) / wall, 1), "wall_s": round(wall, 1),
        "seed": seed, "prefix_cache_hit_pct": use.hit_pct if use is not None else None,
        "cache_warning": cache_warning(use.hit_pct if use is not None else None),
        "load_1m": round(os.getloadavg()[0], 2),
    }


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    data = sorted(values)
    return round(1000 * data[min(len(data) - 1, int(q * (len(data) - 1)))], 3)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (label, conc) in sorted({(r["label"], r["concurrency"]) for r in runs}, key=lambda k: (k[0], k[1])):
        d = [r for r in runs if r["label"] == label and r["concurrency"] == conc and r["path"] == "direct"]
        g = [r for r in runs if r["label"] == label and r["concurrency"] == conc and r["path"] == "gateway"]
        f = [r for r in runs if r["label"] == label and r["concurrency"] == conc and r["path"] == "floor"]

        def mean(rs: list[dict[str, Any]], k: str) -> float | None:
            vals = [r[k] for r in rs if r.get(k) is not None]
            return round(statistics.fmean(vals), 3) if vals else None

        dt, gt = mean(d, "output_tok_s"), mean(g, "output_tok_s")
        rows.append({
            "tree": label, "clients": conc, "direct_tok_s": [r["output_tok_s"] for r in d],
            "gateway_tok_s": [r["output_tok_s"] for r in g], "ratio": round(gt / dt, 3) if dt and gt else None,
            "ttft_p50_ms": (mean(d, "ttft_p50_ms"), mean(g, "ttft_p50_ms")),
            "ttft_p99_ms": (mean(d, "ttft_p99_ms"), mean(g, "ttft_p99_ms")),
            "itl_p50_ms": (mean(d, "itl_p50_ms"), mean(g, "itl_p50_ms")),
            "gaps_under_0_5ms": (mean(d, "gaps_under_0_5ms"), mean(g, "gaps_under_0_5ms")),
            "gap_p10_ms": (mean(d, "gap_p10_ms"), mean(g, "gap_p10_ms")),
            "engine_cpu_pct": [r["engine_cpu_pct"] for r in g],
            "engine_cpu_pct_direct_runs": [r["engine_cpu_pct"] for r in d],
            # the event loop's thread alone, in the gateway runs (the rest: the engine's other threads)
            "engine_loop_cpu_pct": [r.get("engine_loop_cpu_pct") for r in g],
            # % of a core per 1,000 tok/s: the gateway's less what the engine spends when it relays nothing
            "gateway_cpu_per_1k_tok_s": [_per_1k(r["engine_cpu_pct"] - (mean(d, "engine_cpu_pct") or 0.0),
                                                 r["output_tok_s"]) for r in g],
            "syscalls_per_token": ([r.get("syscalls_per_token") for r in g], [r.get("syscalls_per_token") for r in f]),
            "floor_tok_s": [r["output_tok_s"] for r in f],
            "floor_cpu_pct": [r["engine_cpu_pct"] for r in f],
            "floor_cpu_per_1k_tok_s": [_per_1k(r["engine_cpu_pct"], r["output_tok_s"]) for r in f],
            "failed": sum(int(r["failed"] or 0) for r in d + g + f),
            "prefix_cache_hit_pct": [r.get("prefix_cache_hit_pct") for r in d + g + f],
        })
    return rows


def _per_1k(cpu_pct: float, tok_s: float | None) -> float | None:
    return round(cpu_pct / (tok_s / 1000), 2) if tok_s else None


def table(rows: list[dict[str, Any]]) -> str:
    def pair(p: tuple[Any, Any], fmt: str = "{:.1f}") -> str:
        return " → ".join("–" if v is None else fmt.format(v) for v in p)

    lines = ["| tree | clients | direct tok/s | gateway tok/s | ratio | TTFT P50 ms | TTFT P99 ms | ITL P50 ms "
             "| gaps < 0.5 ms | engine CPU (gateway runs) | failed | prefix cache hits |",
             "| --- | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: | --- |"]
    for r in rows:
        lines.append(
            f"| {r['tree']} | {r['clients']} | {' / '.join(f'{v:,.0f}' for v in r['direct_tok_s'])} "
            f"| {' / '.join(f'{v:,.0f}' for v in r['gateway_tok_s'])} | **{r['ratio']}** "
            f"| {pair(r['ttft_p50_ms'])} | {pair(r['ttft_p99_ms'])} | {pair(r['itl_p50_ms'], '{:.2f}')} "
            f"| {pair(r['gaps_under_0_5ms'], '{:.0%}')} | {', '.join(f'{v:.0f} %' for v in r['engine_cpu_pct'])} "
            f"| {r['failed']} | {', '.join('–' if v is None else f'{v:.0f} %' for v in r['prefix_cache_hit_pct'])} |")
    if any(r.get("floor_tok_s") for r in rows):
        lines += ["", "| tree | clients | gateway tok/s | gateway CPU per 1,000 tok/s, net | its event loop's thread "
                  "| byte proxy tok/s | byte proxy CPU per 1,000 tok/s | reads and writes per token, gateway (the "
                  "engine's, its SQLite and logs too) → proxy |",
                  "| --- | ---: | ---: | --- | --- | ---: | --- | --- |"]

        def nums(vs: list[Any], fmt: str) -> str:
            return ", ".join("–" if v is None else fmt.format(v) for v in vs)

        for r in rows:
            lines.append(f"| {r['tree']} | {r['clients']} | {nums(r['gateway_tok_s'], '{:,.0f}')} "
                         f"| {nums(r['gateway_cpu_per_1k_tok_s'], '{:.2f} %')} "
                         f"| {nums(r['engine_loop_cpu_pct'], '{:.1f} %')} | {nums(r['floor_tok_s'], '{:,.0f}')} "
                         f"| {nums(r['floor_cpu_per_1k_tok_s'], '{:.2f} %')} "
                         f"| {nums(r['syscalls_per_token'][0], '{:.2f}')} "
                         f"→ {nums(r['syscalls_per_token'][1], '{:.2f}')} |")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a checkout (default: this one)")
    p.add_argument("--model", help="a model folder (default: the demo model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn from ±this share of --input-len and --output-len (vLLM's --random-range-ratio): "
                   "with fixed lengths a closed loop of many clients moves in waves of prefill and decode, and how "
                   "in step they stay differs from run to run (the H200's direct runs at 256 clients: 9,999 and "
                   "10,955 tok/s)")
    p.add_argument("--prompts-per-client", type=int, default=40)
    p.add_argument("--min-prompts", type=int, default=200)
    p.add_argument("--rounds", type=int, default=1, help="direct, gateway, gateway, direct per round")
    p.add_argument("--seed", type=int, default=None,
                   help="the same prompts every run, on purpose (a prefix-cache test); default: fresh ones each run")
    p.add_argument("--engine-nice", type=int, help="run each engine at this nice value (an experiment)")
    p.add_argument("--plan-probe", action="append", default=[], metavar="KEY=VALUE",
                   help="once vLLM serves, record the plan the engine would choose for this change (GET /api/capacity)")
    p.add_argument("--plans-only", action="store_true", help="record the plans and stop (no benchmark runs)")
    p.add_argument("--cap-vs-restart", type=int, nargs="*", default=[], metavar="N",
                   help="after the runs: the gateway's cap of N (max_num_seqs within the ceiling, no restart) against "
                   "vLLM started with N beside the engine's instance, at 2N clients (--max-num-seqs is the ceiling; "
                   "--utilization must leave room for the second vLLM)")
    p.add_argument("--cap-prompts", type=int, nargs="*", default=[], metavar="P",
                   help="prompts of each run of each --cap-vs-restart level, in order (to last ≥ 30 s at its rate)")
    p.add_argument("--floor", action="store_true",
                   help="also through a byte proxy in front of vLLM (the floor of a relay in Python: two system calls "
                   "an event, nothing parsed), its CPU measured: two runs after each round's first gateway run (the "
                   "middle of the round with 4 runs a round, its end with 2)")
    p.add_argument("--py-spy", action="store_true",
                   help="after each concurrency's rounds, one more gateway run with py-spy recording the engine "
                   "(raw stacks in py-spy-TREE-CLIENTS.txt; py-spy from LLMOPS_BENCH_PY_SPY or PATH)")
    p.add_argument("--runs-per-round", type=int, default=4, choices=(2, 4),
                   help="direct, gateway (2: when device time is short) or direct, gateway, gateway, direct (4)")
    p.add_argument("--cap-runs", type=int, default=4, choices=(2, 4),
                   help="runs per --cap-vs-restart level: graphs, cap, restarted (2) or graphs, cap, cap, graphs, "
                   "restarted, restarted (4)")
    p.add_argument("--after", action="append", default=[], metavar="KEY=JSON[,KEY=JSON]",
                   help="at the end, an apply of these values (forced), its plan, ETA and outcome recorded: e.g. "
                   "gpu_memory_utilization=0.95 (a pause), then max_model_len=999999 (a bad revision: on CUDA the "
                   "old instance sleeps and is woken)")
    p.add_argument("--then", action="append", default=[], metavar="KEY=JSON[,KEY=JSON]",
                   help="after the runs, an apply of these values (forced), then every concurrency's runs again, "
                   "labelled TREE KEY=JSON: a setting before and after in one run (--cap-vs-restart and --after "
                   "then run on the last of them), e.g. "
                   "'extra_args=[\"--stream-interval=4\"]'")
    p.add_argument("--data-port", action="store_true",
                   help="the gateway's runs through the engine's data port (gateway_port: its worker processes, as "
                   "clients on a host of 4 cores or more are told to use), their CPU the engine's and its workers' "
                   "together; without it, the engine's own port")
    p.add_argument("--workers", type=int, default=None,
                   help="the engine's gateway_workers (default: the engine's own, by the cores)")
    p.add_argument("--keep-engine-logs", action=argparse.BooleanOptionalAction, default=False,
                   help="copy each engine's own log beside the results at the end (a GPU session's record)")


def run(a: argparse.Namespace) -> None:
    for item in [*a.then, *a.after]:  # a typo is said now, not after the runs before it
        _values(item)
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in a.tree] or [("this", REPO)]
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "runs": [], "trees": {}}

    def save() -> None:
        report["summary"] = summarize(report["runs"])
        (a.out / "gateway-overhead.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "gateway-overhead.md").write_text(table(report["summary"]) + "\n")

    workdir = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    for label, tree in trees:
        commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "engine"], capture_output=True,
                                    text=True, check=False).stdout.strip())
        report["trees"][label] = {"path": str(tree), "commit": commit + ("+changes" if dirty else "")}
        engine = Engine(tree, label, a, workdir)
        try:
            engine.serve()
            report["trees"][label]["placement"] = engine.http.get("/api/fleet").json().get("placement")
            report["trees"][label]["plans"] = [probe(engine, item) for item in a.plan_probe]
            save()
            gateway = engine.url
            if engine.data_url is not None:  # the gateway's runs through its workers, as clients of a host with
                # the cores for them are told to send (the Overview's snippets)
                wait_up(f"{engine.data_url}/v1/models", engine.proc, 120,
                        f"engine {label}'s data port did not answer: see {engine.log.name}")
                gateway = engine.data_url
                report["trees"][label]["gateway_workers"] = len(engine.pids()) - 1
            for then in [None, *a.then]:  # the runs, then again after each --then apply (labelled by it)
                if then is not None:
                    done = apply_values(engine, _values(then), "bench: --then")
                    report.setdefault("then", []).append(done)
                    save()
                    print(f"then {then}: {done['outcome']} in {done['apply_s']} s", flush=True)
                    if done["outcome"] not in ("applied", "in effect"):  # the old revision serves: not these values
                        print(f"then {then}: not in effect, so not measured; the --then after it are skipped",
                              flush=True)
                        break
                runs_of(engine, label if then is None else f"{label} {then}", gateway, a, workdir, report, save)
            if a.cap_vs_restart:
                cap_vs_restart(engine, a, workdir, report, save)
            for item in a.after:  # applies whose starts (and wake-ups) the engine estimates: issue 20 item 3
                done = apply_values(engine, _values(item), "bench: --after")
                report.setdefault("after", []).append(done)
                save()
                engine.save_events()
                print(f"after {item}: plan {done['plan']}, {done['outcome']}, {done['apply_s']} s "
                      f"(predicted {done['predicted_s']})", flush=True)
        finally:
            engine.stop()
            if a.keep_engine_logs:  # what the engine logged, beside the figures (a GPU machine is gone after it)
                shutil.copyfile(engine.log.name, a.out / Path(engine.log.name).name)
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(table(report["summary"]))


def runs_of(engine: Engine, label: str, gateway: str, a: argparse.Namespace, workdir: Path, report: dict[str, Any],
            save: Callable[[], None]) -> None:
    """Every concurrency's rounds (direct, gateway, the byte proxy with --floor), and a profiled run with --py-spy,
    their runs labelled ``label``."""
    tag = re.sub(r"[^\w.-]+", "_", label).strip("_")  # in file names
    floor = None
    try:
        floor = Floor(engine.direct_url, workdir, tag) if a.floor and not a.plans_only else None
        for conc in [] if a.plans_only else a.concurrency:
            run_once(engine, gateway, min(conc, 8), a, workdir, f"{tag}-warmup-{conc}",
                     prompts=4 * min(conc, 8))
            for rnd in range(a.rounds):
                pattern: list[tuple[str, str]] = [("direct", engine.direct_url), ("gateway", gateway)]
                if floor is not None:  # the byte proxy after the first gateway run
                    pattern += [("floor", floor.url), ("floor", floor.url)]
                if a.runs_per_round == 4:
                    pattern += [("gateway", gateway), ("direct", engine.direct_url)]
                for i, (path, url) in enumerate(pattern):
                    run = run_once(engine, url, conc, a, workdir, f"{tag}-{conc}-{rnd}-{i}-{path}",
                                   floor=floor if path == "floor" else None)
                    report["runs"].append({"label": label, "path": path, **run})
                    save()
                    print(f"{label} {conc} clients {path}: {run['output_tok_s']:.0f} tok/s, "
                          f"TTFT p99 {run['ttft_p99_ms']:.0f} ms, "
                          f"{'proxy' if path == 'floor' else 'engine'} CPU {run['engine_cpu_pct']} %, "
                          f"seed {run['seed']}, prefix cache hits {run['prefix_cache_hit_pct']} %"
                          + (f" — WARNING: {run['cache_warning']}" if run["cache_warning"] else ""),
                          flush=True)
            if a.py_spy:  # one more gateway run, profiled (its CPU is not in the table: py-spy perturbs it)
                stacks = a.out / f"py-spy-{tag}-{conc}.txt"
                run = run_once(engine, gateway, conc, a, workdir, f"{tag}-{conc}-profiled", profile=stacks)
                report["runs"].append({"label": label, "path": "gateway, profiled", **run})
                save()
                print(f"{label} {conc} clients, profiled: {stacks} "
                      f"({'written' if stacks.exists() else 'not written: see its .log'})", flush=True)
    finally:
        if floor is not None:
            floor.stop()


def _values(item: str) -> dict[str, Any]:
    """KEY=JSON[,KEY=JSON] as settings values (a comma inside a value's JSON, as in a list, is the value's)."""
    pairs = (kv.split("=", 1) for kv in re.split(r",(?=[A-Za-z_]\w*=)", item))
    try:
        return {k: json.loads(v) for k, v in pairs}
    except (ValueError, TypeError) as exc:
        raise SystemExit(f"{item!r} is not KEY=JSON[,KEY=JSON]: {exc}") from None


if __name__ == "__main__":  # the subprocess of run_once: vLLM's benchmark, in a process of its own
    if len(sys.argv) > 2 and sys.argv[1] == "--vllm-bench":
        vllm_bench(sys.argv[sys.argv.index("--") + 1:], Path(sys.argv[2]))
