"""Limits, usage and fair queues on the /v1 path (issue 34): what they cost a request, and what fair queues give a
light key beside a heavy one at capacity, side by side with first come, first served.

    python -m bench limits --part overhead fairness --out DIR                  # this host: a stub upstream
    python -m bench limits --profile h200 --upstream vllm                      # the H200: vLLM and the 8B shape

Both parts go through the engine itself (its keys, limits, ledger and usage in its SQLite store), with keys and
limits made through its API:

- **overhead**: an open loop of short non-streamed completions at ``--rate`` requests/s, from ``--load-procs``
  processes on keep-alive connections, alternating ``--rounds`` times between a key with no limits and a key (in a
  team) with requests per minute, tokens per minute and a daily budget on itself and its team, all set high enough
  never to refuse: the same engine, the same load, limits set or not, in A B B A order. Reported: latency
  P50/P99/P99.9 of each, and what limits added to the P99.
- **fairness**: the deployment held at capacity (``--fair-slots`` requests at once on the stub; vLLM's
  ``--fair-max-num-seqs``), streamed requests of key B at ``--fair-rate`` req/s alone, then beside key A at
  ``--fair-ratio`` times its rate, with A and B in two teams (fair queues) and in one team (one flow: first come,
  first served). Reported: B's and A's time to first token P50/P95, and B's P95 against alone.

Upstream ``stub``: tests/testkit/stub_upstream.py (no model: the gateway is what is measured), the engine started
in-process by this module (``--host-engine``) with its one instance opened to the stub. Upstream ``vllm``: the
engine with vLLM serving the profile's model (bench.scenarios.gateway_overhead.Engine). Prompts are fresh on every
run (a random word in each). Writes limits.json and limits.md under ``--out``."""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.base import REPO, serve_engine_over
from engine.vllm import free_port


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", nargs="+", choices=["overhead", "fairness"], default=["overhead", "fairness"])
    p.add_argument("--upstream", nargs="+", choices=["stub", "vllm"], default=["stub"],
                   help="what the engine sends to: the stub (the gateway alone is measured), vLLM, or both in turn")
    p.add_argument("--rate", type=float, default=1000.0, help="overhead: requests/s, open loop")
    p.add_argument("--seconds", type=float, default=30.0, help="overhead: each window")
    p.add_argument("--rounds", type=int, default=2, help="overhead: windows of each arm, alternated")
    p.add_argument("--max-tokens", type=int, default=4, help="overhead: tokens a request asks for")
    p.add_argument("--load-procs", type=int, default=2, help="processes the open loop is spread over")
    p.add_argument("--fair-rate", type=float, default=3.0, help="fairness: key B's requests/s")
    p.add_argument("--fair-ratio", type=float, default=10.0, help="fairness: key A's rate as a multiple of B's")
    p.add_argument("--fair-tokens", type=int, default=64, help="fairness: tokens a streamed request asks for")
    p.add_argument("--fair-token-s", type=float, default=0.01, help="fairness, stub: time between its tokens")
    p.add_argument("--fair-slots", type=int, default=16, help="fairness, stub: requests the instance takes at once "
                   "(16 of 0.64 s each: 25 requests/s, less than A's and B's 33)")
    p.add_argument("--fair-max-num-seqs", type=int, default=16, help="fairness, vllm: its max_num_seqs")
    p.add_argument("--fair-seconds", type=float, default=30.0, help="fairness: each window")
    p.add_argument("--model", default=None, help="vllm: the model (the profile's)")
    p.add_argument("--utilization", type=float, default=0.42)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--host-engine", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--upstream-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--slots", type=int, default=0, help=argparse.SUPPRESS)


# --- the engine over a stub --------------------------------------------------------------------------------------


def host_engine(a: argparse.Namespace) -> None:
    """The engine (its app, as `llmops engine` builds it) with its default deployment's one instance the stub."""
    import uvloop

    from engine.app import create_app
    from engine.config import AppConfig

    config = AppConfig(data_dir=Path(a.data_dir), autostart=False, gateway_keys="on", gateway_workers=0,
                       port=a.port)
    app = create_app(config)

    pauses: list[tuple[int, float]] = []
    began: list[float] = [0.0]

    def gc_timed(phase: str, info: dict[str, int]) -> None:  # the engine's own collector pauses, reported
        if phase == "start":
            began[0] = time.perf_counter()
        elif (took := time.perf_counter() - began[0]) > 0.005:
            pauses.append((info["generation"], round(took, 4)))
            (Path(a.data_dir) / "gc-pauses.json").write_text(json.dumps(pauses))  # (rare; SIGTERM ends it)

    import gc

    gc.callbacks.append(gc_timed)

    async def main() -> None:
        await serve_engine_over(app, config, [a.upstream_url], limit=a.slots or None,
                                opened=Path(a.data_dir) / "opened")

    uvloop.run(main())


