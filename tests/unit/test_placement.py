"""Placement: the local path never imports Ray; the Ray path's actor code (engine/placement/actor.py) is imported by
Ray's workers, and its guard kills vLLM's process group when the actor that started it is gone."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest


def test_no_ray_on_the_local_path(tmp_path: Path) -> None:
    """`make run` and every other test run without Ray: the engine with local placement never imports it."""
    import subprocess
    import sys

    code = ("import sys; from engine.app import create_app; from engine.config import AppConfig; "
            f"create_app(AppConfig(data_dir={str(tmp_path)!r}, autostart=False)); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip().splitlines()[-1] == "False"


# An actor as Ray runs one: a process holding VllmProcessImpl, which starts a server that forks a worker (as
# vLLM's API server forks its engine core); then the actor dies as a node loss kills it, by SIGKILL.
ACTOR = """
import sys, time
from engine.placement.actor import VllmProcessImpl
tree = "import os, time\\nif os.fork() == 0:\\n    print('worker', os.getpid(), flush=True)\\n" \\
       "    time.sleep(300)\\nprint('server', os.getpid(), flush=True)\\ntime.sleep(300)\\n"
actor = VllmProcessImpl("a")
info = actor.start([sys.executable, "-c", tree, "--port", "0"], {}, sys.argv[1], host="127.0.0.1")
while len(actor.read(0)[1]) < 2:
    time.sleep(0.05)
