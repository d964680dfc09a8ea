"""A fake vLLM, for the serving tier's tests only: a child that follows the same protocol as the real one
(engine/vllm/protocol.py Child), driven by a script and an injected clock.

It serves HTTP in process, on the port the launcher chose: ``/health``, a 1-token probe, ``/v1/completions`` and
``/v1/chat/completions`` (streamed as vLLM streams them: server-sent events, a usage chunk, ``[DONE]``), the sleep
mode's ``/sleep``, ``/wake_up`` and ``/is_sleeping``. Its start prints real vLLM log lines (tests/fixtures/vllm_logs)
spread over its scripted start, so the engine's start tracker sees vLLM's phases; it becomes ready, exits with a
code, or is lost with its node, at the times its script says, as the clock passes them. Tokens stream in real time
(a millisecond each): a drain waits for real streams to end.

Not a vLLM: it holds no model and no memory, and answers every prompt with the same few tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.placement import NodeInfo, PlacementError
from engine.vllm import Child, ChildSpec, StartTracker
from tests.testkit.clock import ScriptClock

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOGS = FIXTURES / "vllm_logs"
METRICS = FIXTURES / "vllm-0.32-cpu-metrics.txt"  # a real scrape of vLLM 0.32's /metrics
START_LOG = "cpu-startup-demo.log"
OOM_LOG = "cpu-fail-kv-cache-too-small.log"


def log_lines(name: str) -> list[str]:
    return (LOGS / name).read_text(errors="replace").splitlines()


@dataclass
class Script:
    """How one fake start goes, in the clock's seconds from its spawn."""

    ready_s: float = 20.0  # when it answers as ready (None with fail_s: never)
    log: str = START_LOG  # the real vLLM log its start prints, spread over [0, ready_s)
    fail_s: float | None = None  # it exits during start-up at this time, with exit_code, printing fail_log
    exit_code: int = 1
    fail_log: str | None = OOM_LOG
    lost_s: float | None = None  # its node (or Ray actor) is lost at this time: gone without an exit code
    tokens: int = 6  # tokens a request gets
    token_delay_s: float = 0.001  # real seconds between two streamed tokens
    stop_s: float = 0.4  # what a stop takes, as it reports it
    sleep_ok: bool = True  # /sleep answers 200
    wake_ok: bool = True  # /wake_up answers 200
    lora_ok: bool = True  # /v1/load_lora_adapter loads (else 500, as vLLM when its worker refuses one)


@dataclass
class Served:
    """What one fake instance answered."""

    requests: int = 0  # /v1 requests it began
    completed: int = 0  # ended whole
    cut: int = 0  # cut off (a crash, a stop)
    probes: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)  # the prompts of those requests, in order
    models: list[str] = field(default_factory=list)  # the model each asked for ("" when none)
    lora_calls: list[tuple[str, str]] = field(default_factory=list)  # ("load" | "unload", adapter), in order