# --- the load ----------------------------------------------------------------------------------------------------


def word() -> str:
    return "".join(random.choices(string.ascii_lowercase, k=8))


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer


async def one(port: int, pool: list[Conn], key: str, body: bytes, stream: bool) -> tuple[float, float | None, int]:
    """One request on a keep-alive connection: (latency, time to first event of a stream, status). A pooled
    connection the engine closed while it was idle (its keep-alive timeout) is not used; one it closed as the
    request was written, before any answer, is tried once more on a fresh connection — as HTTP clients do."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + key.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n")
    t0 = time.perf_counter()
    while pool:
        conn = pool.pop()
        if conn.reader.at_eof() or conn.writer.is_closing():
            conn.writer.close()
            continue
        try:
            return await exchange(conn, pool, head + body, t0)
        except asyncio.IncompleteReadError as exc:
            conn.writer.close()
            if exc.partial:
                raise
            break
        except ConnectionResetError:
            conn.writer.close()
            break
    conn = Conn(*await asyncio.open_connection("127.0.0.1", port))
    return await exchange(conn, pool, head + body, t0)


async def exchange(conn: Conn, pool: list[Conn], request: bytes, t0: float) -> tuple[float, float | None, int]:
    conn.writer.write(request)
    raw = await conn.reader.readuntil(b"\r\n\r\n")
    status = int(raw.split(b" ", 2)[1])
    headers = raw.lower()
    first: float | None = None
    if b"transfer-encoding: chunked" in headers:
        data = b""
        while not data.endswith(b"\r\n0\r\n\r\n"):
            chunk = await conn.reader.read(65536)
            if not chunk:
                raise ConnectionError("closed mid-stream")
            if first is None and b"data: {" in chunk:
                first = time.perf_counter() - t0
            data = data[-16:] + chunk
    else:
        length = int(headers.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        await conn.reader.readexactly(length)
    latency = time.perf_counter() - t0
    if b"connection: close" in headers:
        conn.writer.close()
    else:
        pool.append(conn)
    return latency, first, status


async def open_loop(port: int, arms: list[tuple[str, str, float, bytes, bool]], seconds: float
                    ) -> dict[str, list[tuple[float, float | None, int]]]:
    """Requests of each arm (name, key, rate, body, stream) at their rate for ``seconds`` (Poisson arrivals):
    each arm's (latency, first event, status)."""
    results: dict[str, list[tuple[float, float | None, int]]] = {name: [] for name, *_ in arms}
    pool: list[Conn] = []
    tasks: set[asyncio.Task[None]] = set()
    failures = [0]

    async def send(name: str, key: str, body: bytes, stream: bool) -> None:
        try:
            results[name].append(await one(port, pool, key, body.replace(b"WORD", word().encode()), stream))
        except (OSError, asyncio.IncompleteReadError, ValueError):
            failures[0] += 1

    async def arm(name: str, key: str, rate: float, body: bytes, stream: bool) -> None:
        end = time.monotonic() + seconds
        at = time.monotonic()
        while True:
            at += random.expovariate(rate)
            if at > end:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            task = asyncio.ensure_future(send(name, key, body, stream))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    await asyncio.gather(*(arm(*spec) for spec in arms))
    if tasks:
        await asyncio.wait(tasks, timeout=600)
    for conn in pool:
        conn.writer.close()
    results["_failures"] = [(float(failures[0]), None, 0)]
    return results


def _load_proc(args: tuple[int, list[tuple[str, str, float, bytes, bool]], float, int]) -> dict[str, Any]:
    import uvloop

    random.seed(args[3])  # the words of its prompts and its arrivals: fresh each run, and recorded
    return uvloop.run(open_loop(*args[:3]))


