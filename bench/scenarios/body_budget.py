"""What concurrent large /v1 bodies cost the engine's memory: its RSS while N clients each send a body near the
31 MiB the probe of issue 17 used, to an engine whose vLLM is not up (so every body is held while it waits, the
worst case), for each checkout.

    python -m bench body-budget --tree before=/path/to/old/checkout --tree after=. --out DIR

Shapes: ``string`` (one long prompt string), ``ids`` (the prompt as an array of token ids), ``messages`` (a chat
of many short messages). For each tree and shape a fresh engine is started (``llmops engine``, autostart off,
``queue_timeout_s`` 15), its RSS sampled every 20 ms from before the first byte is sent until every client has
its answer; prints base and peak RSS, the growth, and the answers (503: refused by the budget, or the queue's
timeout). "vLLM" is a stand-in that never becomes ready (``vllm_python`` is a script that sleeps), so the engine
is starting it the whole time and holds each request in its queue, body and all. Writes body-budget.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

MiB = 1 << 20
DEMO_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
              "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "vocab_size": 2048, "max_position_embeddings": 2048, "tie_word_embeddings": True,
              "dtype": "bfloat16"}  # the demo model's config.json, without weights (no vLLM reads it)


@dataclass
class Result:
    tree: str
    shape: str
    clients: int
    body_bytes: int
    base_rss_mb: float = 0.0
    peak_rss_mb: float = 0.0
    growth_mb: float = 0.0
    seconds: float = 0.0
    answers: list[str] = field(default_factory=list)


def body_of(shape: str, size: int) -> bytes:
    rnd = random.Random(17)
    if shape == "string":
        return json.dumps({"model": "demo", "prompt": "word " * (size // 5), "max_tokens": 5}).encode()
    if shape == "ids":
        return json.dumps({"model": "demo", "prompt": [rnd.randrange(1000, 30000) for _ in range(size // 7)],
                           "max_tokens": 5}).encode()
    return json.dumps({"model": "demo", "messages": [{"role": "user", "content": f"message {i} " + "x" * 30}
                                                     for i in range(size // 80)], "max_tokens": 5}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(port: int, body: bytes, answers: list[str], lock: threading.Lock) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
            with contextlib.suppress(OSError):  # refused before the body was read
                sock.sendall(body)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
    except OSError as exc:
        answer = repr(exc).encode()
    head, _, rest = answer.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].decode(errors="replace")
    try:
        message = json.loads(rest)["error"]["message"][:90]
    except (ValueError, KeyError, TypeError):
        message = rest[:90].decode(errors="replace")
    with lock:
        answers.append(f"{status}: {message}")


def run_one(tree: Path, label: str, shape: str, clients: int, size: int, workdir: Path) -> Result:
    port = free_port()
    data = workdir / f"data-{label}-{shape}"
    (data / "models" / "demo").mkdir(parents=True)
    (data / "models" / "demo" / "config.json").write_text(json.dumps(DEMO_SHAPE))
    never_ready = workdir / "never-ready-vllm"
    never_ready.write_text("#!/bin/sh\nexec sleep 600\n")
    never_ready.chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(tree), "LLMOPS_AUTOSTART": "true", "LLMOPS_QUEUE_TIMEOUT_S": "15",
           "LLMOPS_VLLM_PYTHON": str(never_ready), "LLMOPS_ADMIN_PASSWORD": "body-budget-bench",
           "LLMOPS_GATEWAY_KEYS": "off"}
    log = open(workdir / f"engine-{label}-{shape}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "engine", "--data-dir", str(data), "--port",
                             str(port)], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    if sock.recv(100).startswith(b"HTTP/1.1 200"):
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the engine of {tree} did not come up: see {log.name}")
            time.sleep(0.3)
        body = body_of(shape, size)
        engine = psutil.Process(proc.pid)
        time.sleep(2)  # settled after start-up
        result = Result(label, shape, clients, len(body), base_rss_mb=engine.memory_info().rss / 1e6)
        answers: list[str] = []
        lock = threading.Lock()
        threads = [threading.Thread(target=post, args=(port, body, answers, lock)) for _ in range(clients)]
        peak = result.base_rss_mb
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            peak = max(peak, engine.memory_info().rss / 1e6)
            time.sleep(0.02)
        result.seconds = time.monotonic() - t0
        result.peak_rss_mb = peak
        result.growth_mb = peak - result.base_rss_mb
        result.answers = sorted(answers)
        return result
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tree", action="append", default=[], help="label=path of a checkout (default: after=.)")
    ap.add_argument("--shape", action="append", choices=["string", "ids", "messages"], default=[])
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--mib", type=float, default=31.0, help="body size, MiB")


def run(args: argparse.Namespace) -> None:
    trees = [(t.split("=", 1)[0], Path(t.split("=", 1)[1]).resolve()) for t in args.tree] or [("after", Path("."))]
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shape or ["string", "ids"]:
            for label, tree in trees:
                r = run_one(tree, label, shape, args.clients, int(args.mib * MiB), Path(tmp))
                results.append(r)
                counts: dict[str, int] = {}
                for a in r.answers:
                    counts[a] = counts.get(a, 0) + 1
                print(f"{shape:8s} {label:7s} {r.clients} x {r.body_bytes / MiB:.1f} MiB: RSS {r.base_rss_mb:.0f} -> "
                      f"{r.peak_rss_mb:.0f} MB (+{r.growth_mb:.0f} MB) in {r.seconds:.1f} s; "
                      + "; ".join(f"{n} x {a}" for a, n in counts.items()), flush=True)
    (args.out / "body-budget.json").write_text(json.dumps([asdict(r) for r in results], indent=1))

