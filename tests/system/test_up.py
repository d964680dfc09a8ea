"""`llmops up`: the engine leads a session of its own (so that engine_nice weighs against vLLM's sessions where the
kernel groups by session), and an interrupt of `llmops up` still stops it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from engine.vllm import free_port
from tests.testkit.wait import wait_until


def _engine_of(up: subprocess.Popen[bytes]) -> psutil.Process | None:
    for child in psutil.Process(up.pid).children():
        try:
            if "engine" in child.cmdline()[3:4]:
                return child
        except psutil.Error:
            continue
    return None


def test_up_starts_the_engine_in_its_own_session_and_an_interrupt_still_stops_it(tmp_path: Path) -> None:
    port, console_port = free_port(), free_port()
    env = {**os.environ, "LLMOPS_AUTOSTART": "false"}
    up = subprocess.Popen([sys.executable, "-m", "engine.cli", "up", "--data-dir", str(tmp_path / "data"), "--port",
                           str(port), "--console-port", str(console_port)], env=env, start_new_session=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    engine: psutil.Process | None = None
    try:
        engine = wait_until(lambda: _engine_of(up), 60, what="the engine started by llmops up")

        def healthy() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 120, every=0.3, what="the engine's /healthz")
        assert os.getsid(engine.pid) == engine.pid  # a session of its own, led by the engine
        autogroup = Path(f"/proc/{engine.pid}/autogroup")
        if autogroup.exists() and os.geteuid() == 0:  # -10 needs CAP_SYS_NICE: root has it
            assert autogroup.read_text().split()[-1] == "-10"
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group, not the engine
        assert up.wait(timeout=120) is not None
        wait_until(lambda: not engine.is_running() or engine.status() == psutil.STATUS_ZOMBIE, 60,
                   what="the engine to stop after llmops up was interrupted")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        if engine is not None and engine.is_running():  # its own session: not reached by the group's kill
            os.killpg(engine.pid, signal.SIGKILL)
