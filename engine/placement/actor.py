"""What runs on a node of the Ray cluster for the engine (imported there by Ray's workers; no Ray import at module
level, so the engine's local path can import this module's names without Ray):

- ``VllmProcess``: starts one vLLM server on its node, in its own process group, with a guard that kills that
  group if the actor dies (a node removed, the actor killed: vLLM's engine core outlives its API server otherwise);
  keeps its recent log lines for the engine to fetch; answers when it exits; stops it SIGTERM → SIGKILL.
- ``NodeAgent``: the node's telemetry, the engine's own sampler (engine/gpu) run there: NVML where the node has
  GPUs, the host's CPU and memory where it has none, each vLLM process attributed to its deployment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from engine.vllm_sandbox import Sandbox

# Runs beside vLLM's process group, in a session of its own: when the actor that started it is gone (its parent
# changed), or the process that started the actor (on a Ray node, its raylet: the node's death, which the actor's
# own exit follows only a second or two later) is, the group is killed (checked ten times a second); when the group
# is empty, it exits. The actor names its own parent when it starts the guard: a raylet that died before the guard's
# first line ran (a loaded host) would otherwise leave the guard watching the process the actor was handed to.
GUARD = """
import os, signal, sys, time
parent, group, grand = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if grand <= 1:
    grand = None
def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
while True:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit(0)
    if os.getppid() != parent or (grand is not None and not alive(grand)):
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(0)
    time.sleep(0.1)
"""
KEEP_LINES = 20_000  # lines kept on the node for the engine to fetch (it fetches every fraction of a second)


def node_ip() -> str:
    """This node's address as the cluster knows it (Ray's own view), for vLLM to listen on."""
    import ray

    return str(ray.util.get_node_ip_address())


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VllmProcessImpl:
    """The actor's body (``VllmProcess`` is this class made remote)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.guard: subprocess.Popen[bytes] | None = None
        self.lines: deque[str] = deque(maxlen=KEEP_LINES)
        self.first = 0  # index of lines[0] in the whole output
        self._lock = threading.Lock()
        self._done = threading.Event()

    def start(self, args: list[str], env: dict[str, str], cwd: str | None, host: str | None = None,
              sandbox: Sandbox | None = None) -> dict[str, Any]:
        """Start vLLM listening on this node's address (``host``: another, for a test without Ray) and a free port
        there: (pid, address, port, node). ``sandbox``: started through it (engine/vllm_sandbox.py), which hides
        the engine's files where this node is the engine's host, and nothing elsewhere."""
        in_ray = host is None
        host = host or node_ip()
        port = free_port(host)
        args = list(args)
        if "-m" in args:  # vLLM runs in this node's Python (the one Ray's workers run in), not the engine's path
            args[args.index("-m") - 1] = sys.executable
        for flag, value in (("--host", host), ("--port", str(port))):
            if flag in args:
                args[args.index(flag) + 1] = value
            else:
                args += [flag, value]
        folder = Path(cwd) if cwd else Path(os.environ.get("LLMOPS_NODE_DIR") or Path.home() / ".cache" / "llmops")
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if sandbox is not None:
            args = sandbox.wrap(args, sys.executable)
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, cwd=str(folder), start_new_session=True)
        self.guard = subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid()), str(self.proc.pid),
                                       str(os.getppid())],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True, name=f"vllm-{self.name}-log").start()
        return {"pid": self.proc.pid, "address": host, "port": port, "node": _node_id() if in_ray else None}

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            with self._lock:
                if len(self.lines) == self.lines.maxlen:
                    self.first += 1
                self.lines.append(line)
        self.proc.wait()
        self._done.set()

    def read(self, since: int) -> tuple[int, list[str], int | None]:
        """Lines from index ``since`` on (what was dropped meanwhile is skipped), the next index, and the exit
        code once it has exited."""
        with self._lock:
            start = max(since, self.first)
            out = list(self.lines)[start - self.first:]
            nxt = self.first + len(self.lines)
        code = self.proc.poll() if self.proc is not None else None
        return nxt, out, code

    def wait(self) -> int | None:
        """Block until the server process exits; its exit code."""
        if self.proc is None:
            return None
        return self.proc.wait()

    def pids(self) -> list[int]:
        """The server and its descendants (for the node's telemetry to attribute GPU memory)."""
        if self.proc is None:
            return []
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [self.proc.pid, *(p.pid for p in root.children(recursive=True))]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float) -> float:
        """SIGTERM the group, wait up to ``timeout``, SIGKILL what is left; the seconds it took."""
        if self.proc is None:
            return 0.0
        t0 = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        deadline = time.monotonic() + timeout
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            end = time.monotonic() + 30
            while _group_alive(self.proc.pid) and time.monotonic() < end:
                time.sleep(0.1)
        self._done.wait(5)
        return time.monotonic() - t0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    import psutil

    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return False


def _node_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_node_id())


class NodeAgentImpl:
    """The node's telemetry: the engine's sampler, run on the node, its vLLM processes attributed."""

    def __init__(self, interval_s: float) -> None:
        import pynvml

        from engine.gpu.sampler import Sampler

        self.ours: dict[int, str | None] = {}
        self.sampler = Sampler(pynvml, interval_s, lambda: dict(self.ours), [], lambda *_: None)

    def attribute(self, pids: dict[int, str | None]) -> None:
        """Which processes on this node are which deployment's vLLM (the engine names each server; its engine core
        and workers, descendants of it, are the same deployment's)."""
        import psutil

        ours = dict(pids)
        for pid, deployment in pids.items():
            with contextlib.suppress(psutil.Error):
                ours.update({p.pid: deployment for p in psutil.Process(pid).children(recursive=True)})
        self.ours = ours

    def snapshot(self) -> Any:
        """One reading now (NVML per GPU, or the host): the engine's own Snapshot."""
        return self.sampler.tick()