print(info["pid"], flush=True)
time.sleep(300)
"""


def test_the_guard_stops_vllm_when_its_actor_dies(tmp_path: Path) -> None:
    """A node lost (its raylet and actors SIGKILLed) must not leave its vLLM serving and holding memory: vLLM's
    engine core outlives its API server, so the actor starts a guard that kills the whole group."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    from engine.vllm import group_members
    from tests.testkit.wait import wait_until

    actor = subprocess.Popen([sys.executable, "-c", ACTOR, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        assert actor.stdout is not None
        group = int(actor.stdout.readline())
        members = group_members(group)
        assert len(members) == 2  # the server and its worker, in a group of their own
        assert Path(os.readlink(f"/proc/{group}/cwd")) == tmp_path
        os.kill(actor.pid, signal.SIGKILL)
        wait_until(lambda: group_members(group) == [], 10, every=0.1, what="the guard stopping the group")
        assert not any(psutil.pid_exists(p.pid) and p.status() != psutil.STATUS_ZOMBIE for p in members)
    finally:
        actor.kill()
        actor.wait(10)


def test_the_guard_stops_vllm_when_its_raylet_dies_before_its_actor(tmp_path: Path) -> None:
    """A node removed kills its raylet first; its actor (a worker the raylet started) exits only a second or two
    later (the engine saw the node's instance gone 1.8-2.0 s after the kill). The guard watches the actor's parent
    too: vLLM's group is killed once the raylet is gone, though the actor still runs."""
    import os
    import signal
    import subprocess
    import sys

    from engine.vllm import group_members
    from tests.testkit.wait import wait_until

    actor_then_self = ACTOR.replace('print(info["pid"], flush=True)', 'print(info["pid"], os.getpid(), flush=True)')
    actor_then_self = actor_then_self.replace("import sys, time", "import os, sys, time")
    raylet_code = ("import subprocess, sys, time\n"
                   "subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
                   "time.sleep(300)\n")
    raylet = subprocess.Popen([sys.executable, "-c", raylet_code, actor_then_self, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])
    actor_pid = 0
    try:
        assert raylet.stdout is not None
        group, actor_pid = (int(x) for x in raylet.stdout.readline().split())
        assert len(group_members(group)) == 2
        os.kill(raylet.pid, signal.SIGKILL)  # the raylet dies; its actor lives on
        raylet.wait(10)
        wait_until(lambda: group_members(group) == [], 10, every=0.1, what="the guard stopping the group")
        os.kill(actor_pid, 0)  # the actor itself still ran when vLLM's group was gone
    finally:
        if raylet.poll() is None:
            raylet.kill()
        if actor_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(actor_pid, signal.SIGKILL)


def test_the_guard_stops_vllm_when_the_raylet_died_before_the_guard_began_to_watch() -> None:
    """A loaded CI host: the raylet was killed before the guard's first line ran, and the guard, looking for the
    actor's parent itself, found the process the actor had been handed to instead, watched it, and never stopped
    vLLM's group. The actor names its parent when it starts the guard; one already gone stops the group at once."""
    import os
    import subprocess
    import sys

    from engine.placement.actor import GUARD
    from tests.testkit.wait import wait_until

    vllm = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    raylet = subprocess.Popen([sys.executable, "-c", "pass"])
    raylet.wait(10)  # gone before the guard starts
    guard = subprocess.Popen([sys.executable, "-c", GUARD, str(os.getpid()), str(vllm.pid), str(raylet.pid)],
                             start_new_session=True)
    try:
        wait_until(lambda: vllm.poll() is not None, 10, every=0.1, what="the guard stopping the group")
        assert guard.wait(10) == 0
    finally:
        for proc in (vllm, guard):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_an_instance_on_the_engines_own_ray_node_is_a_process_of_this_host(tmp_path: Path) -> None:
    """On the H200, with the engine a driver of a one-node Ray cluster, pre-flight counted its own vLLM's 119 GiB as
    another process's ("only 20.46 GiB of 139.80 GiB is free now") and planned every change as a pause: an
    instance of the engine's own node was not one of the host's vLLM processes. It is; one on another node is not."""
    from engine.placement.cluster import RayChild
    from engine.vllm import ChildSpec
    from engine.vllm.logs import ChildLog

    def child(node: str) -> RayChild:
        spec = ChildSpec(args=[], env={}, port=0, revision_id=1, log=ChildLog(tmp_path / "vllm.log", 1 << 20, 1),
                         pidfile=tmp_path / "pid", name="a", cwd=None, api_key=None, node=node)
        return RayChild(spec, own_node="head")

    assert child("head").local
    assert not child("worker-2").local


def _probed(tmp_path: Path, port: int, lost: list[str]) -> object:
    from engine.placement.cluster import RayChild
    from engine.vllm import ChildSpec
    from engine.vllm.logs import ChildLog

    spec = ChildSpec(args=[], env={}, port=0, revision_id=1, log=ChildLog(tmp_path / "vllm.log", 1 << 20, 1),
                     pidfile=tmp_path / "pid", name="a", cwd=None, api_key=None, node="worker-2")
    child = RayChild(spec, on_lost=lost.append, own_node="head")
    child._address, child.port = "127.0.0.1", port
    return child


def test_a_port_that_refuses_after_answering_is_the_instance_lost(tmp_path: Path) -> None:
    """A node removed takes its vLLM with it (the guard kills the group); Ray declares its actor dead only seconds
    later (1.74 s measured on this host). The probe from the engine sees the port refuse and says the instance is
    lost itself, naming the port, and its node gets nothing new: the gateway stops sending there."""
    import asyncio
    import socket

    from engine.placement.cluster import RayChild

    async def scenario() -> tuple[RayChild, list[str], int]:
        lost: list[str] = []
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        child = _probed(tmp_path, port, lost)
        assert isinstance(child, RayChild)
        task = asyncio.create_task(child._probe())
        accepted = 0
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        while accepted < 2:  # it answered: the probe knows the port
            conn, _ = await asyncio.wait_for(loop.sock_accept(listener), 10)
            conn.close()
            accepted += 1
        listener.close()  # the process is gone: nothing listens on the port any more
        await asyncio.wait_for(task, 10)
        return child, lost, port

    child, lost, port = asyncio.run(scenario())
    assert child.exited and lost == ["worker-2"]
    assert child.lost is not None and f"127.0.0.1:{port} refused a connection" in child.lost


def test_a_port_not_yet_open_or_closed_by_a_stop_is_not_a_loss(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A starting vLLM refuses connections until it listens, and a stopped one refuses them after: neither is a
    node lost."""
    import asyncio
    import socket

    from engine.placement.cluster import RayChild

    tries: list[int] = []
    connect = asyncio.open_connection

    async def counted(*args: Any, **kwargs: Any) -> Any:
        tries.append(1)
        return await connect(*args, **kwargs)

    monkeypatch.setattr(asyncio, "open_connection", counted)

    async def scenario() -> tuple[RayChild, list[str]]:
        lost: list[str] = []
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        child = _probed(tmp_path, port, lost)
        assert isinstance(child, RayChild)
        task = asyncio.create_task(child._probe())
        deadline = time.monotonic() + 20
        while len(tries) < 6 and time.monotonic() < deadline:  # six refused connects before it ever answered
            await asyncio.sleep(0.05)
        assert len(tries) >= 6 and not child.exited and child.lost is None
        child.stop_requested = True
        child._gone()
        await asyncio.wait_for(task, 10)
        return child, lost

    child, lost = asyncio.run(scenario())
    assert lost == [] and child.lost is None