class FakeVllm:
    """One fake vLLM run (Child), on 127.0.0.1 at the spec's port."""

    def __init__(self, spec: ChildSpec, script: Script, clock: ScriptClock, on_lost: Callable[[str], None]) -> None:
        self.spec = spec
        self.script = script
        self.clock = clock
        self.on_lost = on_lost
        self.name = spec.name
        self.port = spec.port
        self.revision_id = spec.revision_id
        self.api_key = spec.api_key
        self.lines: deque[str] = deque(maxlen=5000)
        self.tracker = StartTracker(t0=clock.monotonic(), clock=clock.monotonic)
        self.stop_requested = False
        self.on_exit: Callable[[Child], None] | None = None
        self.exited_at: float | None = None
        self.lost: str | None = None
        self.served = Served()
        self.ready = False
        self.sleeping = False
        self.unhealthy = False  # /health answers 503 (a hung engine core)
        self.spawned_at: float | None = None
        self._code: int | None = None
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._node = spec.node
        args = list(spec.args)
        self.served_name = args[args.index("--served-model-name") + 1] if "--served-model-name" in args else ""
        # with LoRA on, a model it does not serve is vLLM's 404 (without, the fake answers any name it is sent)
        self.lora_on = "--enable-lora" in args
        self.loras: dict[str, str] = {}  # the LoRA adapters it serves: from --lora-modules, then loaded live
        if "--lora-modules" in args:
            for arg in args[args.index("--lora-modules") + 1:]:
                if arg.startswith("--"):
                    break
                name, _, path = arg.partition("=")
                self.loras[name] = path

    # --- Child ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def pid(self) -> int | None:
        return None  # no process: nothing of this host's to renice, sample or reap

    @property
    def returncode(self) -> int | None:
        return self._code

    @property
    def exited(self) -> bool:
        return self.exited_at is not None

    @property
    def started(self) -> bool:
        return self.spawned_at is not None

    @property
    def local(self) -> bool:
        return self._node is None

    @property
    def node(self) -> str | None:
        return self._node

    def remember_descendants(self) -> None:
        return None

    async def spawn(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", self.port)
        now = self.clock.monotonic()
        self.spawned_at = now
        self.tracker = StartTracker(t0=now, clock=self.clock.monotonic)
        script = self.script
        failing = script.fail_s is not None
        end = script.fail_s if script.fail_s is not None else script.ready_s
        lines = log_lines(script.fail_log if failing and script.fail_log else script.log)  # a failed start's own
        for i, line in enumerate(lines):
            self.clock.at(now + end * 0.95 * i / max(1, len(lines)), functools.partial(self._print, line))
        if script.fail_s is not None:
            self.clock.at(now + script.fail_s, lambda: self.crash(script.exit_code))
        else:
            self.clock.at(now + script.ready_s, self._ready)
        if script.lost_s is not None:
            self.clock.at(now + script.lost_s, lambda: self.lose("its node stopped answering"))

    async def stop(self, timeout: float) -> float:
        self.stop_requested = True
        if not self.exited:
            self._end(0)
        return self.script.stop_s

    # --- faults a test injects ----------------------------------------------------------------------------------

    def crash(self, code: int = 1, log: str | None = None) -> None:
        """It exits on its own with ``code`` (printing ``log`` first): its connections break."""
        if self.exited:
            return
        for line in log_lines(log) if log else []:
            self._print(line)
        self._end(code)

    def lose(self, why: str) -> None:
        """Its node or actor is gone: no exit code, its connections break."""
        if self.exited:
            return
        self.lost = why
        if self._node is not None:
            self.on_lost(self._node)
        self._end(None)

    # --- inside ------------------------------------------------------------------------------------------------

    def _print(self, line: str) -> None:
        if self.exited:
            return
        self.lines.append(line)
        self.spec.log.write(f"[{self.name}] {line}")
        self.tracker.feed(line)

    def _ready(self) -> None:
        if not self.exited:
            self._print("(APIServer pid=N) INFO:     Application startup complete.")
            self.ready = True

    def _end(self, code: int | None) -> None:
        self._code = code
        self.exited_at = self.clock.monotonic()
        self.ready = False
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        if self.on_exit is not None:
            self.on_exit(self)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while not self.exited:
                line = await reader.readline()
                if not line:
                    break
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    key, _, value = raw.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                size = int(headers.get("content-length") or 0)
                body = await reader.readexactly(size) if size else b""
                if not await self._answer(method, target.split("?")[0], headers, body, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, status: int, body: bytes,
                    content_type: str = "application/json") -> bool:
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
                     .encode() + body)
        await writer.drain()
        return True

    async def _answer(self, method: str, path: str, headers: dict[str, str], body: bytes,
                      writer: asyncio.StreamWriter) -> bool:
        if path == "/health":
            ok = self.ready and not self.unhealthy
            return await self._send(writer, 200 if ok else 503, b"")
        if path == "/metrics":
            return await self._send(writer, 200, METRICS.read_bytes(), "text/plain; version=0.0.4")
        if path == "/is_sleeping":
            return await self._send(writer, 200, json.dumps({"is_sleeping": self.sleeping}).encode())
        if path == "/sleep" and method == "POST":
            if not self.script.sleep_ok:
                return await self._send(writer, 500, b'{"error": "sleep failed"}')
            self.sleeping = True
            return await self._send(writer, 200, b"")
        if path == "/wake_up" and method == "POST":
            if not self.script.wake_ok:
                return await self._send(writer, 500, b'{"error": "wake failed"}')
            self.sleeping = False
            return await self._send(writer, 200, b"")
        if path in ("/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
                return await self._send(writer, 401, b'{"error": "Unauthorized"}')
            return await self._lora(path, body, writer)
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await self._send(writer, 404, b'{"error": "not found"}')
        if self.api_key and headers.get("authorization") != f"Bearer {self.api_key}":
            return await self._send(writer, 401, b'{"error": "Unauthorized"}')
        if not self.ready or self.sleeping:
            return await self._send(writer, 503, b'{"error": "not ready"}')
        request: dict[str, Any] = json.loads(body or b"{}")
        model = str(request.get("model") or "")
        if self.lora_on and model and model != self.served_name and model not in self.loras:
            return await self._send(writer, 404, json.dumps({"error": {
                "message": f"The model `{model}` does not exist.", "type": "NotFoundError", "code": 404}}).encode())
        tokens = max(1, min(int(request.get("max_tokens") or self.script.tokens), self.script.tokens))
        if request.get("prompt") == "Hello" and request.get("max_tokens") == 1:
            self.served.probes += 1
        else:
            self.served.requests += 1
            self.served.models.append(model)
            self.served.headers.append(headers)
            self.served.prompts.append(str(request.get("prompt", request.get("messages", ""))))
        chat = path.endswith("chat/completions")
        if not request.get("stream"):
            text = "x" * tokens
            choice = {"index": 0, "finish_reason": "length",
                      **({"message": {"role": "assistant", "content": text}} if chat else {"text": text})}
            await self._send(writer, 200, json.dumps({"id": "cmpl-fake", "object": "text_completion",
                                                      "choices": [choice], "usage": _usage(tokens)}).encode())
            self.served.completed += 1
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            for i in range(tokens):
                await asyncio.sleep(self.script.token_delay_s)
                if self.exited:
                    raise ConnectionError("the fake vLLM exited mid-stream")
                delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
                _chunk(writer, {"id": "cmpl-fake", "choices": [{"index": 0, "finish_reason": None if i + 1 < tokens
                                                                else "length", **delta}]})
                await writer.drain()
            if (request.get("stream_options") or {}).get("include_usage"):
                _chunk(writer, {"id": "cmpl-fake", "choices": [], "usage": _usage(tokens)})
            writer.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self.served.cut += 1
            raise
        self.served.completed += 1
        return True


    async def _lora(self, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """GET /v1/models, and vLLM's runtime LoRA endpoints (VLLM_ALLOW_RUNTIME_LORA_UPDATING), as vLLM answers."""
        if path == "/v1/models":
            data = [{"id": self.served_name, "object": "model", "parent": None}] + [
                {"id": name, "object": "model", "root": where, "parent": self.served_name}
                for name, where in self.loras.items()]
            return await self._send(writer, 200, json.dumps({"object": "list", "data": data}).encode())
        request: dict[str, Any] = json.loads(body or b"{}")
        name = str(request.get("lora_name") or "")
        if path == "/v1/load_lora_adapter":
            self.served.lora_calls.append(("load", name))
            if name in self.loras:
                return await self._send(writer, 400, json.dumps({"error": {
                    "message": f"The lora adapter '{name}' has already been loaded.", "code": 400}}).encode())
            if not self.script.lora_ok:
                return await self._send(writer, 500, json.dumps({"error": {
                    "message": "Call to add_lora method failed: Worker failed", "code": 500}}).encode())
            self.loras[name] = str(request.get("lora_path") or "")
            return await self._send(writer, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(),
                                    "text/plain")
        self.served.lora_calls.append(("unload", name))
        if self.loras.pop(name, None) is None:
            return await self._send(writer, 404, json.dumps({"error": {
                "message": f"The lora adapter '{name}' cannot be found.", "code": 404}}).encode())
        return await self._send(writer, 200, f"Success: LoRA adapter '{name}' removed successfully.".encode(),
                                "text/plain")


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}


def _chunk(writer: asyncio.StreamWriter, data: dict[str, Any]) -> None:
    payload = b"data: " + json.dumps(data).encode() + b"\n\n"
    writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")


class FakePlacement:
    """Where fake instances run: this host (no ``nodes``), or the named nodes of a pretend cluster, each of which a
    test can lose. ``script`` says how each start goes (one for all, or per spec)."""

    def __init__(self, clock: ScriptClock, script: Script | Callable[[ChildSpec], Script] | None = None,
                 nodes: list[str] | None = None) -> None:
        self.clock = clock
        self.script = script or Script()
        self.kind = "ray" if nodes else "local"
        self._nodes = {n: True for n in nodes or []}
        self._suspect: set[str] = set()
        self.children: list[FakeVllm] = []
        self._numbers = itertools.count(1)

    def script_for(self, spec: ChildSpec) -> Script:
        return self.script(spec) if callable(self.script) else self.script

    def nodes(self) -> list[NodeInfo]:
        if not self._nodes:
            return [NodeInfo(id="local", address="127.0.0.1", head=True)]
        return [NodeInfo(id=n, address="127.0.0.1", alive=up, head=i == 0) for i, (n, up) in
                enumerate(self._nodes.items())]

    def child(self, spec: ChildSpec) -> Child:
        fake = FakeVllm(spec, self.script_for(spec), self.clock, self.suspect)
        self.children.append(fake)
        return fake

    def place(self, index: int, taken: list[str | None], gpus: int = 0) -> str | None:
        if not self._nodes:
            return None
        alive = [n for n, up in self._nodes.items() if up and n not in self._suspect]
        if not alive:
            raise PlacementError("no alive node of the pretend cluster")
        return min(alive, key=lambda n: (taken.count(n), 0 if alive.index(n) == index % len(alive) else 1,
                                         alive.index(n)))

    def alive(self, node: str | None) -> bool:
        return node is None if not self._nodes else bool(node and self._nodes.get(node)) and node not in self._suspect

    def is_suspect(self, node: str) -> bool:
        return node in self._suspect

    def suspect(self, node: str) -> None:
        self._suspect.add(node)

    def lose_node(self, node: str) -> None:
        """The node goes down: every instance on it is lost."""
        self._nodes[node] = False
        for child in self.children:
            if child.node == node:
                child.lose(f"its node {node} went down")

    def live(self) -> list[FakeVllm]:
        return [c for c in self.children if c.started and not c.exited]

    async def close(self) -> None:
        for child in self.children:
            if child._server is not None:
                child._server.close()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(child._server.wait_closed(), 1)


