"""A sign-in flood against a real engine process: what it costs the engine and whether /healthz stays quick.

    python -m bench signin-flood --out DIR            # vLLM not started
    python -m bench signin-flood --vllm --out DIR     # with the demo model serving

``--requests`` wrong sign-ins (default 300, as the probe of issue 17 sent them), ``--concurrency`` at a time (48),
half of them for ``admin`` and half for names that are no user. Meanwhile /healthz is asked every 20 ms on its own
connection, from a process of its own at the engine's CPU priority, and the engine's resident memory is read from
/proc every 20 ms. The flood's client threads run at nice 19: an attacker's client is not on the engine's host.
Prints JSON and writes it to ``signin-flood.json`` under ``--out``: the answers' status counts, the engine's CPU
time and RSS (before, peak, growth), the host's load average, and /healthz latency (median, P99, max) over the
flood.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from tests.testkit.engine import ADMIN_PASSWORD, COLD_START_S, running_engine

PROBE_NICE = -10  # the engine's own (engine_nice)


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system, all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def probe(url: str, ready: Any, stop: Any, out: Any) -> None:
    """/healthz every 20 ms, from a process of its own (the flood's 48 client threads would otherwise add their
    own wait for the interpreter lock to each figure); (when, seconds) pairs go to ``out`` at the end."""
    got: list[tuple[float, float]] = []
    with contextlib.suppress(PermissionError):  # at the engine's priority: it measures the engine, not its own wait
        os.setpriority(os.PRIO_PROCESS, 0, PROBE_NICE)
    with httpx.Client(base_url=url, timeout=30) as own:
        while not stop.is_set():
            t0 = time.perf_counter()
            own.get("/healthz").raise_for_status()
            got.append((time.monotonic(), time.perf_counter() - t0))
            ready.set()
            stop.wait(0.02)
    out.put(got)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--vllm", action="store_true", help="start vLLM with the demo model first (else autostart off)")


def run(a: argparse.Namespace) -> None:
    env = {} if a.vllm else {"LLMOPS_AUTOSTART": "false"}
    with tempfile.TemporaryDirectory(prefix="signin-flood-") as tmp, running_engine(Path(tmp), env) as engine:
        if a.vllm:
            engine.client.wait_for({"ready"}, COLD_START_S)
        pid = engine.proc.pid
        http = httpx.Client(base_url=engine.url, timeout=60)
        assert http.post("/api/auth/login", json={"username": "admin", "password": ADMIN_PASSWORD}).status_code == 200
        time.sleep(2)  # settle after start-up (a benchmark, not a test: no assertion waits on this)
        before = rss_mb(pid)
        stop = threading.Event()
        rss: list[float] = []
        # the flood's own client threads run at the lowest priority: an attacker's client is not on the engine's
        # host, and on 2 cores its 48 threads would otherwise take the cores the engine is measured on
        os.setpriority(os.PRIO_PROCESS, 0, 19)
        ctx = multiprocessing.get_context("spawn")
        probe_ready, probe_stop, probe_out = ctx.Event(), ctx.Event(), ctx.Queue()
        prober = ctx.Process(target=probe, args=(engine.url, probe_ready, probe_stop, probe_out))
        prober.start()

        def sample() -> None:
            while not stop.is_set():
                rss.append(rss_mb(pid))
                stop.wait(0.02)

        statuses: dict[int, int] = {}
        lock = threading.Lock()

        def sign_in(i: int) -> None:
            name = "admin" if i % 2 else f"nobody{i}"
            status = http.post("/api/auth/login", json={"username": name, "password": f"wrong-{i}"}).status_code
            with lock:
                statuses[status] = statuses.get(status, 0) + 1

        sampler = threading.Thread(target=sample)
        sampler.start()
        if not probe_ready.wait(120):
            raise RuntimeError("the /healthz probe did not start")
        t0, cpu0 = time.monotonic(), cpu_s(pid)
        with ThreadPoolExecutor(a.concurrency) as pool:
            list(pool.map(sign_in, range(a.requests)))
        took, cpu = time.monotonic() - t0, cpu_s(pid) - cpu0
        probe_stop.set()
        stop.set()
        sampler.join()
        got = [(w, h) for w, h in probe_out.get(timeout=60) if t0 <= w <= t0 + took + 0.1]
        prober.join(30)
        when, health = [w for w, _ in got], [h for _, h in got]
        after_ok = http.post("/api/auth/login", json={"username": "nobody-else", "password": "x"}).status_code
        report: dict[str, Any] = {
            "requests": a.requests, "concurrency": a.concurrency, "vllm": a.vllm, "flood_s": round(took, 2),
            "engine_cpu_s": round(cpu, 2), "load_average": os.getloadavg()[0],
            "statuses": dict(sorted(statuses.items())), "sign_in_after_flood": after_ok,
            "rss_before_mb": round(before, 1), "rss_peak_mb": round(max(rss), 1),
            "rss_growth_mb": round(max(rss) - before, 1), "rss_hwm_mb": round(rss_mb(pid, "VmHWM"), 1),
            "healthz_samples": len(health), "healthz_median_ms": round(1e3 * statistics.median(health), 2),
            "healthz_p99_ms": round(1e3 * pct(health, 0.99), 2), "healthz_max_ms": round(1e3 * max(health), 2),
            "healthz_slowest": [(round(w - t0, 2), round(1e3 * h, 1)) for w, h in
                                sorted(zip(when, health, strict=True), key=lambda x: -x[1])[:5]],
        }
        http.close()
    print(json.dumps(report, indent=1))
    (a.out / "signin-flood.json").write_text(json.dumps(report, indent=1) + "\n")

