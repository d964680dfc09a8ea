"""Autoscaling where replicas add compute: the demo model on a real Ray cluster of two nodes on this host, each node
on a core of its own (``--node-cores``, as ``python -m bench fleet`` does), autoscaled between 1 and 2 replicas under
a load that follows a sine wave (``--period`` s, ``--seconds`` in all, from ``--base`` to ``--peak`` clients).

Reported: failed requests; replica-seconds against two replicas held throughout; per minute, the TTFT P95 against
twice the unloaded P95 (one client, one replica, measured first in the same run); every autoscaling decision (the
engine's events). Fresh prompts every request (tests/testkit/load.py's random first word). Writes
``autoscale-sine.json``, ``autoscale-sine.md`` and ``autoscale-sine.html`` (replicas and load against time; with
``--png``, a screenshot of it by Chromium) under ``--out``.

    python -m bench autoscale --out DIR --node-cores [--seconds 600 --period 150 --peak 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.scenarios.fleet_rolling import confine_nodes
from tests.testkit.engine import COLD_START_S, running_engine
from tests.testkit.load import prompt_token
from tests.testkit.ray_cluster import ray_cluster
from tests.testkit.wait import wait_until


@dataclass
class Sent:
    at: float  # seconds into the run when it was sent
    ttft: float | None
    ok: bool


def one(http: httpx.Client, max_tokens: int) -> tuple[float | None, bool]:
    """(time to the first token, whether it ended whole) of one streamed chat request with a fresh prompt."""
    body = {"model": "demo", "messages": [{"role": "user", "content": f"{prompt_token()}: describe a module"}],
            "max_tokens": max_tokens, "temperature": 0.7, "stream": True}
    t0, first, done = time.monotonic(), None, False
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                return None, False
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])  # (a generated word is no error: the event's own key is)
                    if "error" in event:
                        return first, False
                    if first is None and any((c.get("delta") or {}).get("content") for c in event.get("choices")
                                             or []):
                        first = time.monotonic() - t0
    except httpx.HTTPError:
        return first, False
    return first, done


def clients_at(t: float, a: argparse.Namespace) -> int:
    """Clients active ``t`` seconds into the run: base at the start of each period, peak half-way."""
    wave = 0.5 - 0.5 * math.cos(2 * math.pi * t / a.period)
    base, peak = int(a.base), int(a.peak)
    return round(base + (peak - base) * wave)


def p95(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=600.0)
    p.add_argument("--period", type=float, default=150.0)
    p.add_argument("--base", type=int, default=1, help="clients at the wave's low")
    p.add_argument("--peak", type=int, default=8, help="clients at the wave's high (about what two replicas serve)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--target", type=float, default=3.0, help="target_in_flight")
    p.add_argument("--up-delay", type=float, default=5.0)
    p.add_argument("--down-delay", type=float, default=20.0)
    p.add_argument("--unloaded", type=int, default=40, help="requests of one client measuring the unloaded TTFT")
    p.add_argument("--node-cores", action="store_true", help="each node on a core of its own")
    p.add_argument("--png", action="store_true", help="also a PNG of the plot (Chromium through Playwright)")


def run(a: argparse.Namespace) -> None:
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)}}

    def save() -> None:
        (a.out / "autoscale-sine.json").write_text(json.dumps(report, indent=1, default=str))

    data_dir = Path(tempfile.mkdtemp(prefix="autoscale-sine-"))
    with ray_cluster(nodes=2) as cluster, contextlib.nullcontext(
            confine_nodes(cluster) if a.node_cores else None) as cores, running_engine(data_dir, env={
            "LLMOPS_RAY_ADDRESS": cluster.address, "LLMOPS_CRASHLOOP_MAX_FAILURES": "20"}) as engine:
        report["node_cores"] = cores
        engine.client.wait_for({"ready"}, COLD_START_S)
        base = engine.client.settings()
        engine.client.put_settings(base.revision, {"max_num_seqs": a.max_num_seqs}, "bench: autoscale")
        wait_until(lambda: (s := engine.client.status()).state == "ready" and s.running_revision != base.revision,
                   2 * COLD_START_S, every=1.0, what="the bench's revision")
        http = httpx.Client(base_url=engine.url, timeout=600)
        unloaded = [t for t, ok in (one(http, a.max_tokens) for _ in range(a.unloaded)) if ok and t is not None]
        report["unloaded_ttft_p95_s"] = p95(unloaded)
        report["unloaded_ttft_p50_s"] = statistics.median(unloaded) if unloaded else None
        current = engine.client.settings()
        newest = engine.client.events(limit=1, newest_first=True)
        since = newest[0].id if newest else 0
        engine.client.put_settings(current.revision, {
            "max_replicas": 2, "min_replicas": 1, "target_in_flight": a.target, "scale_up_delay_s": a.up_delay,
            "scale_down_delay_s": a.down_delay}, "bench: autoscale 1-2")
        sent: list[Sent] = []
        lock, stop = threading.Lock(), threading.Event()
        t0 = time.monotonic()

        def client(i: int) -> None:
            with httpx.Client(base_url=engine.url, timeout=600) as mine:
                while not stop.is_set():
                    at = time.monotonic() - t0
                    if i >= clients_at(at, a):
                        stop.wait(0.1)
                        continue
                    ttft, ok = one(mine, a.max_tokens)
                    with lock:
                        sent.append(Sent(round(at, 3), ttft, ok))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.peak)]
        for t in threads:
            t.start()
        timeline: list[dict[str, Any]] = []
        while (now := time.monotonic() - t0) < a.seconds:
            st = engine.client.status()
            timeline.append({"t": round(now, 1), "clients": clients_at(now, a),
                             "serving": sum(1 for i in st.instances if i.serving),
                             "instances": len(st.instances),
                             "wanted": st.autoscale.wanted if st.autoscale else None,
                             "load": st.autoscale.load if st.autoscale else None})
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(600)
        decisions = engine.client.events(since=since, limit=1000, kinds=["autoscale", "autoscale_held",
                                                                          "replica_waiting"])
        report["decisions"] = [{"t": round(e.ts.timestamp() - (time.time() - (time.monotonic() - t0)), 1),
                                "kind": e.kind, "message": e.message} for e in decisions]
        report["timeline"] = timeline
        report["requests"] = [s.__dict__ for s in sent]
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report["summary"] = summarize(report, a)
    save()
    (a.out / "autoscale-sine.md").write_text(table(report["summary"]) + "\n")
    plot(report, a)
    print(table(report["summary"]))


def summarize(report: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    timeline, sent = report["timeline"], [Sent(**s) for s in report["requests"]]
    replica_s = sum(row["serving"] for row in timeline)  # one sample a second
    held = 2 * len(timeline)
    bound = 2 * (report["unloaded_ttft_p95_s"] or 0.0)
    minutes: list[dict[str, Any]] = []
    for m in range(math.ceil(a.seconds / 60)):
        in_minute = [s.ttft for s in sent if m * 60 <= s.at < (m + 1) * 60 and s.ok and s.ttft is not None]
        in_minute_f: list[float] = [t for t in in_minute if t is not None]
        value = p95(in_minute_f)
        minutes.append({"minute": m + 1, "requests": len(in_minute), "ttft_p95_s": value,
                        "within": value is not None and value <= bound})
    return {"requests": len(sent), "failed": sum(1 for s in sent if not s.ok),
            "replica_seconds": replica_s, "two_replicas_held_s": held,
            "replica_share": round(replica_s / held, 3) if held else None,
            "unloaded_ttft_p95_s": report["unloaded_ttft_p95_s"], "ttft_bound_s": round(bound, 3),
            "minutes": minutes, "minutes_within_pct": round(100 * sum(m["within"] for m in minutes) / len(minutes), 1)
            if minutes else None, "decisions": len([d for d in report["decisions"] if d["kind"] == "autoscale"])}


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.0f} ms"


def table(s: dict[str, Any]) -> str:
    lines = [f"{s['requests']} requests, {s['failed']} failed; replica-seconds {s['replica_seconds']} of "
             f"{s['two_replicas_held_s']} for two replicas held throughout (**{s['replica_share']}**); TTFT P95 "
             f"within 2 x the unloaded {ms(s['unloaded_ttft_p95_s'])} in **{s['minutes_within_pct']} %** of the "
             f"minutes; {s['decisions']} scaling decisions", "", "| minute | requests | TTFT P95 | within |",
             "|---|---|---|---|"]
    lines += [f"| {m['minute']} | {m['requests']} | {ms(m['ttft_p95_s'])} | {'yes' if m['within'] else 'no'} |"
              for m in s["minutes"]]
    return "\n".join(lines)


def plot(report: dict[str, Any], a: argparse.Namespace) -> None:
    """Replicas serving and wanted, the clients and the load against time, and each request's TTFT."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    tl = report["timeline"]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("replicas and load", "time to first token (s)"))
    t = [r["t"] for r in tl]
    fig.add_trace(go.Scatter(x=t, y=[r["clients"] for r in tl], name="clients", line={"dash": "dot"}), 1, 1)
    fig.add_trace(go.Scatter(x=t, y=[r["load"] for r in tl], name="load (in flight, 5 s mean)"), 1, 1)
    fig.add_trace(go.Scatter(x=t, y=[r["wanted"] for r in tl], name="replicas wanted", line={"shape": "hv"}), 1, 1)
    fig.add_trace(go.Scatter(x=t, y=[r["serving"] for r in tl], name="replicas serving",
                             line={"shape": "hv", "width": 3}), 1, 1)
    reqs = [r for r in report["requests"] if r["ttft"] is not None]
    fig.add_trace(go.Scatter(x=[r["at"] for r in reqs], y=[r["ttft"] for r in reqs], mode="markers",
                             marker={"size": 3}, name="TTFT"), 2, 1)
    bound = report["summary"]["ttft_bound_s"]
    fig.add_hline(y=bound, line_dash="dash", annotation_text="2 x unloaded P95", row=2, col=1)
    fig.update_layout(width=1100, height=700, title=f"autoscaling 1-2 replicas, sine load (period {a.period:g} s)")
    fig.update_xaxes(title_text="seconds", row=2, col=1)
    html = a.out / "autoscale-sine.html"
    fig.write_html(html, include_plotlyjs=True)
    if a.png:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium")
            page = browser.new_page(viewport={"width": 1120, "height": 720})
            page.goto(html.resolve().as_uri())
            page.wait_for_timeout(500)  # plotly draws after load; nothing to poll for in a static file
            page.screenshot(path=str(a.out / "autoscale-sine.png"))
            browser.close()