def load(port: int, arms: list[tuple[str, str, float, bytes, bool]], seconds: float, procs: int
         ) -> tuple[dict[str, list[tuple[float, float | None, int]]], int]:
    """``open_loop`` spread over ``procs`` processes (each a share of every arm's rate)."""
    share = [(name, key, rate / procs, body, stream) for name, key, rate, body, stream in arms]
    with multiprocessing.get_context("spawn").Pool(procs) as pool:
        base = random.randrange(1 << 30)
        SEEDS.append(base)
        parts = pool.map(_load_proc, [(port, share, seconds, base + i) for i in range(procs)])
    merged: dict[str, list[tuple[float, float | None, int]]] = {name: [] for name, *_ in arms}
    failures = 0
    for part in parts:
        for name, rows in part.items():
            if name == "_failures":
                failures += int(rows[0][0])
            else:
                merged[name].extend(rows)
    return merged, failures


SEEDS: list[int] = []  # each load's seed (its processes take it and the next ones), as the report records them


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    data = sorted(values)
    return data[min(len(data) - 1, int(q * len(data)))]


def ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1000:.2f}"


# --- the parts ---------------------------------------------------------------------------------------------------


def completion(max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"prompt": "a fresh question: WORD, and what follows?", "max_tokens": max_tokens,
                       "stream": stream, "temperature": 0}).encode()


