"""What one connection's huge request heads do to everyone else: /healthz latency while attackers send heads with
a 96 MiB header back to back (the probe of issue 17), against the engine and the console of each checkout.

    python -m bench edge-heads --tree before=/path/to/old/checkout --tree after=. --seconds 30 --out DIR

For each tree and target (the engine: ``llmops engine``, vLLM not started; the console: ``llmops console``), in
turn: a quiet phase (health checks only), then an attack phase of the same length (``--attackers`` connections,
each sending ``GET /`` with one ``X-Pad`` header of ``--head-mib`` MiB, 1 MiB per write, as fast as the server
takes it, then again). A prober sends one health check every 20 ms on a fresh connection (10 s timeout) and
records its latency; a check that times out is counted as failed. Prints a table and writes edge-heads.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 1 << 20
TARGETS = {"engine": "/healthz", "console": "/_stcore/health"}


@dataclass
class Phase:
    tree: str
    target: str
    phase: str
    seconds: float
    checks: int = 0
    failed: int = 0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    heads: int = 0  # attack heads sent (or cut off)
    attack_mib: float = 0.0  # bytes the server took of them
    refused_431: int = 0
    latencies_ms: list[float] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def check(port: int, path: str) -> float | None:
    """One health check on a fresh connection: its latency in ms, or None when it failed or took over 10 s."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError:
        return None
    if not answer.startswith(b"HTTP/1.1 200"):
        return None
    return (time.perf_counter() - t0) * 1000


def attacker(port: int, head_mib: int, stop: threading.Event, phase: Phase, lock: threading.Lock) -> None:
    piece = b"a" * MiB
    while not stop.is_set():
        sent = 0
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
                try:
                    while sent < head_mib * MiB and not stop.is_set():
                        sock.sendall(piece)
                        sent += MiB
                except OSError:
                    pass
                try:
                    answer = sock.recv(200)
                except OSError:
                    answer = b""
        except OSError:
            answer = b""
        with lock:
            phase.heads += 1
            phase.attack_mib += sent / MiB
            phase.refused_431 += answer.startswith(b"HTTP/1.1 431")


def run_phase(port: int, path: str, phase: Phase, attackers: int, head_mib: int) -> Phase:
    stop = threading.Event()
    lock = threading.Lock()
    threads = [threading.Thread(target=attacker, args=(port, head_mib, stop, phase, lock), daemon=True)
               for _ in range(attackers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + phase.seconds
    while time.monotonic() < deadline:
        latency = check(port, path)
        phase.checks += 1
        if latency is None:
            phase.failed += 1
        else:
            phase.latencies_ms.append(latency)
        time.sleep(0.02)
    stop.set()
    for t in threads:
        t.join(30)
    lat = sorted(phase.latencies_ms)
    if lat:
        phase.p50_ms = statistics.median(lat)
        phase.p99_ms = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        phase.max_ms = lat[-1]
    return phase


def start(tree: Path, target: str, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    data = workdir / f"data-{tree.name}-{target}-{port}"
    (data / "models" / "demo").mkdir(parents=True)
    (data / "models" / "demo" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                                     "model_type": "llama"}))
    env = {**os.environ, "PYTHONPATH": str(tree), "LLMOPS_AUTOSTART": "false",
           "LLMOPS_ADMIN_PASSWORD": "edge-heads-bench", "LLMOPS_ENGINE_URL": f"http://127.0.0.1:{free_port()}"}
    cmd = [sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data), "--port", str(port)] \
        if target == "engine" else [sys.executable, "-m", "engine.cli", "console", "--console-port", str(port)]
    log = open(workdir / f"{target}-{port}.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while check(port, TARGETS[target]) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{target} of {tree} did not come up: see {log.name}")
        time.sleep(0.3)
    return proc, port


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tree", action="append", default=[], help="label=path of a checkout (default: after=.)")
    ap.add_argument("--target", action="append", choices=sorted(TARGETS), default=[])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--attackers", type=int, default=1)
    ap.add_argument("--head-mib", type=int, default=96)


def run(args: argparse.Namespace) -> None:
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("after", Path("."))]
    phases: list[Phase] = []
    with tempfile.TemporaryDirectory() as tmp:
        for target in args.target or sorted(TARGETS):
            for label, tree in trees:
                proc, port = start(tree, target, Path(tmp))
                try:
                    for name, attackers in (("quiet", 0), ("attack", args.attackers)):
                        phase = run_phase(port, TARGETS[target], Phase(label, target, name, args.seconds),
                                          attackers, args.head_mib)
                        phases.append(phase)
                        print(f"{target:8s} {label:7s} {name:7s} checks {phase.checks:5d} failed {phase.failed:4d} "
                              f"P50 {phase.p50_ms:8.1f} ms  P99 {phase.p99_ms:8.1f} ms  max {phase.max_ms:8.1f} ms  "
                              f"heads {phase.heads:4d} ({phase.attack_mib:7.0f} MiB taken, {phase.refused_431} "
                              "answered 431)", flush=True)
                finally:
                    proc.terminate()
                    proc.wait(60)
    (args.out / "edge-heads.json").write_text(json.dumps([asdict(p) for p in phases], indent=1))

