"""Scale to zero and back: a deployment idle for ``--idle-s`` goes to zero (asleep on CUDA with sleep mode, stopped on
the CPU build); one streamed request with a fresh prompt then wakes it. Per cycle: the first token of that request
as the client sees it, vLLM's own wake-up as the engine timed it (its ``woken`` event: POST /wake_up until it
answers), the first token of a second request sent at once (awake: what a request costs without the wake), and the
sleep's own time. The engine's share of a wake is the first token from zero less the wake-up and the awake first
token. Writes ``scale_to_zero.json`` and ``scale_to_zero.md`` under ``--out``.

    python -m bench scale-to-zero --out DIR              # CPU: the demo model (each wake is a cold start)
    python -m bench scale-to-zero --profile h200         # the 8B shape at 0.85 of an H200, sleep mode
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Protocol

import httpx

from bench.base import REPO
from bench.scenarios.gateway_overhead import Engine

WORDS = ("amber", "basalt", "cinder", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp",
         "lumen", "mica", "nectar", "onyx", "prism", "quartz", "raven", "sierra", "tundra")


def fresh_prompt() -> str:
    """A prompt no earlier request sent (no prefix-cache hit can shorten its prefill)."""
    tag = uuid.uuid4().hex
    words = " ".join(WORDS[int(c, 16) % len(WORDS)] for c in tag)
    return f"Request {tag}. Continue this list of words: {words}"


class HasUrl(Protocol):
    url: str


def first_token(engine: HasUrl, max_tokens: int, model: str = "bench") -> tuple[float, float, bool]:
    """(seconds to the first streamed token, seconds to the end, whether it ended whole) of one request, as a
    client of the gateway sends it (no key: the engine's own admin token is not a gateway key)."""
    t0 = time.monotonic()
    first = None
    done = False
    body = {"model": model, "prompt": fresh_prompt(), "max_tokens": max_tokens, "stream": True,
            "temperature": 0.0}
    with httpx.Client(base_url=engine.url, timeout=600) as http, \
            http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            print(f"HTTP {resp.status_code}: {resp.read()[:300]!r}", flush=True)
            return float("nan"), time.monotonic() - t0, False
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: ") and first is None and '"text"' in line:
                first = time.monotonic() - t0
    return (first if first is not None else float("nan")), time.monotonic() - t0, done


def asleep(engine: Engine) -> bool:
    st = engine.http.get("/api/status").json()
    scale = st.get("autoscale") or {}
    return bool(scale.get("asleep")) and st.get("state") == "stopped" and \
        all(i.get("role") == "sleeping" for i in st.get("instances") or [])


def latest(engine: Engine, kind: str) -> dict[str, Any] | None:
    rows = engine.http.get("/api/events", params={"kind": kind, "newest_first": True, "limit": 1}).json()
    return rows[0] if rows else None


def pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v == v)
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a model folder (default: the demo model)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--utilization", type=float, default=0.85)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--cycles", type=int, default=20, help="wakes measured (the goal's figures need >= 20)")
    p.add_argument("--idle-s", type=float, default=5.0, help="scale_to_zero_after_s")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout-s", type=float, default=1800.0, help="the whole run's bound")


def summary(cycles: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [c for c in cycles if c["ok"]]

    def stat(key: str) -> dict[str, float | None]:
        values = [c[key] for c in ok if c.get(key) is not None]
        return {"p50": pct(values, 0.5), "p99": pct(values, 0.99), "max": max(values) if values else None,
                "mean": statistics.fmean(values) if values else None}

    return {"cycles": len(cycles), "failed": len(cycles) - len(ok), "first_token_from_zero_s": stat("ttft_s"),
            "vllm_wake_s": stat("wake_s"), "awake_first_token_s": stat("awake_ttft_s"),
            "engine_share_s": stat("engine_share_s"), "sleep_s": stat("sleep_s")}


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f} ms"


def table(s: dict[str, Any]) -> str:
    def row(name: str, key: str) -> str:
        v = s[key]
        return f"| {name} | {ms(v['p50'])} | {ms(v['p99'])} | {ms(v['max'])} |"

    return "\n".join([f"{s['cycles']} wakes, {s['failed']} failed", "", "| measure | P50 | P99 | max |",
                      "|---|---|---|---|", row("first token from zero (client)", "first_token_from_zero_s"),
                      row("vLLM's own: its wake-up (POST /wake_up), or its start (CPU)", "vllm_wake_s"),
                      row("first token, awake (the next request)", "awake_first_token_s"),
                      row("the engine's share", "engine_share_s"), row("sleep", "sleep_s")])


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "cycles": []}

    def save() -> None:
        report["summary"] = summary(report["cycles"])
        (a.out / "scale_to_zero.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "scale_to_zero.md").write_text(table(report["summary"]) + "\n")

    engine_args = argparse.Namespace(model=a.model, utilization=a.utilization, max_model_len=a.max_model_len,
                                     load_format=a.load_format, max_num_seqs=a.max_num_seqs, cap_vs_restart=False,
                                     engine_nice=None, out=a.out)
    end = time.monotonic() + a.timeout_s
    with tempfile.TemporaryDirectory(prefix="llmops-zero-") as tmp:
        engine = Engine(REPO, "this", engine_args, Path(tmp))
        try:
            engine.serve()
            report["build"] = engine.http.get("/api/status").json().get("vllm_build")
            first_token(engine, a.max_tokens)  # the first request after a start pays for warm-up: not a wake
            base = engine.http.get("/api/settings").json()
            engine.http.put("/api/settings", json={"base_revision": base["revision"], "values": {
                "scale_to_zero_after_s": a.idle_s}, "note": "scale-to-zero bench"}).raise_for_status()
            for n in range(a.cycles):
                while not asleep(engine):
                    if time.monotonic() > end:
                        raise SystemExit(f"cycle {n}: not asleep within the run's bound")
                    time.sleep(0.05)
                slept = latest(engine, "sleeping") or {}
                ttft, total, ok = first_token(engine, a.max_tokens)
                woken = (latest(engine, "woken") or {}).get("data") or {}
                started = (latest(engine, "ready") or {}).get("data") or {}
                awake, _, awake_ok = first_token(engine, a.max_tokens)
                # vLLM's own part: its wake-up (sleep mode), or its whole start (a cold start, the CPU build)
                wake_s = woken.get("wake_s") if report["build"] == "cuda" else started.get("startup_s")
                row = {"n": n, "ok": ok and awake_ok, "ttft_s": round(ttft, 4), "total_s": round(total, 4),
                       "wake_s": wake_s, "awake_ttft_s": round(awake, 4),
                       "engine_share_s": round(ttft - wake_s - awake, 4) if wake_s is not None else None,
                       "sleep_s": (slept.get("data") or {}).get("sleep_s")}
                report["cycles"].append(row)
                print(json.dumps(row), flush=True)
                save()
        finally:
            engine.stop()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    save()
    print(table(report["summary"]))
