"""Stopping a child stops its whole process group, even members that ignore SIGTERM (as vLLM workers may)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import psutil

from engine.vllm import ChildLog, VllmChild, free_port, group_members, reap_orphans
from tests.testkit.wait import eventually

# A server that forks a worker; the worker ignores SIGTERM, like a stuck vLLM worker holding memory.
TREE = """
import os, signal, sys, time
pid = os.fork()
if pid == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("worker", os.getpid(), flush=True)
    while True: time.sleep(1)
print("server", os.getpid(), flush=True)
while True: time.sleep(1)
"""


def test_stop_kills_the_whole_group_and_logs_output(tmp_path: Path) -> None:
    async def go() -> None:
        log = ChildLog(tmp_path / "logs" / "vllm.log", 10_000, 1)
        child = VllmChild([sys.executable, "-c", TREE], {}, free_port(), 1, log, tmp_path / "run" / "vllm.json")
        await child.spawn()
        await eventually(lambda: len(child.lines) >= 2, 10, every=0.05, what="the tree's two lines")
        assert child.pid is not None
        members = group_members(child.pid)
        assert len(members) == 2
        assert (tmp_path / "run" / "vllm.json").exists()
        seconds = await child.stop(timeout=1.0)
        assert seconds < 15
        assert group_members(child.pid) == []
        assert not any(psutil.pid_exists(p.pid) and p.status() != psutil.STATUS_ZOMBIE for p in members)
        assert not (tmp_path / "run" / "vllm.json").exists()
        text = (tmp_path / "logs" / "vllm.log").read_text()
        assert "server" in text and "worker" in text and "revision 1" in text

    asyncio.run(go())


def test_the_server_exit_is_seen_at_once_though_its_worker_holds_the_log_pipe(tmp_path: Path) -> None:
    """vLLM's engine core keeps the log pipe open after its API server dies: the exit is seen through the process
    itself (a pidfd), not the pipe's end, and the engine is told the moment it happens."""
    import os
    import signal

    async def go() -> None:
        log = ChildLog(tmp_path / "logs" / "vllm.log", 10_000, 1)
        seen: list[VllmChild] = []
        child = VllmChild([sys.executable, "-c", TREE], {}, free_port(), 1, log, tmp_path / "run" / "vllm.json",
                          cwd=tmp_path, on_exit=seen.append)
        await child.spawn()
        await eventually(lambda: len(child.lines) >= 2, 10, every=0.05, what="the tree's two lines")
        assert child.pid is not None and not child.exited
        assert Path(os.readlink(f"/proc/{child.pid}/cwd")) == tmp_path  # it runs where it is told, not here
        os.kill(child.pid, signal.SIGKILL)  # the server only: the worker lives on, holding stdout
        await eventually(lambda: seen == [child], 10, every=0.02, what="the exit callback")
        assert child.exited and child._pump_task is not None and not child._pump_task.done()  # pipe still open
        await child.stop(timeout=1.0)
        assert child._pump_task.done()

    asyncio.run(go())


# An engine that starts a child and dies without stopping it (as under SIGKILL).
DYING_ENGINE = """
import asyncio, os, sys
from pathlib import Path
from engine.vllm import ChildLog, VllmChild, free_port

async def main():
    folder = Path(sys.argv[1])
    log = ChildLog(folder / "vllm.log", 10_000, 1)
    child = VllmChild([sys.executable, "-c", sys.argv[2]], dict(os.environ), free_port(), 1, log,
                      folder / "vllm.json")
    await child.spawn()
    while len(child.lines) < 2:
        await asyncio.sleep(0.05)
    print(child.pid, flush=True)
    os._exit(0)

asyncio.run(main())
"""


def test_orphans_of_a_dead_engine_are_reaped(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", DYING_ENGINE, str(tmp_path), TREE], capture_output=True, text=True,
                         timeout=60, check=True)
    pgid = int(out.stdout.split()[-1])
    assert len(group_members(pgid)) == 2
    assert len(reap_orphans(tmp_path / "vllm.json")) == 2
    assert group_members(pgid) == []
    assert not (tmp_path / "vllm.json").exists()
