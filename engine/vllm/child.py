"""The vLLM child process: spawned in its own process group, its output captured, its whole group stopped.

vLLM's API server forks an engine core and workers. Killing only the server leaves the workers holding memory,
so every stop signals the whole group, waits, SIGKILLs it, and then checks that no member is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from engine.errors import PortBusyError, StrayProcessError
from engine.vllm.logs import ChildLog
from engine.vllm.phases import StartTracker
from engine.vllm_sandbox import Sandbox

log = logging.getLogger("llmops.child")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def ensure_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortBusyError(f"port {host}:{port} is in use ({exc}); another vLLM may still be running") from exc


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return members


def kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class VllmChild:
    """One run of vLLM's OpenAI server for one revision, as instance ``name``. Its output goes to the shared log
    (each line marked with the instance) and, unmarked, to its own ``lines`` (what diagnosis and calibration
    read)."""

    def __init__(self, args: list[str], env: dict[str, str], port: int, revision_id: int, log_: ChildLog,
                 pidfile: Path, name: str = "a", keep_lines: int = 5000, cwd: Path | None = None,
                 on_exit: Callable[[Any], None] | None = None, api_key: str | None = None,
                 sandbox: Sandbox | None = None) -> None:
        self.args = args
        self.sandbox = sandbox  # what vLLM may not open: it is started through engine/vllm_sandbox.py (None: as is)
        self.api_key = api_key  # the instance's own key for vLLM's /v1 (VLLM_API_KEY): only the engine holds it
        self.cwd = cwd  # vLLM's working directory: the data dir, never the engine's (a relative --model is read there)
        self.on_exit = on_exit  # called on the event loop the moment the server process exits
        self.exited_at: float | None = None  # monotonic time its exit was seen
        self.lost: str | None = None  # a local process exits with a code: never lost
        self.env = env
        self.port = port
        self.revision_id = revision_id
        self.log = log_
        self.pidfile = pidfile
        self.name = name
        self.lines: deque[str] = deque(maxlen=keep_lines)
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.stop_requested = False
        self._pump_task: asyncio.Task[None] | None = None
        self._known: set[int] = set()
        self._exit_task: asyncio.Task[None] | None = None
        self.tracker = StartTracker()  # the phases of this start, from its log lines

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        """What a request of the engine's own to this instance's /v1 carries (its API key)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc else None

    @property
    def started(self) -> bool:
        return self.proc is not None

    @property
    def local(self) -> bool:
        """A child process of this engine (its pids, priorities and GPU memory are this host's)."""
        return True

    @property
    def node(self) -> str | None:
        return None

    @property
    def exited(self) -> bool:
        """Whether the server process has exited. Seen through a pidfd the moment it happens (its exit code may
        follow a moment later, once the event loop's child watcher has reaped it); not through its log pipe,
        which the engine core and workers it forked can hold open long after."""
        return self.exited_at is not None or self.returncode is not None

    async def spawn(self) -> None:
        ensure_port_free(self.port)
        args = self.sandbox.wrap(self.args) if self.sandbox is not None else self.args
        self.log.new_run(f"instance {self.name}, revision {self.revision_id}: {' '.join(args)}")
        self.proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # own session and process group, led by the server
            limit=1 << 20,
            cwd=str(self.cwd) if self.cwd is not None else None,
        )
        self.started_at = time.monotonic()
        self._watch_exit()
        self.tracker = StartTracker(self.started_at)
        self.pidfile.parent.mkdir(parents=True, exist_ok=True)
        self.pidfile.write_text(json.dumps({"pgid": self.proc.pid, "create_time": _create_time(self.proc.pid)}))
        self._pump_task = asyncio.create_task(self._pump(), name=f"vllm-log-{self.proc.pid}")

    def _watch_exit(self) -> None:
        """Be told of the server's exit at once: a pidfd becomes readable when the process ends, whatever the load
        and whoever holds its pipes. Where pidfds are missing (Linux < 5.3) a task polls every 0.2 s instead."""
        assert self.proc is not None
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(self.proc.pid)
        except OSError:  # ENOSYS on an old kernel; ESRCH: it has already been reaped
            self._exit_task = loop.create_task(self._poll_exit(), name=f"vllm-exit-{self.proc.pid}")
            return

        def readable() -> None:
            loop.remove_reader(fd)
            os.close(fd)
            self._exited()

        loop.add_reader(fd, readable)

    async def _poll_exit(self) -> None:
        assert self.proc is not None
        while self.proc.returncode is None and psutil.pid_exists(self.proc.pid) and \
                _status(self.proc.pid) != psutil.STATUS_ZOMBIE:
            await asyncio.sleep(0.2)
        self._exited()

    def _exited(self) -> None:
        if self.exited_at is not None:
            return
        self.exited_at = time.monotonic()
        if self.on_exit is not None:
            self.on_exit(self)

    async def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while True:
            try:
                raw = await self.proc.stdout.readline()
            except ValueError:  # a line longer than the limit: take what is buffered
                raw = await self.proc.stdout.read(1 << 16)
            if not raw:
                break
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            self.lines.append(line)
            self.log.write(f"[{self.name}] {line}")
            self.tracker.feed(line)
        code = await self.proc.wait()
        if not self.stop_requested:  # what the log's reader tells a failure from a planned stop by
            self.log.mark(f"instance {self.name} (revision {self.revision_id}) exited with code {code} without "
                          "being asked to stop")

    def remember_descendants(self) -> None:
        """Note the server's descendants, so that one that left the group is still stopped."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.NoSuchProcess):
            self._known.update(p.pid for p in psutil.Process(self.proc.pid).children(recursive=True))

    async def stop(self, timeout: float) -> float:
        """SIGTERM the group, wait up to ``timeout``, SIGKILL what is left; return the seconds taken.

        Raises StrayProcessError when members survive SIGKILL."""
        if self.proc is None:
            return 0.0
        t0 = time.monotonic()
        deadline = t0 + timeout
        self.stop_requested = True
        if self.proc.returncode is None:
            self.log.mark(f"stopping instance {self.name} (revision {self.revision_id}) on purpose: what it prints "
                          "while it shuts down is not a failure")
        self.remember_descendants()
        kill_group(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), timeout)
        while (left := self._members()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if left:
            log.warning("vLLM processes %s outlived SIGTERM by %.0f s: SIGKILL", [p.pid for p in left], timeout)
            kill_group(self.proc.pid, signal.SIGKILL)
            for proc in left:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            end = time.monotonic() + 30  # a loaded machine can take a while to reap a killed process
            while (left := self._members()) and time.monotonic() < end:
                await asyncio.sleep(0.1)
            if left:
                raise StrayProcessError(
                    f"vLLM processes {[p.pid for p in left]} survived SIGKILL; free them before starting again"
                )
        if self.proc.returncode is None:
            await self.proc.wait()
        if self._pump_task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pump_task, 5)
        self.pidfile.unlink(missing_ok=True)
        return time.monotonic() - t0

    def _members(self) -> list[psutil.Process]:
        assert self.proc is not None
        members = {p.pid: p for p in group_members(self.proc.pid)}
        members.update({p.pid: p for p in _alive(self._known)})
        return list(members.values())


def _alive(pids: set[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            continue
    return out


def _status(pid: int) -> str | None:
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:
        return None


def _create_time(pid: int) -> float | None:
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.NoSuchProcess:
        return None


def reap_all(run_dir: Path) -> list[int]:
    """Stop every vLLM group an engine that died left behind (one pid file per instance); the pids stopped."""
    stopped: list[int] = []
    for pidfile in sorted(run_dir.glob("vllm*.json")):
        stopped += reap_orphans(pidfile)
    return stopped


def reap_orphans(pidfile: Path) -> list[int]:
    """Stop a vLLM group left behind by an engine that died without stopping it; return the pids stopped."""
    try:
        info = json.loads(pidfile.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return []
    pgid = int(info.get("pgid", 0))
    pidfile.unlink(missing_ok=True)
    if pgid <= 1 or _create_time(pgid) not in (None, info.get("create_time")):
        return []  # the pid was reused by an unrelated process
    members = group_members(pgid)
    if not members:
        return []
    kill_group(pgid, signal.SIGKILL)
    psutil.wait_procs(members, timeout=10)
    return [p.pid for p in members]