def overhead(port: int, api: httpx.Client, a: argparse.Namespace) -> dict[str, Any]:
    plain = api.post("/api/tokens", json={"name": "no-limits", "kind": "gateway", "role": "prompter"}).json()
    api.post("/api/teams", json={"name": "limited-team", "rate_limit_per_min": 1_000_000,
                                 "tokens_per_minute": 10**11, "token_budget": 10**14, "budget_period": "day"})
    limited = api.post("/api/tokens", json={
        "name": "limited", "kind": "gateway", "role": "prompter", "team": "limited-team",
        "rate_limit_per_min": 1_000_000, "tokens_per_minute": 10**11, "token_budget": 10**14,
        "budget_period": "month"}).json()
    body = completion(a.max_tokens, False)
    # warm both paths (keys read and cached, budgets read from the store)
    load(port, [("none", plain["token"], 50, body, False), ("limits", limited["token"], 50, body, False)], 2, 1)
    windows = []
    arms = [("none", plain["token"]), ("limits", limited["token"])]
    for n in range(a.rounds):  # A B, B A, A B…: a drift over the run (a growing store) favours neither arm
        for arm, key in (arms if n % 2 == 0 else arms[::-1]):
            rows, failures = load(port, [(arm, key, a.rate, body, False)], a.seconds, a.load_procs)
            lat = [r[0] for r in rows[arm] if r[2] == 200]
            bad = sum(1 for r in rows[arm] if r[2] != 200) + failures
            statuses: dict[str, int] = {}
            for r in rows[arm]:
                statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1
            windows.append({"round": n, "arm": arm, "requests": len(lat), "failed": bad, "statuses": statuses,
                            "connection_failures": failures,
                            "rate": len(rows[arm]) / a.seconds, "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99),
                            "p999_s": pct(lat, 0.999), "latencies": lat})
            print(f"overhead {arm} round {n}: {len(lat)} ok, {bad} failed, P50 {ms(pct(lat, 0.5))} ms, "
                  f"P99 {ms(pct(lat, 0.99))} ms", flush=True)
    summary = {}
    for arm in ("none", "limits"):
        lat = [x for w in windows if w["arm"] == arm for x in w["latencies"]]
        summary[arm] = {"requests": len(lat), "failed": sum(w["failed"] for w in windows if w["arm"] == arm),
                        "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99), "p999_s": pct(lat, 0.999)}
    for w in windows:
        del w["latencies"]
    added = (summary["limits"]["p99_s"] or 0) - (summary["none"]["p99_s"] or 0)
    # each round's two windows side by side (limits minus none): a drift over the run moves both of a round alike
    by_round = [(w1["p99_s"] or 0) - (w0["p99_s"] or 0)
                for n in range(a.rounds)
                for w0 in windows if w0["round"] == n and w0["arm"] == "none"
                for w1 in windows if w1["round"] == n and w1["arm"] == "limits"]
    cost = claim_cost()
    print(f"claim and settle alone: P50 {cost['p50_us']:.1f} us, P99 {cost['p99_us']:.1f} us", flush=True)
    return {"windows": windows, "summary": summary, "added_p99_s": added, "added_p99_by_round_s": by_round,
            "added_p99_median_of_rounds_s": statistics.median(by_round) if by_round else None,
            "claim_and_settle": cost}


def claim_cost(n: int = 50_000) -> dict[str, Any]:
    """What one request's limits cost in the engine's loop, alone: claim (a key and its team, each with requests
    and tokens per minute and a budget) and settle, timed one by one in this process."""
    from engine.gateway import KeyLimits, Policy
    from engine.gateway.limits import Bounds

    bounds = Bounds(rate_limit_per_min=10**6, tokens_per_minute=10**11, token_budget=10**14, budget_period="day")

    class Limits(KeyLimits):
        def _read_policy(self, key_id: int) -> Policy:
            return Policy(key_id, bounds, team_id=1, team="t", team_bounds=bounds)

    async def timed() -> list[float]:
        limits = KeyLimits.__new__(Limits)
        KeyLimits.__init__(limits, None, cache_s=3600)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            grant = await limits.claim(1, "c", 40, 60, True)
            limits.settle(grant, 50)
            times.append(time.perf_counter() - t0)
        return times

    times = asyncio.run(timed())[1000:]
    return {"calls": len(times), "p50_us": (pct(times, 0.5) or 0) * 1e6, "p99_us": (pct(times, 0.99) or 0) * 1e6}


def fairness(port: int, api: httpx.Client, a: argparse.Namespace) -> dict[str, Any]:
    for team in ("team-a", "team-b", "one-team"):
        api.post("/api/teams", json={"name": team})

    def key(name: str, team: str) -> str:
        token: str = api.post("/api/tokens", json={"name": name, "kind": "gateway", "role": "prompter",
                                                   "team": team}).json()["token"]
        return token

    keys = {"a": key("a-fair", "team-a"), "b": key("b-fair", "team-b"), "a1": key("a-one", "one-team"),
            "b1": key("b-one", "one-team")}
    body = completion(a.fair_tokens, True)
    rate_b, rate_a = a.fair_rate, a.fair_rate * a.fair_ratio
    runs = [("B alone", [("B", keys["b"], rate_b, body, True)]),
            ("A and B, fair queues (two teams)", [("A", keys["a"], rate_a, body, True),
                                                  ("B", keys["b"], rate_b, body, True)]),
            ("A and B, first come first served (one team)", [("A", keys["a1"], rate_a, body, True),
                                                             ("B", keys["b1"], rate_b, body, True)])]
    out = []
    for label, arms in runs:
        rows, failures = load(port, arms, a.fair_seconds, 1)
        entry: dict[str, Any] = {"run": label, "failed_connections": failures}
        for name in ("A", "B"):
            if name not in rows:
                continue
            ttft = [r[1] for r in rows[name] if r[2] == 200 and r[1] is not None]
            entry[name] = {"requests": len(rows[name]), "ok": len(ttft), "ttft_p50_s": pct(ttft, 0.5),
                           "ttft_p95_s": pct(ttft, 0.95), "ttft_p99_s": pct(ttft, 0.99)}
            if name == "B":
                entry[name]["ttft_s"] = sorted(round(t, 4) for t in ttft)
        print(f"fairness {label}: " + ", ".join(f"{n} TTFT P95 {ms(entry[n]['ttft_p95_s'])} ms ({entry[n]['ok']} ok)"
                                                for n in ("A", "B") if n in entry), flush=True)
        out.append(entry)
        time.sleep(2)  # (what one run queued drains before the next)
    alone = out[0]["B"]["ttft_p95_s"] or 0
    for entry in out[1:]:
        entry["b_p95_vs_alone"] = (entry["B"]["ttft_p95_s"] or 0) / alone if alone else None
    return {"rate_b": rate_b, "rate_a": rate_a, "runs": out}


def table(report: dict[str, Any]) -> str:
    lines = []
    for key in [k for k in report if k.startswith("overhead")]:
        o = report[key]
        lines.append(f"**{key}**")
        lines += [f"overhead: {report['args']['rate']:g} requests/s offered, {report['args']['seconds']:g} s "
                  f"windows x {report['args']['rounds']} each, alternated", "",
                  "| key | requests | failed | P50 ms | P99 ms | P99.9 ms |", "|---|---:|---:|---:|---:|---:|"]
        for arm in ("none", "limits"):
            s = o["summary"][arm]
            lines.append(f"| {'no limits' if arm == 'none' else 'limits on key and team'} | {s['requests']} | "
                         f"{s['failed']} | {ms(s['p50_s'])} | {ms(s['p99_s'])} | {ms(s['p999_s'])} |")
        c = o["claim_and_settle"]
        lines += ["", f"limits added {o['added_p99_s'] * 1000:+.2f} ms to the P99; claim and settle alone "
                  f"(a key and its team, every limit set): P50 {c['p50_us']:.1f} us, P99 {c['p99_us']:.1f} us", ""]
        if o.get("added_p99_by_round_s"):
            lines += [f"by round (limits minus none, each round's two windows side by side): "
                      f"{', '.join(f'{x * 1000:+.2f}' for x in o['added_p99_by_round_s'])} ms; "
                      f"median {o['added_p99_median_of_rounds_s'] * 1000:+.2f} ms", ""]
    for key in [k for k in report if k.startswith("fairness")]:
        f = report[key]
        lines.append(f"**{key}**")
        lines += [f"fairness: key B at {f['rate_b']:g} req/s, key A at {f['rate_a']:g} req/s, streamed", "",
                  "| run | B TTFT P50 ms | B TTFT P95 ms | B P95 vs alone | A TTFT P95 ms | A ok |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in f["runs"]:
            a_ = r.get("A") or {}
            lines.append(f"| {r['run']} | {ms(r['B']['ttft_p50_s'])} | {ms(r['B']['ttft_p95_s'])} | "
                         f"{r.get('b_p95_vs_alone') or 1:.2f}x | {ms(a_.get('ttft_p95_s'))} | {a_.get('ok', '–')} |")
    return "\n".join(lines)


def _engine_over_stub(a: argparse.Namespace, workdir: Path, slots: int) -> tuple[subprocess.Popen[bytes], int,
                                                                                   subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
           "LLMOPS_ADMIN_PASSWORD": "bench-admin-password"}
    stub_port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "tests.testkit.stub_upstream", "--port", str(stub_port),
                             "--token-s", str(a.fair_token_s if slots else 0.0)], cwd=REPO, env=env)
    data = workdir / f"data-{slots}"
    data.mkdir()
    port = free_port()
    log = open(workdir / f"engine-{slots}.log", "wb")  # noqa: SIM115 - the process holds it
    host = subprocess.Popen([sys.executable, "-m", "bench", "limits", "--host-engine", "--port", str(port),
                             "--upstream-url", f"http://127.0.0.1:{stub_port}", "--data-dir", str(data),
                             "--slots", str(slots), "--out", str(workdir / "host")], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (data / "opened").exists():
        if host.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the engine did not come up: see {log.name}")
        time.sleep(0.2)
    token = httpx.post(f"http://127.0.0.1:{port}/api/auth/login",
                       json={"username": "admin", "password": "bench-admin-password"}).json()["token"]
    return host, port, stub, token


def run(a: argparse.Namespace) -> int:
    if a.host_engine:
        host_engine(a)
        return 0
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a) | {"out": str(a.out)},
                              "cores": len(os.sched_getaffinity(0))}

    def save() -> None:
        (a.out / "limits.json").write_text(json.dumps(report, indent=1, default=str))
        (a.out / "limits.md").write_text(table(report) + "\n")

    with tempfile.TemporaryDirectory(prefix="llmops-limits-") as tmp:
        for upstream, part in [(u, p) for u in a.upstream for p in a.part]:
            key = part if len(a.upstream) == 1 else f"{part} ({upstream})"
            if upstream == "stub":
                host, port, stub, token = _engine_over_stub(a, Path(tmp), a.fair_slots if part == "fairness" else 0)
                try:
                    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                      headers={"authorization": f"Bearer {token}"}) as api:
                        report[key] = (overhead if part == "overhead" else fairness)(port, api, a)
                finally:
                    os.killpg(host.pid, 15)
                    host.wait(60)
                    stub.terminate()
                    stub.wait(10)
                pauses = Path(tmp) / f"data-{a.fair_slots if part == 'fairness' else 0}" / "gc-pauses.json"
                if pauses.exists() and key in report:
                    report[key]["engine_gc_pauses"] = json.loads(pauses.read_text())
            else:
                from bench.scenarios.gateway_overhead import Engine

                seqs = a.fair_max_num_seqs if part == "fairness" else a.max_num_seqs
                engine_args = argparse.Namespace(model=a.model, utilization=a.utilization,
                                                 max_model_len=a.max_model_len, load_format=a.load_format,
                                                 max_num_seqs=seqs, cap_vs_restart=False, engine_nice=None,
                                                 out=a.out)
                engine = Engine(REPO, part, engine_args, Path(tmp))
                try:
                    engine.serve()
                    report[key] = (overhead if part == "overhead" else fairness)(engine.port, engine.http, a)
                finally:
                    engine.stop()
            save()
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    report["seeds"] = SEEDS
    save()
    print(table(report))
    return 0
